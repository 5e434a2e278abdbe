"""Stage names: a module path, and for a module the forward calls several times, which call.

Note [Stages that are calls of one module]
------------------------------------------
A stage is usually a module the training forward calls once (``blocks.3``). A model may
also call one module several times in one forward: ALBERT's encoder runs its one shared
layer group ``num_hidden_layers`` times, looped and recurrent-depth transformers apply one
block N times. Each call is then a stage of its own, named ``path#k`` for the k-th call
(0-based, in call order) of the module at ``path`` in one training forward
(``encoder.layer#0 .. encoder.layer#5``). What sets such stages apart from ordinary ones:

* the module object is the same for all of them, so whatever turns a stage name into a
  module strips the call index first (:func:`module_path`; in torch code
  ``remat.runtime.stage_calls.stage_module``);
* the runtime replaces the module's ``forward`` once, with a dispatcher that hands each call
  to the stage the engine expects (in forward: the next stage of the chain; in a rebuild:
  the stage whose recorded call is replayed), never a bare call counter, since a rebuild
  calls the module again;
* the parameters are shared: torch sums the gradient of every call into one ``.grad``,
  made by the backward of the last call (the first backward reaches) and complete after
  the first call's backward. The profile counts them once, at the last call-stage.

A name without ``#`` is the module's only call, as it always was: plans and profiles made
before call-stages existed read and apply unchanged.
"""

from __future__ import annotations

from remat.core.errors import UsageError

__all__ = ["CALL_MARK", "call_index", "call_name", "module_path", "split_stage_name"]

CALL_MARK = "#"


def split_stage_name(name: str) -> tuple[str, int | None]:
    """``("enc.layer", 2)`` for ``"enc.layer#2"``, ``("enc.layer", None)`` for a plain path.

    Raises UsageError for a call index that is not a whole number >= 0 written plainly.
    """
    path, mark, index = name.rpartition(CALL_MARK)
    if not mark:
        return name, None
    if not index.isdigit() or not index.isascii() or (len(index) > 1 and index[0] == "0") \
            or not path:
        raise UsageError(
            f"stage {name!r} has a malformed call index after '#'; write PATH#K with K the "
            "0-based call of the module at PATH in one forward (e.g. encoder.layer#0)")
    return path, int(index)


def module_path(name: str) -> str:
    """The module path of stage ``name`` (the call index, if any, dropped)."""
    return split_stage_name(name)[0]


def call_index(name: str) -> int | None:
    """Which call of its module stage ``name`` is (None: the module's only call)."""
    return split_stage_name(name)[1]


def call_name(path: str, k: int) -> str:
    """The name of the ``k``-th call (0-based) of the module at ``path``."""
    return f"{path}{CALL_MARK}{k}"
