"""Log lines: one per event, with the machine and workflow it concerns as fields; JSON when asked.

Fields come from, in order of precedence: the logging call's ``extra``, the
activity's input (set by ``LogContextInterceptor`` for the activity's
duration), and the Temporal workflow or activity the line was logged in.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from contextvars import ContextVar
from datetime import UTC, datetime
from typing import Any

from temporalio import activity, workflow
from temporalio.worker import (
    ActivityInboundInterceptor,
    ExecuteActivityInput,
    Interceptor,
)

FIELDS = ("machine_id", "provider", "provider_id", "workflow_id")
NOISY_LOGGERS = ("asyncssh", "aiohttp.access", "alembic", "pgserver")

_machine_context: ContextVar[dict[str, str] | None] = ContextVar("shepherd_machine_context", default=None)


class ContextFilter(logging.Filter):
    """Puts the FIELDS on every record that has them to give."""

    def filter(self, record: logging.LogRecord) -> bool:
        """Set each of the FIELDS on the record: its own value, else the Temporal workflow id or the machine context."""
        found: dict[str, str] = {}
        temporal = getattr(record, "temporal_workflow", None) or getattr(record, "temporal_activity", None)
        if isinstance(temporal, dict) and temporal.get("workflow_id"):
            found["workflow_id"] = str(temporal["workflow_id"])
        found.update(_machine_context.get() or {})
        for name in FIELDS:
            value = getattr(record, name, None) or found.get(name)
            setattr(record, name, value)
        return True


class TextFormatter(logging.Formatter):
    """Log lines as text, with the FIELDS a record has in brackets after the message."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        """The record as a text line, with the FIELDS it has in brackets after the message."""
        line = super().format(record)
        fields = " ".join(f"{name}={getattr(record, name)}" for name in FIELDS if getattr(record, name, None))
        if not fields:
            return line
        head, newline, rest = line.partition("\n")  # keep a traceback below the fields
        return f"{head} [{fields}]{newline}{rest}"


class JsonFormatter(logging.Formatter):
    """Log lines as one JSON object each, with the FIELDS a record has and any traceback as ``error``."""

    def format(self, record: logging.LogRecord) -> str:
        """The record as one JSON object: time, level, logger, message, the FIELDS it has and any error."""
        entry: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        entry.update({name: getattr(record, name) for name in FIELDS if getattr(record, name, None)})
        if record.exc_info:
            entry["error"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def configure_logging(log_format: str = "text", *, verbose: bool = False) -> None:
    """Log to stderr as text or JSON, at DEBUG when verbose, with the noisy libraries quieted."""
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(ContextFilter())
    handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(logging.DEBUG if verbose else logging.INFO)
    for noisy in NOISY_LOGGERS:
        logging.getLogger(noisy).setLevel(logging.WARNING)
    # sushy logs "authentication failed, check credentials" at ERROR on every BMC without a session service,
    # then falls back to Basic auth, which works; what really fails reaches Shepherd's own error messages.
    logging.getLogger("sushy").setLevel(logging.DEBUG if verbose else logging.CRITICAL)
    # The fields carry what the SDK would otherwise append to every message as a dict.
    workflow.logger.workflow_info_on_message = False
    activity.logger.activity_info_on_message = False


class LogContextInterceptor(Interceptor):
    """Gives every log line of an activity the machine its input names."""

    def intercept_activity(self, next: ActivityInboundInterceptor) -> ActivityInboundInterceptor:
        """Wrap the activity so that its log lines carry the machine fields and workflow id."""
        return _ActivityLogContext(next)


class _ActivityLogContext(ActivityInboundInterceptor):
    """Sets the machine fields of an activity's input, and its workflow id, for the lines it logs."""

    async def execute_activity(self, input: ExecuteActivityInput) -> Any:
        fields = {"workflow_id": activity.info().workflow_id or ""}
        if input.args:
            for name in ("machine_id", "provider", "provider_id"):
                value = getattr(input.args[0], name, None)
                if isinstance(value, str) and value:
                    fields[name] = value
        token = _machine_context.set(fields)
        try:
            return await super().execute_activity(input)
        finally:
            _machine_context.reset(token)


class ThrottledLog:
    """Logs one line a kind every `every` seconds, with how many lines it stands for: for what may come in floods
    (junk from the network, an outage's errors), where each occurrence is counted in a metric besides."""

    def __init__(self, logger: logging.Logger, every: float) -> None:
        self.logger, self.every = logger, every
        # Kind -> (when last logged, how many since).
        self._logged: dict[str, tuple[float, int]] = {}

    def __call__(self, level: int, kind: str, message: str, *args: object) -> None:
        """Log the message unless one of its kind was logged lately; the next says how many it stands for."""
        now = time.monotonic()
        last, unlogged = self._logged.get(kind, (float("-inf"), 0))
        if now - last < self.every:
            self._logged[kind] = (last, unlogged + 1)
            return
        self._logged[kind] = (now, 0)
        more = f"; {unlogged} more since the last line" if unlogged else ""
        self.logger.log(level, message + "%s", *args, more)
