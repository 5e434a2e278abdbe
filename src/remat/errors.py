"""The one exception family remat raises for problems a user can fix."""

from __future__ import annotations


class RematError(Exception):
    """Base class of every error remat raises on purpose.

    The message is one sentence that says what was wrong and what to do.
    """

    exit_code = 1


class UsageError(RematError, ValueError):
    """Bad input: an option, a size, a model spec, a plan that does not fit the model."""

    exit_code = 2


class CheckFailed(RematError):
    """A check the user asked for did not pass (gradients differ, budget infeasible)."""

    exit_code = 1
