"""Which links of the chain a region may span: one forward with one region over all stages.

A region replays the model's own code between its stages (Note [Glue between stages] in
``remat/runtime/glue.py``). This pass records that code over the whole chain once, with
the engine told to note rather than raise where a link cannot be replayed
(``Engine.breaks``): the code there reads tensor values into Python or changes a tensor
from outside in place, or the next stage gets a tensor made before the previous stage
ran (a region over that link would hold it from forward to backward, which the cost
model does not count). Nothing is saved (one region holds only its input) and no
backward runs; buffers are put back afterwards.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from torch import nn

from remat.errors import UsageError
from remat.plan import Plan, Region
from remat.profiling._tensors import buffers_restored

__all__ = ["find_breaks"]


def find_breaks(
    model: nn.Module,
    batch: Any,
    loss_fn: Callable[[nn.Module, Any], Any],
    names: Sequence[str],
) -> tuple[str | None, ...]:
    """Per stage, why no region may span the link into it from the previous one (or None)."""
    from remat.runtime import apply

    n = len(names)
    if n < 2:
        return (None,) * n
    plan = Plan(stages=tuple(names), regions=(Region(0, n),), solver="profile")
    with buffers_restored(model):
        handle = apply(model, plan)
        engine = handle._installation.engine
        breaks: list[str | None] = [None] * n
        engine.breaks = breaks
        try:
            loss = loss_fn(model, batch)
            del loss
        except UsageError as err:  # the chain cannot be one region at all (grad mode, ...)
            reason = str(err)
            return (None, *(breaks[i] or reason for i in range(1, n)))
        finally:
            handle.remove()
    return tuple(breaks)
