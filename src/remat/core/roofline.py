"""Times without the hardware: a step's work, counted per stage, priced for a device.

An op costs ``flops / (peak[dtype] * flop_efficiency) + bytes / (bandwidth *
bandwidth_efficiency) + op_overhead_s``: the compute and memory parts added, not the
larger of the two (eager kernels rarely overlap them, and on a CPU the sum fits the
measured times better), plus what launching one op costs (Python dispatch on a CPU, the
launch on an accelerator). The work comes from counting one step's ops
(``remat.profiling.op_costs``); the figures from the device table
(``remat.core.devices``), measured on this machine by ``remat calibrate`` (which also
times each op of its calibration model and of a reference convolutional network, as a
rate plus a per-call kernel cost: those replace the generic figures where they apply).
An estimate:
fused kernels, overlap and caches are not modelled (docs/fake.md). Torch-free.

A stage's forward is its forward ops, its backward its backward ops, its rebuild its
forward up to the last tensor it saves (Note [A rebuild stops at its last saved tensor])
plus what checkpoint's pack hook costs per tensor the stage saves for backward
(``Device.pack_seconds``: on this CPU about 8 us a tensor, which made encdec's rebuilds
1.15x to 1.25x their forwards); a selective option's replay is the forward less the ops
whose outputs it saves (``save-matmuls``: the matmul group;
``save-attention``: the attention group; ``save-nothing``: none of them).

Note [A convolution's rate is its shape's]: on a CPU a convolution's FLOP rate depends on
its shape far more than on its FLOPs. One thread here: 3x3 stride-1 at 8 channels ran
at 26 GFLOP/s, at 64 at 55-63; 3x3 stride 2 at about half of stride 1's; 1x1 stride-2
shortcuts at 3-20 (oneDNN reorders the whole input into its blocked layout and
vectorizes over channels). One rate per FLOP, or one plus a cost per call, priced
ResNet's first blocks 23-32% low and its later ones up to 49% high. So ``remat
calibrate`` times a grid of convolutions alone (``extra["conv_rates"]``: kernel 1 and 3,
stride 1 and 2, 4 to 256 channels, outputs of 2 to 32 pixels a side, 8 images;
``remat.profiling.device_calibration.conv_rates``) and the op counter charges a
convolution's FLOPs under its shape class (:func:`conv_class`: kernel, stride, channels,
output side); the roofline prices a forward convolution at the rate interpolated among
the grid's nearest shapes of the same kernel and stride class, in logarithms of the
channels and the output side (:func:`conv_rate`). On the built-in ResNet, ConvNet-BN and
UNet's forward convolutions as they run in the models that gave a median error of 14%
per call. Forward only: timed alone, a convolution's backward ran 1.7-2.3x slower than
the same backward inside ResNet (and a grid of backwards put ResNet's per-stage overhead
10 points low), so backward convolutions keep the rates fitted inside the reference
network (``op_rates``). A convolution with groups, a transposed one or an entry without
the grid keep the rate per FLOP.

Note [A rebuild stops at its last saved tensor]: torch's non-reentrant checkpoint (early
stop on, as remat runs it) ends a rebuild as soon as the stage's last saved tensor is
packed again, and autograd packs an op's saved inputs before the op runs: a stage that
ends in a linear layer does not run that layer's matmul in its rebuild, nor anything after
it. On the built-in mlp-hetero a block's rebuild measured 0.70x its forward, and the
residual loop's (``x = x + block(x)``, a wide MLP block) 0.6x. So the op counter notes per
stage the forward's ops after its last saved tensor (``WorkTable.tails``), and the rebuild
is priced without them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from remat.core.devices import Device

__all__ = ["GROUPS", "OUTSIDE", "Work", "WorkTable", "conv_class", "conv_rate", "seconds"]

#: Where work outside every stage is charged (the pre- and post-chain, the optimizer).
OUTSIDE = "outside the chain"
#: The op groups a selective option may save the outputs of.
GROUPS = ("matmul", "attention", "other")
_CONVOLUTIONS = ("convolution", "_convolution", "convolution_backward")
_CONV = "|conv "  # a FLOP key's mark of a convolution's shape class, after its dtype
_SAVED_GROUPS = {"selective:save-matmuls": ("matmul",),
                 "selective:save-attention": ("attention",),
                 "selective:save-nothing": ()}


def conv_class(dtype: str, kernel: int, stride: int, in_channels: int, out_channels: int,
               out_side: int) -> str:
    """The key a convolution's FLOPs are counted under (Note [A convolution's rate is its
    shape's]): its dtype, then its shape class."""
    return (f"{dtype}{_CONV}{int(kernel)} {int(stride)} {int(in_channels)} "
            f"{int(out_channels)} {int(out_side)}")


def _split_class(key: str) -> tuple[str, tuple[int, ...] | None]:
    dtype, _, shape = key.partition(_CONV)
    return dtype, (tuple(int(x) for x in shape.split()) if shape else None)


def conv_rate(rates: Iterable[Iterable[float]], shape: tuple[int, ...],
              nearest: int = 4) -> float | None:
    """Forward FLOP/s of a convolution of ``shape`` (kernel, stride, in and out channels,
    output side) among ``rates``' rows (kernel, stride, in, out, side, FLOP/s): the
    weighted geometric mean of the ``nearest`` rows of its kernel and stride
    class (kernel 1 or larger, stride 1 or larger), by distance in logarithms of the
    fewer and the more channels and the output side. None without such rows."""
    kernel, stride, cin, cout, side = shape
    wanted = (kernel > 1, stride > 1)
    found = []
    for row in rates:
        k, st, ci, co, o, rate = (float(x) for x in row)
        if (k > 1, st > 1) != wanted:
            continue
        d = math.hypot(math.log(min(ci, co) / max(1, min(cin, cout))),
                       math.log(max(ci, co) / max(1, max(cin, cout))),
                       math.log(o / max(1, side)))
        found.append((d, rate))
    if not found:
        return None
    found.sort()
    near = found[:nearest]
    weights = [1.0 / (d + 0.05) ** 2 for d, _ in near]
    return math.exp(sum(w * math.log(r) for w, (_, r) in zip(weights, near, strict=True))
                    / sum(weights))


@dataclass(frozen=True)
class Work:
    """FLOPs by dtype name, bytes read and written, ops launched."""

    flops: Mapping[str, int] = field(default_factory=dict)
    bytes: int = 0
    ops: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "flops", MappingProxyType(dict(self.flops)))

    def __add__(self, other: Work) -> Work:
        flops = dict(self.flops)
        for dtype, n in other.flops.items():
            flops[dtype] = flops.get(dtype, 0) + n
        return Work(flops, self.bytes + other.bytes, self.ops + other.ops)

    @property
    def total_flops(self) -> int:
        return sum(self.flops.values())


def seconds(work: Work, device: Device, op: str | None = None,
            phase: str | None = None) -> float:
    """``work``'s time on ``device`` (module docstring); the work of op ``op`` at the
    rate ``remat calibrate`` measured for it on this device, where it did, and a call in
    ``phase`` at what a call cost there."""
    rate = device.op_rates.get(op) if op is not None else None
    per_call = device.call_seconds(phase)
    # forward only: timed alone, a convolution's backward ran 1.7-2.3x slower than the
    # same backward inside ResNet (its in-network rates, op_rates, price it instead)
    grid = device.extra.get("conv_rates") if op in ("convolution", "_convolution") else None
    shaped = 0.0
    if grid:  # each shape class at its rate (whole: memory and all), the rest as below
        rest: dict[str, int] = {}
        for key, n in work.flops.items():
            dtype, shape = _split_class(key)
            found = conv_rate(grid, shape) if shape is not None else None
            if found:
                shaped += n / found
            else:
                rest[dtype] = rest.get(dtype, 0) + n
        if not rest:
            return shaped + work.ops * per_call
        work = Work(rest, work.bytes, work.ops)
    if rate is not None:  # seconds per FLOP, per byte and per kernel call
        return (shaped + work.total_flops * rate[0] + work.bytes * rate[1]
                + work.ops * (rate[2] + per_call))
    compute = 0.0
    conv = device.extra.get("conv_flops_per_s") if op in _CONVOLUTIONS else None
    for key, n in work.flops.items():
        dtype = _split_class(key)[0]
        peak = device.peak_flops.get(dtype) or device.peak_flops.get("float32") or 1.0
        compute += n / (float(conv) if conv else peak * device.flop_efficiency)
    memory = work.bytes / (device.bandwidth_bytes_per_s * device.bandwidth_efficiency)
    return shaped + compute + memory + work.ops * per_call


def _sum(works: Iterable[Work]) -> Work:
    total = Work()
    for w in works:
        total = total + w
    return total


class WorkTable:
    """Work by (stage or :data:`OUTSIDE`, phase, group, op name); phases ``forward``,
    ``backward``, ``optimizer``."""

    def __init__(self, table: Mapping[tuple[str, str, str, str], Work],
                 spent: Mapping[tuple[str, str, str, str], float] | None = None,
                 packs: Mapping[str, int] | None = None,
                 tails: Mapping[str, Mapping[tuple[str, str, str, str], Work]] | None = None
                 ) -> None:
        self.table = dict(table)
        # kernel seconds by the same keys, where the ops were timed as they ran
        self.spent = dict(spent or {})
        # per stage, the tensors its forward saved for backward, and the forward's ops
        # after the last of them (a rebuild does not run them)
        self.packs = dict(packs or {})
        self.tails = {stage: dict(ops) for stage, ops in (tails or {}).items()}

    def work(self, stage: str, phase: str, groups: Iterable[str] = GROUPS) -> Work:
        wanted = set(groups)
        return _sum(w for (s, p, g, _), w in self.table.items()
                    if s == stage and p == phase and g in wanted)

    def time(self, stage: str, phase: str, device: Device,
             groups: Iterable[str] = GROUPS) -> float:
        """The stage's ops of ``groups`` in ``phase``, each priced by its own rate."""
        wanted = set(groups)
        return sum(seconds(w, device, op, phase) for (s, p, g, op), w in self.table.items()
                   if s == stage and p == phase and g in wanted)

    def forward(self, stage: str, device: Device) -> float:
        return self.time(stage, "forward", device)

    def backward(self, stage: str, device: Device) -> float:
        return self.time(stage, "backward", device)

    def rebuild(self, stage: str, device: Device) -> float:
        """The stage's forward again up to its last saved tensor, each tensor it saves
        packed for its backward."""
        skipped = sum(seconds(w, device, op, phase)
                      for (_, phase, _, op), w in self.tails.get(stage, {}).items())
        return (self.forward(stage, device) - skipped
                + self.packs.get(stage, 0) * device.pack_seconds())

    def replay(self, stage: str, option: str, device: Device) -> float:
        """What ``option`` replays of the stage's forward in its backward."""
        # a policy of named ops: priced as replaying the whole forward
        saved = _SAVED_GROUPS.get(option, ())
        return self.time(stage, "forward", device, [g for g in GROUPS if g not in saved])

    def outside(self, device: Device) -> float:
        """The pre- and post-chain's forward and backward and the optimizer step."""
        return sum(self.time(OUTSIDE, phase, device)
                   for phase in ("forward", "backward", "optimizer"))
