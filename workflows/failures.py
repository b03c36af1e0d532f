"""How a workflow tells what failed: the innermost message of an activity's failure, and its type."""

from __future__ import annotations

from temporalio import workflow
from temporalio.exceptions import ActivityError, ApplicationError

with workflow.unsafe.imports_passed_through():
    from lifecycle.machine_text import failure_text


def _innermost(error: BaseException) -> BaseException:
    while isinstance(error, ActivityError) and error.cause is not None:
        error = error.cause
    return error


def describe_failure(error: BaseException) -> str:
    """The innermost message of an activity failure: what went wrong on the machine, on one line cut to a length.

    It is kept in the status, which rides along through every continue-as-new, and shown in the UI and the log:
    whatever an activity let through of a machine's or a provider's words is cut here at the latest."""
    cause = _innermost(error)
    if isinstance(cause, ApplicationError) and cause.type:
        return failure_text(f"{cause.type}: {cause.message}")
    return failure_text(str(cause))


def failure_type(error: BaseException) -> str | None:
    """The type of the application error at the bottom of an activity failure, or None."""
    cause = _innermost(error)
    return cause.type if isinstance(cause, ApplicationError) else None
