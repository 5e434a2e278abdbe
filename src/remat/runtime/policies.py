"""Stage options resolved against the installed torch: selective policies and offload hooks."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils.checkpoint import create_selective_checkpoint_contexts

from remat.core.errors import UsageError
from remat.core.plan_format import KEEP, OFFLOAD, parse_option

__all__ = [
    "ATTENTION_OPS",
    "COLLECTIVE_OPS",
    "MATMUL_OPS",
    "ROUTING_OPS",
    "StagePolicy",
    "discard_saved_tensors",
    "offload_saved_tensors",
    "resolve",
    "routes",
    "routing_contexts",
    "selective_contexts",
    "wants_offload",
]

_aten = torch.ops.aten


def _existing(*names: str) -> tuple[Any, ...]:
    """``aten.<name>.default`` for each name this torch has (kernels differ by version)."""
    return tuple(getattr(_aten, n).default for n in names if hasattr(_aten, n))


#: Scaled-dot-product attention kernels: their outputs are expensive to rebuild.
ATTENTION_OPS = _existing(
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
)
#: Matrix products (``linear`` rarely reaches the dispatcher, but costs nothing to list).
MATMUL_OPS = (*_existing("mm", "addmm", "bmm", "linear"), *ATTENTION_OPS)



def _functional(*names: str) -> tuple[Any, ...]:
    """``_c10d_functional.<name>.default`` for each this torch has (DTensor's collectives
    go through them; none where torch.distributed is not built)."""
    packet = getattr(torch.ops, "_c10d_functional", None)
    found = []
    for name in names:
        try:
            found.append(getattr(packet, name).default)
        except (AttributeError, RuntimeError):
            continue
    return tuple(found)


#: Functional collectives (tensor and sequence parallelism's, DTensor's redistributions):
#: saving their outputs keeps a rebuild from communicating again (torchtitan's selective
#: policy saves ``reduce_scatter_tensor``'s).
COLLECTIVE_OPS = _functional(
    "all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce", "all_to_all_single",
    "broadcast", "all_gather_into_tensor_coalesced", "reduce_scatter_tensor_coalesced",
    "all_reduce_coalesced",
)

#: Routing decisions (mixture-of-experts routers take their experts with ``topk``, a
#: switch router with ``argmax``): saved, a rebuild cannot pick other experts than the
#: forward did, whatever its logits come out as.
ROUTING_OPS = (
    *_existing("topk", "argmax", "argsort", "sort"),
    _aten.max.dim,
    *((_aten.sort.stable,) if hasattr(_aten.sort, "stable") else ()),
)

_NAMED = {"save-matmuls": MATMUL_OPS, "save-attention": ATTENTION_OPS, "save-nothing": (),
          "save-collectives": COLLECTIVE_OPS, "save-routing": ROUTING_OPS}


@dataclass(frozen=True)
class StagePolicy:
    """How one stage saves when it runs with grad: ``keep``, ``selective`` or ``offload``."""

    kind: str
    ops: tuple[Any, ...] = ()  # OpOverloads saved by a selective stage; others are rebuilt
    # selective:budget=<fraction>: inductor's partitioner saves, under this
    # activation_memory_budget (compiled stages only)
    budget: float | None = None

    @property
    def is_keep(self) -> bool:
        return self.kind == KEEP.kind

    @property
    def is_offload(self) -> bool:
        return self.kind == OFFLOAD.kind


def resolve(option: str, stage: str) -> StagePolicy:
    """Resolve a plan option for ``stage``; UsageError names an op this torch lacks."""
    parsed = parse_option(option)
    if parsed.kind != "selective":
        return StagePolicy(parsed.kind)
    if parsed.policy is not None:
        return StagePolicy("selective", _NAMED[parsed.policy])
    if parsed.budget is not None:
        return StagePolicy("selective", budget=parsed.budget)
    ops: list[Any] = []
    for name in parsed.ops:
        packet_name, _, overload = name.partition(".")
        packet: Any = getattr(_aten, packet_name, None)
        if not callable(getattr(packet, "overloads", None)):
            raise UsageError(
                f"stage {stage!r}: option {option!r} names op {name!r}, which torch "
                f"{torch.__version__} does not have; use aten op names such as mm or addmm"
            )
        # A bare name means every overload (``add`` is add.Tensor, add.Scalar, ...).
        for o in [overload] if overload else packet.overloads():
            if o not in packet.overloads():
                raise UsageError(
                    f"stage {stage!r}: op {packet_name!r} has no overload {o!r}; "
                    f"choose one of {', '.join(packet.overloads())}"
                )
            ops.append(getattr(packet, o))
    return StagePolicy("selective", tuple(dict.fromkeys(ops)))


def selective_contexts(policy: StagePolicy) -> tuple[Any, Any]:
    """torch's selective-checkpoint pair: MUST_SAVE for ``policy.ops``, rebuild the rest."""
    return create_selective_checkpoint_contexts(list(policy.ops))


# Note [Routing saved in regions]: a mixture-of-experts router picks experts with topk
# (argmax) over logits a rebuild computes again; anything that moves them, far inside any
# tolerance, can flip a near-tie and send tokens to other experts than the forward did.
# A region over a stage that routes (one holding a module with an ``experts`` child, the
# layout of transformers' Mixtral, Qwen2-MoE, DeepSeek and most MoE code), and a
# selective option on one, keep the forward's decisions: the forward records each routing
# op's indices (a few bytes per token; the profile does not count them), and the rebuild
# takes them instead of choosing again, gathering the values at those indices from the
# rebuilt input (so gradients flow as in the forward). Not torch's selective checkpoint:
# it hands back the forward's own output tensors, and routers normalise their top-k
# weights in place (Mixtral's ``routing_weights /= ...``), which it refuses.


def routes(module: nn.Module) -> bool:
    """Whether ``module`` holds a mixture-of-experts layer: a submodule with a child
    called ``experts`` (Note [Routing saved in regions])."""
    return any("experts" in m._modules for m in module.modules())


_ROUTING = frozenset(ROUTING_OPS)


def _indices(func: Any, out: Any) -> torch.Tensor:
    return out if isinstance(out, torch.Tensor) else out[1]


def _replayed(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
              idx: torch.Tensor) -> Any:
    """``func``'s output with the recorded indices ``idx`` (Note [Routing saved ...]), made
    past every dispatch mode: to the modes above, the routing op ran and nothing else."""
    with _disable_current_modes():
        return _replay(func, args, kwargs, idx)


def _replay(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
            idx: torch.Tensor) -> Any:
    idx = idx.clone()
    if func in (_aten.argmax.default, _aten.argsort.default):
        return idx
    source = args[0]
    if func is _aten.max.dim:
        dim = args[1] if len(args) > 1 else kwargs["dim"]
        keepdim = args[2] if len(args) > 2 else kwargs.get("keepdim", False)
        at = idx if keepdim else idx.unsqueeze(dim)
        values = source.gather(dim, at)
        return (values if keepdim else values.squeeze(dim)), idx
    if func is _aten.topk.default:
        dim = args[2] if len(args) > 2 else kwargs.get("dim", -1)
    else:  # sort
        dim = kwargs.get("dim", args[1] if len(args) > 1 and func is _aten.sort.default else -1)
    return source.gather(dim, idx), idx


class _RecordRouting(TorchDispatchMode):
    def __init__(self, record: list[torch.Tensor]) -> None:
        super().__init__()
        self.record = record

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None
                           ) -> Any:
        out = func(*args, **(kwargs or {}))
        if func in _ROUTING:
            with _disable_current_modes():
                self.record.append(_indices(func, out).detach().clone())
        return out


class _ReplayRouting(TorchDispatchMode):
    def __init__(self, record: list[torch.Tensor]) -> None:
        super().__init__()
        self.record, self.position = record, 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None
                           ) -> Any:
        kwargs = kwargs or {}
        if func not in _ROUTING or self.position >= len(self.record):
            return func(*args, **kwargs)
        idx = self.record[self.position]
        self.position += 1
        return _replayed(func, args, kwargs, idx)


def routing_contexts() -> tuple[Any, Any]:
    """A forward context recording routing decisions and a rebuild context replaying
    them (Note [Routing saved in regions]), for a checkpoint's ``context_fn``."""
    record: list[torch.Tensor] = []
    return _RecordRouting(record), _ReplayRouting(record)


def wants_offload(tensor: object) -> bool:
    """Offloading pays only when the stage's input lives on an accelerator."""
    return isinstance(tensor, torch.Tensor) and tensor.device.type != "cpu"


def offload_saved_tensors() -> contextlib.AbstractContextManager[Any]:
    """Saved tensors go to pinned host memory and come back when backward needs them."""
    return torch.autograd.graph.save_on_cpu(pin_memory=True)


def _drop(_tensor: torch.Tensor) -> None:
    return None


def _unreachable(_packed: None) -> torch.Tensor:
    raise AssertionError("remat: a tensor dropped during a rebuild was unpacked")


def discard_saved_tensors() -> contextlib.AbstractContextManager[Any]:
    """Drop what autograd saves (a rebuild whose saved tensors backward never reads)."""
    return torch.autograd.graph.saved_tensors_hooks(_drop, _unreachable)
