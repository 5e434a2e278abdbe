"""Moved to :mod:`remat.parallel.tensor`; these names are re-exported so that old imports
keep working."""

from remat.parallel.tensor import (
    Collective,
    CollectiveCount,
    StageCollectives,
    agreed_plan,
    count_collectives,
    init_fake_ranks,
    stage_comms,
)

__all__ = ["Collective", "CollectiveCount", "StageCollectives", "agreed_plan",
           "count_collectives", "init_fake_ranks", "stage_comms"]
