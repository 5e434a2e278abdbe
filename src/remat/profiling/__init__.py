"""The pieces of ``remat.profile``: forward passes, step timelines, timings, region overhead.

Each module measures one thing; :mod:`remat.profiling.profiler` puts them together into a
:class:`~remat.core.profile_format.Profile`.
"""
