"""The torch-free planning core: plan and profile records, the problem, the simulator and
cost model, the solvers, recipes, theory, units, errors and the JSON artifact helper.

Nothing here imports torch or any ``remat`` module outside ``remat.core`` (standard
library, numpy and the optional numba only); ``tests/test_architecture.py`` checks it.
See ``docs/architecture.md`` for the layers above.
"""

__version__ = "0.1.0"
