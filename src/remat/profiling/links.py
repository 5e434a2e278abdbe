"""Which links of the chain a region may span, and what a region would hold from before
it: one forward with one region over all stages.

A region replays the model's own code between its stages (Note [Glue between stages] in
``remat/runtime/glue.py``). This pass records that code over the whole chain once, with
the engine told to note rather than raise where a link cannot be replayed
(``Engine.breaks``): the code there reads tensor values into Python or changes a tensor
from outside in place, or the next stage gets a tensor made before the previous stage
ran as its input. It also notes, per stage, the tensors made earlier in the pass that
the stage's call or the code before it reads besides its input (``Engine.reads``: skip
connections, a position bias passed on): a region over that read that opens after the
tensor was made keeps it to its backward, which the simulator counts
(:class:`~remat.core.profile_format.HeldRead`). Nothing is saved (one region holds only its
input) and no backward runs; buffers are put back afterwards.

Note [Gradients pending before the chain]
-----------------------------------------
The pass also sums, per stage, the tensors made before the chain that a later stage (or
the code before it) reads and that get a gradient (a time embedding every block is
passed): their gradients gather from the last reader's backward to the pre-chain's
(``before_chain_grad_bytes``, charged as ``pending_grad_bytes``). A parameter is not one
of them: its gradient is a parameter gradient, made at its reader's backward and counted
with the others (the pre-chain's, or the stage's). hf:bart's decoder embeds its input in
the code between the encoder and the decoder, reading the shared token embedding, the
position embedding and a norm's weights (1,038,336 bytes of parameters): charged as
gradients pending at every encoder layer's backward, each was predicted 707,584 bytes over
(-1.7% at 75%). What is really pending there is read off the step without checkpointing
(``remat.profiling.backward_surplus``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from torch import nn

from remat.core.errors import UsageError
from remat.core.plan_format import Plan, Region
from remat.core.stage_record import HeldRead
from remat.profiling._tensors import buffers_restored

__all__ = ["Links", "find_breaks"]


class Links(NamedTuple):
    breaks: tuple[str | None, ...]  # per stage: why no region may span the link into it
    reads: tuple[tuple[HeldRead, ...], ...]  # per stage: what it reads from before it
    # per stage: the bytes of the gradients that tensors made before the chain and read
    # by it or a later stage gather (a time embedding passed to every block): alive from
    # the last reader's backward to the pre-chain's, so at this stage's backward
    before_chain_grad_bytes: tuple[int, ...] = ()


def find_breaks(
    model: nn.Module,
    batch: Any,
    loss_fn: Callable[[nn.Module, Any], Any],
    names: Sequence[str],
) -> Links:
    """Per stage, why no region may span the link into it from the previous one (or None),
    and the tensors made before it that it reads."""
    from remat.runtime import apply

    n = len(names)
    if n < 2:
        return Links((None,) * n, ((),) * n, (0,) * n)
    plan = Plan(stages=tuple(names), regions=(Region(0, n),), solver="profile")
    with buffers_restored(model):
        handle = apply(model, plan)
        engine = handle._installation.engine
        breaks: list[str | None] = [None] * n
        engine.breaks = breaks
        engine.reads = [[] for _ in range(n)]
        engine.tape.sizes = []
        try:
            loss = loss_fn(model, batch)
            del loss
        except UsageError as err:  # the chain cannot be one region at all (grad mode, ...)
            reason = str(err)
            return Links((None, *(breaks[i] or reason for i in range(1, n))), ((),) * n,
                         (0,) * n)
        finally:
            handle.remove()
    inputs = engine.input_slots
    reads = tuple(
        tuple(
            HeldRead(k, made_after, nbytes, made_after < n and inputs[made_after] == k, by_call)
            for k, made_after, nbytes, by_call in dict.fromkeys(engine.reads[i])
        )
        for i in range(n)
    )
    last: dict[int, tuple[int, int]] = {}  # tensor -> (its last reader, bytes)
    for i in range(n):
        for key, nbytes in engine.reads_before[i]:
            last[key] = (i, nbytes)
    before = tuple(sum(b for j, b in last.values() if j > i) for i in range(n))
    return Links(tuple(breaks), reads, before)
