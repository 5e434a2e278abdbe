"""remat: budget-optimal, automatic and verified activation checkpointing for PyTorch."""

from __future__ import annotations

from remat.errors import CheckFailed, RematError, UsageError

__version__ = "0.1.0"

__all__ = ["CheckFailed", "RematError", "UsageError", "__version__"]
