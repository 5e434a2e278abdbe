"""The in-script entry: ``remat.auto_checkpoint`` and the plans it keeps on disk."""

from __future__ import annotations

from remat.in_script.script_entry import AutoCheckpoint, AutoCheckpointReport, auto_checkpoint

__all__ = ["AutoCheckpoint", "AutoCheckpointReport", "auto_checkpoint"]
