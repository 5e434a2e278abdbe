"""Applying a plan to a live model: ``apply(model, plan) -> Handle`` and ``remove(model)``."""

from __future__ import annotations

from remat.runtime.install import Handle, applied, apply, remove

__all__ = ["Handle", "applied", "apply", "remove"]
