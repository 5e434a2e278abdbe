"""Stopping a command at a named step: what the main job and every command share.

A command runs in steps (loading the model, the first training step, profiling, ...);
:func:`step` turns what stops one into :class:`Stopped`, which names the step, keeps the
cause's exit code (2 a usage error, 3 the user's own code, 1 a failed check) and says
what to do in one sentence. :func:`first_step` runs one plain training step so the
user's code fails there, named, rather than deep inside profiling. ``remat profile``,
``plan``, ``verify``, ``bench`` and ``auto`` all use these; they live apart from the main
job so that the other commands do not depend on it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from remat.core.errors import (
    INTERRUPTS,
    CheckFailed,
    RematError,
    UserCodeError,
)
from remat.measure.model_state import refuse_meta
from remat.measure.step import NO_GRAD

from .factory import failure

__all__ = ["REJECTED", "STAGES", "Stopped", "exit_words", "first_step", "hazard_reason",
           "rebuild_rejected", "step"]

#: The steps of the main job, in order (``Stopped.stage`` is one of them).
STAGES = ("loading the model", "the first training step", "profiling", "planning",
          "applying", "verifying", "measuring", "profiling again", "measuring again")
# Where an exception that is not remat's comes from the user's own code.
_USER_CODE = {
    "loading the model": "the model factory raised {error}; fix the factory (--debug "
                         "shows the traceback)",
    "the first training step": "the model's forward, loss_fn or backward raised {error}; fix "
                               "them so that one plain training step runs (--debug shows the "
                               "traceback)",
}
# remat never exits on its own: a SystemExit in any step is the user's code it ran
_USER_CODE_RAN = ("the model's forward or loss_fn raised {error}; remove that call, or guard "
                  "it with if __name__ == '__main__' (--debug shows where)")
# What torch says when a checkpointed region's rebuild differs from its forward
# (CheckpointError, and selective checkpointing's plain RuntimeError).
REJECTED = "torch rejected the rebuild of a checkpointed region"  # how such reasons start
_REJECTED = ("different number of tensors was saved", "different metadata",
             "not found in storage", "more tensors during recomputation")


class Stopped(RematError):
    """A run stopped before its report: at which step (``stage``), and why.

    ``exit_code`` is the cause's (2 for the user's mistakes, 3 for the user's own code
    failing, 1 for a failed check); the
    cause stays chained. ``minimum_budget_bytes``: with an infeasible budget, the least
    one any plan fits.
    """

    def __init__(self, stage: str, reason: str, exit_code: int,
                 minimum_budget_bytes: int | None = None) -> None:
        super().__init__(f"{stage}: {reason}")
        self.stage, self.reason, self.exit_code = stage, reason, exit_code
        self.minimum_budget_bytes = minimum_budget_bytes

    def to_dict(self) -> dict[str, Any]:
        found: dict[str, Any] = {"stage": self.stage, "message": self.reason,
                                 "exit_code": self.exit_code}
        if self.minimum_budget_bytes is not None:
            found["minimum_budget_bytes"] = self.minimum_budget_bytes
        return found


def rebuild_rejected(err: BaseException) -> bool:
    """Whether ``err`` is torch refusing a rebuild that did not match its forward."""
    from torch.utils.checkpoint import CheckpointError

    return isinstance(err, CheckpointError) or (
        isinstance(err, RuntimeError) and any(text in str(err) for text in _REJECTED))


def hazard_reason(err: BaseException, factory: Callable[[], Any] | None,
                  stages: Sequence[str] | None) -> str:
    """One sentence for a rejected rebuild: the hazard ``remat verify`` finds behind it.

    ``factory()`` builds a fresh ``(model, batch, loss_fn)``; verify runs one step of it
    with one region per stage and its hazard detectors watching.
    """
    import remat.plans as plans
    from remat.verification.harness import verify

    said = str(err).strip().removeprefix("torch.utils.checkpoint: ").splitlines()
    rejected = f"{REJECTED} ({type(err).__name__}: {said[0][:200] if said else ''})"
    hint = "run remat verify --plan per-stage on the model to see why"
    if factory is None:
        return f"{rejected}; {hint}"
    try:
        model, batch, loss_fn = factory()
        report = verify(model, batch, plans.per_stage(model, stages=stages), loss_fn, steps=1)
    except Exception:  # the diagnosis is a courtesy: the rejection is the error
        return f"{rejected}; {hint}"
    hazards = report.blocking_hazards
    if not hazards:
        return f"{rejected}; {hint}"
    h = hazards[0]
    where = f" in stage {h.stage!r}" if h.stage else ""
    more = (f" ({len(hazards) - 1} more: remat verify --plan per-stage lists them)"
            if len(hazards) > 1 else "")
    return f"{rejected}: remat verify finds a {h.kind} hazard{where}: {h.message}{more}"


@contextmanager
def step(stage: str, *, diagnose: Callable[[BaseException], str] | None = None
         ) -> Iterator[None]:
    """Run one step of a command; what stops it becomes :class:`Stopped` naming the step.

    remat's own errors keep their message and exit code; a rejected rebuild becomes the
    hazard sentence (``diagnose``, default :func:`hazard_reason` without a model), exit
    1; any other exception while loading the model or in the first training step is the
    user's code failing, exit 3. Anything else propagates: it is a bug, with a traceback.
    """
    try:
        yield
    except Stopped:
        raise
    except RematError as err:
        raise Stopped(stage, str(err), err.exit_code) from err
    except Exception as err:
        if rebuild_rejected(err):
            reason = diagnose(err) if diagnose else hazard_reason(err, None, None)
            raise Stopped(stage, reason, CheckFailed.exit_code) from err
        if stage in _USER_CODE:
            reason = _USER_CODE[stage].format(error=failure(err))
            raise Stopped(stage, reason, UserCodeError.exit_code) from err
        raise
    except (SystemExit, KeyboardInterrupt) as err:
        # sys.exit() (or argparse reading remat's own command line at import) and a
        # KeyboardInterrupt no Ctrl-C sent are the user's code failing, not a way out
        if isinstance(err, SystemExit) or INTERRUPTS.raised_by_code():
            reason = _USER_CODE.get(stage, _USER_CODE_RAN).format(error=exit_words(err))
            raise Stopped(stage, reason, UserCodeError.exit_code) from err
        raise


def exit_words(err: BaseException) -> str:
    """``SystemExit(0)`` or ``KeyboardInterrupt``, as the user's code raised it."""
    if isinstance(err, SystemExit):
        return (f"SystemExit({err.code!r}) (sys.exit, or argparse reading the command line "
                "at import)")
    return f"{type(err).__name__} (no Ctrl-C was pressed)"



def _article(noun: str) -> str:
    return f"{'an' if noun[:1].lower() in 'aeiou' else 'a'} {noun}"



def first_step(model: Any, batch: Any, loss_fn: Callable[[Any, Any], Any]) -> None:
    """One plain training step (gradients dropped after), so that the user's own code
    fails here, named, instead of deep inside profiling."""
    refuse_meta(model, batch, fake=False)  # no step to run: a usage error, not the user's code
    with step("the first training step"):
        loss = loss_fn(model, batch)
        if not isinstance(loss, torch.Tensor):
            raise UserCodeError(
                f"loss_fn returned {_article(type(loss).__name__)}, not a tensor; make "
                "loss_fn(model, batch) return the loss as a scalar tensor"
            )
        if loss.numel() != 1 or not loss.is_floating_point():
            raise UserCodeError(
                f"loss_fn returned a {str(loss.dtype).removeprefix('torch.')} tensor of shape "
                f"{tuple(loss.shape)}, not a scalar loss; reduce it to one number (e.g. .mean())"
            )
        if not loss.requires_grad:
            raise UserCodeError(NO_GRAD)
        loss.backward()
    model.zero_grad(set_to_none=True)


