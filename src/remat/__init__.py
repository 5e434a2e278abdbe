"""remat: budget-optimal, automatic and verified activation checkpointing for PyTorch.

The torch-free parts (``remat.theory``, ``remat.solve``, the plan and profile formats)
import without torch; the rest is loaded on first use, so ``import remat`` stays cheap.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from remat.errors import CheckFailed, RematError, UsageError, UserCodeError

__version__ = "0.1.0"

# Public name -> module that defines it, imported on first access (PEP 562).
_LAZY: dict[str, str] = {
    "apply": "remat.runtime",
    "verify": "remat.verify",
    "remove": "remat.runtime",
    "applied": "remat.runtime",
    "Handle": "remat.runtime",
    "Plan": "remat.plan",
    "Region": "remat.plan",
    "plan": "remat.plan",
    "profile": "remat.profiler",
    "Profile": "remat.profile_format",
    "bench": "remat.bench",
    "auto": "remat.bench",
}

if TYPE_CHECKING:
    from remat.plan import Plan, Region
    from remat.profile_format import Profile
    from remat.profiler import profile
    from remat.runtime.apply import Handle, applied, apply, remove

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
    "plan",
    "profile",
    "remove",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'remat' has no attribute {name!r}")
    imported = importlib.import_module(module)
    # remat.plan and remat.verify are callable modules: the module is the value.
    value = imported if module == f"remat.{name}" else getattr(imported, name)
    globals()[name] = value
    return value
