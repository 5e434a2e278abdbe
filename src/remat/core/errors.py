"""The one exception family remat raises for problems a user can fix.

Each error carries the exit code the command line ends with (``remat --help`` and
README's Commands section list them): 1 a check failed, 2 a usage error, 3 the user's
own code (model factory, forward, loss_fn, backward) failed.
"""

from __future__ import annotations


class RematError(Exception):
    """Base class of every error remat raises on purpose.

    The message is one sentence that says what was wrong and what to do.
    """

    exit_code = 1


class UsageError(RematError, ValueError):
    """Bad input: an option, a size, a model spec, a plan that does not fit the model."""

    exit_code = 2


class UserCodeError(UsageError):
    """The user's own code failed: the model factory raised or returned the wrong thing,
    or the forward, ``loss_fn`` or backward raised or gave no scalar loss."""

    exit_code = 3


class CheckFailed(RematError):
    """A check the user asked for did not pass (gradients differ, budget infeasible)."""

    exit_code = 1


#: Exit code of an exception remat did not expect (a bug, or a case it does not handle).
UNEXPECTED_EXIT_CODE = 4


class _Interrupts:
    """Whether a KeyboardInterrupt is the user pressing Ctrl-C or their code raising it.

    The ``remat`` command (``remat.cli.main``) installs a SIGINT handler that sets ``seen``
    before it raises KeyboardInterrupt, and sets ``watching`` while it is installed; under
    it, a KeyboardInterrupt with ``seen`` unset came from the user's own code (exit 3, not
    130). Without the handler (the Python API) every KeyboardInterrupt is an interruption.
    """

    def __init__(self) -> None:
        self.watching = False
        self.seen = False

    def raised_by_code(self) -> bool:
        """Whether a KeyboardInterrupt caught now was raised by code, not by a Ctrl-C."""
        return self.watching and not self.seen


INTERRUPTS = _Interrupts()
