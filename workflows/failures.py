"""How a workflow tells what failed: the innermost message of an activity's failure."""

from __future__ import annotations

from temporalio.exceptions import ActivityError, ApplicationError


def describe_failure(error: BaseException) -> str:
    """The innermost message of an activity failure: what went wrong on the machine."""
    while isinstance(error, ActivityError) and error.cause is not None:
        error = error.cause
    if isinstance(error, ApplicationError) and error.type:
        return f"{error.type}: {error.message}"
    return str(error)
