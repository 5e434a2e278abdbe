"""Moved to :mod:`remat.parallel.pipeline`; these names are re-exported so that old
imports keep working."""

from remat.parallel.pipeline import (
    apply_to_stage,
    dropped_checkpoints,
    part_loss,
    profile_part,
    rank_step_peak,
    receive_buffers,
    schedule_buffers,
    schedule_orders,
    split_figures,
    split_stage,
)

__all__ = ["apply_to_stage", "dropped_checkpoints", "part_loss", "profile_part",
           "rank_step_peak", "receive_buffers", "schedule_buffers", "schedule_orders",
           "split_figures", "split_stage"]
