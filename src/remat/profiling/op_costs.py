"""What one training step asks of the hardware, per stage: FLOPs, bytes moved, op count.

One forward and backward (and the optimizer step) run under a dispatch mode that
counts, for every aten op, its FLOPs (torch's ``torch.utils.flop_counter`` formulas:
matmuls, convolutions, attention), the bytes of the tensors it reads and writes, and one
op; each op is charged to the stage it ran in (``torch.utils.module_tracker``), forward
or backward, and to its group (``matmul``, ``attention``, ``other``: what a selective
option saves the output of). ``remat.core.roofline`` turns the counts into times for a
device, and per stage the tensors its forward saves for backward (a rebuild packs each
again) and the ops its forward runs after the last of them (Note [A rebuild stops at its
last saved tensor] in ``remat.core.roofline``). Works on real and fake tensors alike;
each op is also timed as it runs when asked (``remat calibrate``, on a real model).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils import flop_counter
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.module_tracker import ModuleTracker

from remat.core.roofline import OUTSIDE, Work, WorkTable, conv_class
from remat.measure.model_state import model_restored
from remat.measure.step import make_optimizer

__all__ = ["count_work", "stage_of"]

_aten = torch.ops.aten
_MATMUL = {_aten.mm, _aten.addmm, _aten.bmm, _aten.baddbmm, _aten.convolution,
           _aten.convolution_backward, _aten._convolution}
_CPU_FLASH = _aten._scaled_dot_product_flash_attention_for_cpu
_CPU_FLASH_BACKWARD = _aten._scaled_dot_product_flash_attention_for_cpu_backward
_UNSAFE_VIEW = _aten._unsafe_view
_CONVOLUTION_OPS = {_aten.convolution, _aten.convolution_backward}
# what a tensor's device, size or layout is: no kernel runs (transformers asks a fake
# tensor's device about a hundred times a layer, which counted its bytes as read)
_QUERIES = {torch.ops.prim.device, _aten.sym_size, _aten.sym_stride, _aten.sym_numel,
            _aten.sym_storage_offset, _aten.is_contiguous}


def _conv_key(packet: Any, args: Sequence[Any], out: Any, dtype: str) -> str:
    """A 2-D convolution's FLOP key with its shape class (Note [A convolution's rate is
    its shape's] in :mod:`remat.core.roofline`); ``dtype`` for any other."""
    backward = packet is _aten.convolution_backward
    # convolution(input, weight, bias, stride, padding, dilation, transposed, ...,
    # groups); convolution_backward(grad_output, input, weight, bias_sizes, stride, ...)
    x, weight = (args[1], args[2]) if backward else (args[0], args[1])
    stride = args[4] if backward else args[3]
    transposed, groups = (args[7], args[9]) if backward else (args[6], args[8])
    result = args[0] if backward else out
    if (transposed or groups != 1 or x.dim() != 4 or weight.dim() != 4
            or not isinstance(result, torch.Tensor)
            or weight.shape[-1] != weight.shape[-2] or len(set(stride)) != 1):
        return dtype
    return conv_class(dtype, weight.shape[-1], stride[0], weight.shape[1], weight.shape[0],
                      result.shape[-1])


def _attention_flops(packet: Any, args: Sequence[Any]) -> int:
    """CPU's fused attention, which torch's table leaves out: its formulas for the CUDA
    kernels of the same shapes."""
    shapes = [tuple(t.shape) for t in args if isinstance(t, torch.Tensor)]
    # grouped key/value heads: the work is per query head (older torch's formulas take
    # equal head counts only)
    query = 0 if packet is _CPU_FLASH else 1
    heads = shapes[query][-3]
    for k in (query + 1, query + 2):  # the key and the value
        shapes[k] = (*shapes[k][:-3], heads, *shapes[k][-2:])
    if packet is _CPU_FLASH:
        return int(flop_counter.sdpa_flop_count(shapes[0], shapes[1], shapes[2]))
    # backward(grad_out, query, key, value, out, logsumexp, ...)
    return int(flop_counter.sdpa_backward_flop_count(shapes[0], shapes[1], shapes[2],
                                                     shapes[3]))


def _nbytes(leaves: Sequence[Any]) -> int:
    return sum(t.numel() * t.element_size() for t in leaves if isinstance(t, torch.Tensor))


def stage_of(modules: ModuleTracker, stages: Sequence[str]) -> str:
    """The stage of ``stages`` running now, as ``modules`` tracks it, else :data:`OUTSIDE`."""
    # the tracker names a module by its path under the root's class name
    parents = {p.split(".", 1)[1] if "." in p else p for p in modules.parents}
    return next((s for s in stages if s in parents), OUTSIDE)


class _Counter(TorchDispatchMode):
    def __init__(self, stages: Sequence[str], modules: ModuleTracker, *,
                 timed: bool = False) -> None:
        super().__init__()
        self.stages = tuple(stages)
        self.modules = modules
        self.phase = "forward"
        self.table: dict[tuple[str, str, str, str], Work] = {}
        self.timed = timed
        # op name -> (seconds, work) over the step, and seconds by key, when timed
        self.times: dict[str, tuple[float, Work]] = {}
        self.spent: dict[tuple[str, str, str, str], float] = {}
        # per stage, the tensors its forward saved for backward, and the forward's ops
        # since the last of them
        self.packs: dict[str, int] = {}
        self.tails: dict[str, dict[tuple[str, str, str, str], Work]] = {}

    def saved(self, stage: str) -> None:
        """``stage``'s forward saved a tensor for backward: a rebuild runs everything up
        to here again."""
        self.packs[stage] = self.packs.get(stage, 0) + 1
        self.tails[stage] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        t0 = time.perf_counter() if self.timed else 0.0
        out = func(*args, **kwargs)
        elapsed = time.perf_counter() - t0 if self.timed else 0.0
        packet = func._overloadpacket
        if packet in _QUERIES:  # a question about a tensor, answered without a kernel
            return out
        if packet in flop_counter.flop_registry:
            flops = int(flop_counter.flop_registry[packet](*args, **kwargs, out_val=out))
        elif packet in (_CPU_FLASH, _CPU_FLASH_BACKWARD):
            flops = _attention_flops(packet, args)
        else:
            flops = 0
        group = ("attention" if "attention" in packet.__name__
                 else "matmul" if packet in _MATMUL else "other")
        inputs = tree_flatten((args, kwargs))[0]
        dtype = next((str(t.dtype).removeprefix("torch.") for t in inputs
                      if isinstance(t, torch.Tensor) and t.is_floating_point()), "float32")
        phase, op = self.phase, packet.__name__
        stage = OUTSIDE if phase == "optimizer" else stage_of(self.modules, self.stages)
        key = (stage, phase, group, op)
        # a view reads and writes nothing (detach, transpose, reshape of a contiguous
        # tensor; _unsafe_view, matmul's reshape of its fresh result); it still costs its
        # dispatch
        moved = (0 if func.is_view or packet is _UNSAFE_VIEW
                 else _nbytes(inputs) + _nbytes(tree_flatten(out)[0]))
        if flops and packet in _CONVOLUTION_OPS:
            dtype = _conv_key(packet, args, out, dtype)
        work = Work(flops={dtype: flops} if flops else {}, bytes=moved, ops=1)
        found = self.table.get(key)
        self.table[key] = work if found is None else found + work
        if phase == "forward" and stage != OUTSIDE:
            tail = self.tails.setdefault(stage, {})
            tail[key] = work if key not in tail else tail[key] + work
        if self.timed:
            spent, total = self.times.get(op, (0.0, Work()))
            self.times[op] = (spent + elapsed, total + work)
            self.spent[key] = self.spent.get(key, 0.0) + elapsed
        return out


def _unpacked(t: torch.Tensor) -> torch.Tensor:
    return t


def count_work(model: nn.Module, batch: Any, loss_fn: Callable[[nn.Module, Any], Any],
               stages: Sequence[str], optimizer: str | torch.optim.Optimizer = "adamw", *,
               times: dict[str, tuple[float, Work]] | None = None) -> WorkTable:
    """Per (stage or ``outside the chain``, phase, group, op): one training step's work.

    ``times``: filled with each op's wall time and work over the step (``remat
    calibrate``: on a real model, each op timed as it runs).

    The optimizer's step is counted as every step after the first runs it: its state is
    made by an uncounted step first (the first step's ``zeros_like`` of every moment,
    a third of AdamW's first-step time on the built-in encdec, is paid once a run, and
    the profile's measured steps do not contain it). The parameters' gradients are freed
    afterwards, the model is put back as it was and a given optimizer's state is restored
    (:func:`remat.measure.model_state.model_restored`).
    """
    modules = ModuleTracker()
    counter = _Counter(stages, modules, timed=times is not None)
    given = optimizer if isinstance(optimizer, torch.optim.Optimizer) else None

    def pack(t: torch.Tensor) -> torch.Tensor:
        if counter.phase == "forward":
            counter.saved(stage_of(modules, stages))
        return t

    with model_restored(model, given):
        opt = make_optimizer(model, optimizer)
        with modules, counter, torch.autograd.graph.saved_tensors_hooks(pack, _unpacked):
            loss = loss_fn(model, batch)
            counter.phase = "backward"
            loss.backward()
            del loss
        opt.step()  # the state made, uncounted
        with modules, counter:
            counter.phase = "optimizer"
            opt.step()
    if times is not None:
        times.update(counter.times)
    return WorkTable(counter.table, counter.spent, counter.packs, counter.tails)
