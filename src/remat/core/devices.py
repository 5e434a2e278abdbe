"""Target devices: what a fake profile assumes about the machine it sizes a step for.

A fake profile (docs/fake.md) runs on this machine's CPU kernels. Where an accelerator's
kernels keep other tensors for backward, the profile runs a stand-in with the
accelerator's saved tensors (``remat.profiling.device_kernels``): scaled dot-product
attention as a fused kernel (its output and log-sum-exp, no ``S x S`` matrix) and
dropout as ``native_dropout`` (a 1-byte mask where the CPU keeps noise in the input's
dtype). The table also holds each device's memory, peak dense matmul throughput by dtype
and memory bandwidth, from the vendors' datasheets, for budgets and for times without
the hardware.

Entries beyond the built-in ones (``remat calibrate`` writes one for this machine's CPU)
live in a JSON file: ``$REMAT_DEVICES`` if set, else ``~/.config/remat/devices.json``;
an entry there replaces the built-in one of the same name. Torch-free.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from types import MappingProxyType
from typing import Any

from remat.core.artifact import unique_keys, write_text
from remat.core.errors import UsageError

__all__ = ["BUILT_IN", "Device", "calibrated", "device_file", "devices", "get_device",
           "save_device", "source_note"]

_GIB = 1 << 30
_MIB = 1 << 20
_T = 1e12


@dataclass(frozen=True)
class Device:
    """One target device.

    ``memory_bytes``: what the device has (as ``nvidia-smi`` / ``rocm-smi`` report it; the
    CUDA context and the allocator's reserve take some of it, so give a budget below);
    ``peak_flops``: dense matmul FLOP/s by dtype name (``bfloat16``, ``float16``,
    ``float32``); ``bandwidth_bytes_per_s``: memory bandwidth; ``fused_attention``:
    attention runs a fused kernel (flash or memory-efficient) that keeps its output and
    log-sum-exp instead of the probabilities; ``fused_dropout``: dropout keeps a 1-byte
    mask (``native_dropout``); ``link_bytes_per_s``: one device's bandwidth to its peers
    in one direction (NVLink, Infinity Fabric), what a collective's ring moves at; None
    where not known (collectives are then priced from a measured figure).
    """

    name: str
    memory_bytes: int
    peak_flops: Mapping[str, float]
    bandwidth_bytes_per_s: float
    fused_attention: bool
    fused_dropout: bool
    source: str = "built-in, from the vendor's datasheet"
    notes: str = ""
    extra: Mapping[str, Any] = field(default_factory=dict)
    # the roofline's factors (remat.core.roofline): the share of the peaks eager kernels
    # reach, and what launching one op costs; assumed for the built-in accelerators,
    # measured by remat calibrate for this machine
    flop_efficiency: float = 0.6
    bandwidth_efficiency: float = 0.7
    op_overhead_s: float = 5e-6
    link_bytes_per_s: float | None = None

    @cached_property  # the roofline asks once per op of every stage
    def op_rates(self) -> Mapping[str, tuple[float, float, float]]:
        """Per aten op name, measured by ``remat calibrate``: seconds per FLOP, per byte
        moved and per call of its kernel (``extra["op_rates"]``, the last 0 where an entry
        has two); empty for the built-in entries."""
        rates = self.extra.get("op_rates") or {}
        return {str(op): (float(r[0]), float(r[1]), float(r[2]) if len(r) > 2 else 0.0)
                for op, r in rates.items()}

    def call_seconds(self, phase: str | None) -> float:
        """What one op's call costs beyond its kernel, in ``phase`` where ``remat
        calibrate`` measured it (``extra["call_s"]``), else ``op_overhead_s``."""
        calls = self.extra.get("call_s") or {}
        return float(calls.get(phase, self.op_overhead_s)) if phase else self.op_overhead_s

    def pack_seconds(self) -> float:
        """What a rebuild costs beyond its forward per tensor it saves for backward
        (checkpoint's pack hook storing it for the stage's backward; ``extra["pack_s"]``,
        measured by ``remat calibrate``; 0 for the built-in entries, unmeasured there)."""
        return float(self.extra.get("pack_s") or 0.0)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name or self.name != self.name.strip():
            raise UsageError(f"device name {self.name!r} must be a non-empty word")
        if isinstance(self.memory_bytes, bool) or not isinstance(self.memory_bytes, int) \
                or self.memory_bytes <= 0:
            raise UsageError(f"device {self.name}: memory_bytes must be a whole number > 0")
        flops = dict(self.peak_flops)
        for dtype, value in flops.items():
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
                raise UsageError(f"device {self.name}: peak_flops[{dtype!r}] must be > 0")
        object.__setattr__(self, "peak_flops", MappingProxyType(flops))
        bandwidth = self.bandwidth_bytes_per_s
        if not isinstance(bandwidth, (int, float)) or isinstance(bandwidth, bool) \
                or bandwidth <= 0:
            raise UsageError(f"device {self.name}: bandwidth_bytes_per_s must be > 0")
        for name in ("flop_efficiency", "bandwidth_efficiency"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) \
                    or not 0 < value <= 1:
                raise UsageError(f"device {self.name}: {name} must be in (0, 1]")
        overhead = self.op_overhead_s
        if not isinstance(overhead, (int, float)) or isinstance(overhead, bool) \
                or overhead < 0:
            raise UsageError(f"device {self.name}: op_overhead_s must be >= 0")
        link = self.link_bytes_per_s
        if link is not None and (not isinstance(link, (int, float)) or isinstance(link, bool)
                                 or link <= 0):
            raise UsageError(f"device {self.name}: link_bytes_per_s must be > 0 (or absent)")
        for flag in ("fused_attention", "fused_dropout"):
            if not isinstance(getattr(self, flag), bool):
                raise UsageError(f"device {self.name}: {flag} must be true or false")
        object.__setattr__(self, "extra", MappingProxyType(dict(self.extra)))

    @property
    def is_accelerator(self) -> bool:
        """Whether its kernels differ from this machine's CPU ones (a stand-in runs)."""
        return self.fused_attention or self.fused_dropout

    def to_dict(self) -> dict[str, Any]:
        return {
            "memory_bytes": self.memory_bytes,
            "peak_flops": dict(self.peak_flops),
            "bandwidth_bytes_per_s": self.bandwidth_bytes_per_s,
            "fused_attention": self.fused_attention,
            "fused_dropout": self.fused_dropout,
            "flop_efficiency": self.flop_efficiency,
            "bandwidth_efficiency": self.bandwidth_efficiency,
            "op_overhead_s": self.op_overhead_s,
            "source": self.source,
            **({"notes": self.notes} if self.notes else {}),
            **({"extra": dict(self.extra)} if self.extra else {}),
            **({"link_bytes_per_s": self.link_bytes_per_s}
               if self.link_bytes_per_s is not None else {}),
        }

    @classmethod
    def from_dict(cls, name: str, data: Any) -> Device:
        if not isinstance(data, Mapping):
            raise UsageError(f"device {name!r} must be a JSON object")
        keys = {"memory_bytes", "peak_flops", "bandwidth_bytes_per_s", "fused_attention",
                "fused_dropout"}
        missing = sorted(keys - set(data))
        optional = {"source", "notes", "extra", "flop_efficiency", "bandwidth_efficiency",
                    "link_bytes_per_s",
                    "op_overhead_s"}
        unknown = sorted(set(data) - keys - optional)
        if missing or unknown:
            what = (f"is missing {', '.join(missing)}" if missing
                    else f"has unknown key(s) {', '.join(unknown)}")
            raise UsageError(f"device {name!r} {what}; write it again with remat calibrate")
        if not isinstance(data["peak_flops"], Mapping):
            raise UsageError(f"device {name!r}: peak_flops must map dtype names to FLOP/s")
        return cls(name=name, memory_bytes=data["memory_bytes"],
                   peak_flops=data["peak_flops"],
                   bandwidth_bytes_per_s=data["bandwidth_bytes_per_s"],
                   fused_attention=data["fused_attention"], fused_dropout=data["fused_dropout"],
                   source=str(data.get("source", "")), notes=str(data.get("notes", "")),
                   extra=data.get("extra", {}),
                   **{k: data[k] for k in ("flop_efficiency", "bandwidth_efficiency",
                                           "op_overhead_s", "link_bytes_per_s") if k in data})


def _gpu(name: str, memory_mib: int, bf16_tflops: float, fp32_tflops: float,
         bandwidth_tb_s: float, link_gb_s: float, notes: str) -> Device:
    return Device(
        name=name,
        memory_bytes=memory_mib * _MIB,
        peak_flops={"bfloat16": bf16_tflops * _T, "float16": bf16_tflops * _T,
                    "float32": fp32_tflops * _T},
        bandwidth_bytes_per_s=bandwidth_tb_s * _T,
        fused_attention=True,
        fused_dropout=True,
        notes=notes,
        link_bytes_per_s=link_gb_s * 1e9,
    )


#: Dense (no sparsity) peaks; float32 is the TF32 tensor-core figure where torch uses it
#: for matmuls only when allowed, so the plain float32 one is listed.
BUILT_IN: Mapping[str, Device] = MappingProxyType({
    d.name: d for d in (
        # links: NVLink 4 900 GB/s and NVLink 3 600 GB/s both ways together; Infinity
        # Fabric 7 links of 64 GB/s each way
        _gpu("h100-sxm", 81_559, 989.4, 66.9, 3.35, 450, "NVIDIA H100 SXM5 80GB HBM3"),
        _gpu("h200", 143_771, 989.4, 66.9, 4.8, 450, "NVIDIA H200 SXM 141GB HBM3e"),
        _gpu("a100-80gb", 81_920, 312.0, 19.5, 2.039, 300, "NVIDIA A100 SXM4 80GB HBM2e"),
        _gpu("mi300x", 196_592, 1307.4, 163.4, 5.3, 448,
             "AMD Instinct MI300X 192GB HBM3 (ROCm: flash attention through AOTriton)"),
        Device(
            name="cpu",
            memory_bytes=16 * _GIB,
            peak_flops={"float32": 0.1 * _T, "bfloat16": 0.05 * _T, "float16": 0.05 * _T},
            bandwidth_bytes_per_s=10e9,
            fused_attention=False,
            fused_dropout=False,
            source="built-in placeholder: run remat calibrate to measure this machine",
            notes="this machine's CPU kernels, as a real profile runs them",
        ),
    )
})


def device_file() -> Path:
    """Where calibrated and user-added entries live (module docstring)."""
    env = os.environ.get("REMAT_DEVICES")
    if env:
        return Path(env)
    return Path.home() / ".config" / "remat" / "devices.json"


def _load(path: Path) -> dict[str, Device]:
    if not path.exists():
        return {}
    try:  # a name given twice is refused, not taken last-wins
        data = json.loads(path.read_bytes(), object_pairs_hook=unique_keys)
    except (OSError, ValueError, RecursionError) as err:
        raise UsageError(f"cannot read the device table {path}: {err}; fix or delete it") \
            from None
    if not isinstance(data, Mapping):
        raise UsageError(f"the device table {path} must be a JSON object of devices by name")
    return {str(name): Device.from_dict(str(name), entry) for name, entry in data.items()}


def devices() -> dict[str, Device]:
    """The built-in table with the user's file over it."""
    return {**BUILT_IN, **_load(device_file())}


def calibrated(name: str) -> Path | None:
    """The user's device table when ``name`` comes from it (``remat calibrate`` or a person
    wrote it), None for a built-in entry it does not replace."""
    path = device_file()
    return path if name in _load(path) else None


def source_note(device: Device) -> str | None:
    """One line saying that ``device`` comes from the user's table, not the built-in one
    (None for a built-in entry); commands that size a step for it print it."""
    path = calibrated(device.name)
    if path is None:
        return None
    shadows = " in place of the built-in entry of that name" if device.name in BUILT_IN else ""
    return (f"note: device {device.name!r} is the entry of the user's device table {path}"
            f"{shadows} ({device.source or 'no source recorded'})")


def get_device(name: str) -> Device:
    """The device called ``name``; UsageError listing the known ones otherwise."""
    table = devices()
    found = table.get(name)
    if found is None:
        raise UsageError(f"unknown device {name!r}; known: {', '.join(sorted(table))} "
                         "(remat calibrate adds this machine's cpu)")
    return found


def save_device(device: Device, path: Path | None = None) -> Path:
    """Write ``device`` into the user's table (replacing an entry of its name)."""
    path = path or device_file()
    entries = {name: d.to_dict() for name, d in _load(path).items()}
    entries[device.name] = device.to_dict()
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text(path, json.dumps(entries, indent=2, sort_keys=True) + "\n")
    return path
