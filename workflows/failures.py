"""How a workflow tells what failed: the innermost message of an activity's failure, and its type."""

from __future__ import annotations

from temporalio.exceptions import ActivityError, ApplicationError


def _innermost(error: BaseException) -> BaseException:
    while isinstance(error, ActivityError) and error.cause is not None:
        error = error.cause
    return error


def describe_failure(error: BaseException) -> str:
    """The innermost message of an activity failure: what went wrong on the machine."""
    cause = _innermost(error)
    if isinstance(cause, ApplicationError) and cause.type:
        return f"{cause.type}: {cause.message}"
    return str(cause)


def failure_type(error: BaseException) -> str | None:
    """The type of the application error at the bottom of an activity failure, or None."""
    cause = _innermost(error)
    return cause.type if isinstance(cause, ApplicationError) else None
