"""remat: budget-optimal, automatic and verified activation checkpointing for PyTorch.

The public entry points are plain functions: ``remat.profile``, ``remat.plan``,
``remat.apply``/``remat.remove``, ``remat.verify``, ``remat.bench``, ``remat.auto`` and,
in a training script, ``remat.auto_checkpoint``.
The torch-free core (:mod:`remat.core`) imports without torch; everything is loaded on
first use (PEP 562), so ``import remat`` stays cheap. ``docs/architecture.md`` maps the
packages.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from remat.core import __version__
from remat.core.errors import CheckFailed, RematError, UsageError, UserCodeError

# Public name -> module that defines it, imported on first access.
_LAZY: dict[str, str] = {
    "apply": "remat.runtime.install",
    "remove": "remat.runtime.install",
    "applied": "remat.runtime.install",
    "Handle": "remat.runtime.install",
    "Plan": "remat.core.plan_format",
    "Region": "remat.core.plan_format",
    "plan": "remat.core.planner",
    "profile": "remat.profiling.profiler",
    "Profile": "remat.core.profile_format",
    "verify": "remat.verification.harness",
    "bench": "remat.benchmarking.bench_job",
    "auto": "remat.benchmarking.main_job",
    "auto_checkpoint": "remat.in_script.script_entry",
    "compile_stages": "remat.runtime.compiled_stages",
    "uncompile_stages": "remat.runtime.compiled_stages",
    "fake_mode": "remat.profiling.fake",
    "trace_regions": "remat.runtime.traced",
}

if TYPE_CHECKING:
    from remat.benchmarking.bench_job import bench
    from remat.benchmarking.main_job import auto
    from remat.core.plan_format import Plan, Region
    from remat.core.planner import plan
    from remat.core.profile_format import Profile
    from remat.in_script.script_entry import auto_checkpoint
    from remat.profiling.fake import fake_mode
    from remat.profiling.profiler import profile
    from remat.runtime.compiled_stages import compile_stages, uncompile_stages
    from remat.runtime.install import Handle, applied, apply, remove
    from remat.runtime.traced import trace_regions
    from remat.verification.harness import verify

__all__ = [
    "CheckFailed",
    "Handle",
    "Plan",
    "Profile",
    "Region",
    "RematError",
    "UsageError",
    "UserCodeError",
    "__version__",
    "applied",
    "apply",
    "auto",
    "auto_checkpoint",
    "bench",
    "compile_stages",
    "fake_mode",
    "plan",
    "profile",
    "remove",
    "trace_regions",
    "uncompile_stages",
    "verify",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'remat' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
