"""Moved: the rank plumbing is :mod:`remat.parallel.ranks` and
:mod:`remat.parallel.data_parallel`, bench's rank runners :mod:`.rank_runners`; these
names are re-exported so that old imports keep working."""

from remat.parallel.data_parallel import rank_problem
from remat.parallel.ranks import rank_zeros

from .rank_runners import RANK_PROFILE_REPEATS, Ranks, profile_rounds

__all__ = ["RANK_PROFILE_REPEATS", "Ranks", "profile_rounds", "rank_problem", "rank_zeros"]
