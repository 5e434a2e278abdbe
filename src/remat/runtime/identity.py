"""Reading a live model's stage identities, and checking a plan's ``made_for`` against them.

The records are torch-free (:mod:`remat.core.model_identity`); this module fills them from
modules (:func:`stage_identity`, :func:`model_stages`) and compares
(:func:`check_made_for`), which ``remat.apply`` runs before it changes anything.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from torch import nn

from remat.core.errors import UsageError
from remat.core.model_identity import MadeFor, StageIdentity, fingerprint
from remat.core.plan_format import Plan
from remat.core.stage_names import call_index, module_path
from remat.runtime.stage_calls import stage_submodule
from remat.runtime.stages import unknown_path_message

__all__ = ["check_made_for", "made_for_model", "model_stages", "plan_notes", "stage_identity",
           "stage_module"]

FORCE_HINT = "pass --force-plan (force=True) to apply it anyway"


def stage_class(module: nn.Module) -> type:
    """The module's own class: wrappers torch.distributed makes on the fly are skipped
    (FSDP2's ``fully_shard`` turns a ``Block`` into an ``FSDPBlock`` subclass)."""
    for cls in type(module).__mro__:
        if not cls.__module__.startswith("torch.distributed."):
            return cls
    return type(module)


def _count(n: int) -> str:
    for size, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "K")):
        if n >= size:
            return f"{n / size:.1f}{suffix}"
    return str(n)


def _widths(module: nn.Module) -> list[tuple[int, int]]:
    """(in, out) widths of the layers inside, in module order: features or channels
    (``nx``/``nf``: transformers' ``Conv1D``, GPT-2's linear layer)."""
    found = []
    for sub in module.modules():
        for a, b in (("in_features", "out_features"), ("in_channels", "out_channels"),
                     ("nx", "nf")):
            x, y = getattr(sub, a, None), getattr(sub, b, None)
            if isinstance(x, int) and isinstance(y, int):
                found.append((x, y))
                break
    return found


def _summary(module: nn.Module, name: str) -> str:
    """``Block(128->512->128, 198.0K params)``: input width, widest output, output width."""
    parts = []
    widths = _widths(module)
    if widths:
        first, last = widths[0][0], widths[-1][1]
        widest = max(out for _, out in widths)
        dims = [first, widest, last] if widest > max(first, last) else [first, last]
        parts.append("->".join(map(str, dims)))
    else:
        extra = module.extra_repr()
        if extra and len(extra) <= 40 and "\n" not in extra:
            parts.append(extra)
    params = sum(p.numel() for p in module.parameters())
    if params:
        parts.append(f"{_count(params)} params")
    dtypes = Counter(p.dtype for p in module.parameters() if p.is_floating_point())
    if dtypes:
        dtype = str(dtypes.most_common(1)[0][0]).removeprefix("torch.")
        if dtype != "float32":
            parts.append(dtype)
    return f"{name}({', '.join(parts)})"


def stage_identity(module: nn.Module) -> StageIdentity:
    """The module's class, the fingerprint of its parameters and buffers, and a summary."""
    name = stage_class(module).__name__
    tensors = [
        *(("param", n, p.shape, str(p.dtype)) for n, p in module.named_parameters()),
        *(("buffer", n, b.shape, str(b.dtype)) for n, b in module.named_buffers()),
    ]
    return StageIdentity(name, fingerprint(tensors), _summary(module, name))


def model_stages(model: nn.Module, stages: Sequence[str]) -> tuple[str, ...]:
    """``stages`` and the blocks beside them, in module order: the children of an
    ``nn.ModuleList`` or ``nn.Sequential`` holding a stage that share a stage's class."""
    found = set(stages)
    covered = {module_path(name) for name in stages}  # a module whose calls are stages
    for name in stages:
        path = module_path(name)
        parent_path, _, _ = path.rpartition(".")
        try:
            parent = model.get_submodule(parent_path)
            module = model.get_submodule(path)
        except AttributeError:
            continue
        if not isinstance(parent, (nn.ModuleList, nn.Sequential)):
            continue
        cls = stage_class(module)
        prefix = f"{parent_path}." if parent_path else ""
        found.update(
            prefix + child_name for child_name, child in parent.named_children()
            if stage_class(child) is cls and prefix + child_name not in covered
        )
    order = {name: i for i, (name, _) in enumerate(model.named_modules())}

    def key(name: str) -> tuple[int, int]:
        return order.get(module_path(name), len(order)), call_index(name) or 0

    return tuple(sorted(found, key=key))


def made_for_model(model: nn.Module, stages: Sequence[str]) -> MadeFor:
    """What a plan over ``stages`` made straight from ``model`` (no profile) is made for."""
    return MadeFor(
        model=type(model).__name__,
        stages=tuple(stage_identity(stage_submodule(model, path)) for path in stages),
        model_stages=len(model_stages(model, stages)),
    )


def _names(names: Sequence[str], chain: Sequence[str]) -> str:
    """``blocks.8 is``, ``blocks.8 and blocks.10 are``, ``blocks.8..blocks.11 are``."""
    if len(names) == 1:
        return f"{names[0]} is"
    at = [chain.index(name) for name in names]
    if len(names) > 2 and at == list(range(at[0], at[0] + len(at))):
        return f"{names[0]}..{names[-1]} are"
    if len(names) <= 3:
        return ", ".join(names[:-1]) + f" and {names[-1]} are"
    return f"{', '.join(names[:3])} and {len(names) - 3} more are"


def _difference(plan: Plan, made_for: MadeFor, modules: Sequence[nn.Module]) -> str | None:
    """What differs between the plan's stages and ``modules``, or None when nothing does."""
    assert made_for.stages is not None
    here = [stage_identity(m) for m in modules]
    differ = [
        i for i, (then, now) in enumerate(zip(made_for.stages, here, strict=True))
        if not then.matches(now)
    ]
    if not differ:
        return None
    i = differ[0]
    then, now = made_for.stages[i], here[i]
    name = plan.stages[i]
    if then.summary != now.summary:
        what = f"stage {name} is {then.summary} in the plan and {now.summary} here"
    else:
        what = (
            f"stage {name} is {now.summary} in the plan and here, but its parameter or "
            f"buffer shapes or dtypes differ (fingerprint {then.fingerprint} in the plan, "
            f"{now.fingerprint} here)"
        )
    if len(differ) > 1:
        what += f" ({len(differ)} of {len(plan.stages)} stages differ)"
    return what


def check_made_for(
    model: nn.Module, plan: Plan, modules: Sequence[nn.Module], *, force: bool = False
) -> tuple[str, ...]:
    """Refuse ``plan`` on ``model`` when its stages differ from what it was made for.

    ``modules`` are the plan's stage modules, in plan order. Raises UsageError naming the
    first stage that differs (unless ``force``); returns notes for the caller to show:
    stages of the model the plan leaves out, and what ``force`` let through.
    """
    made_for = plan.made_for
    if made_for is None:
        return ()
    notes = []
    what = None if made_for.stages is None else _difference(plan, made_for, modules)
    if what is not None:
        made = f" made for {made_for.model}" if made_for.model else ""
        if not force:
            raise UsageError(
                f"the plan{made} does not fit this model: {what}; make a plan for this "
                f"model with remat plan, or {FORCE_HINT}"
            )
        notes.append(f"applied a plan{made} that does not fit this model (forced): {what}")
    if made_for.model_stages is not None:
        chain = model_stages(model, plan.stages)
        if len(chain) > made_for.model_stages:
            left = [name for name in chain if name not in set(plan.stages)]
            notes.append(
                f"the plan names {len(plan.stages)} stages; this model has {len(chain)} "
                f"({_names(left, chain)} not checkpointed); make a plan for this model to "
                "include them"
            )
    return tuple(notes)


def plan_notes(model: nn.Module, plan: Plan, *, force: bool = False) -> tuple[str, ...]:
    """:func:`check_made_for` ahead of ``remat.apply`` (a command shows the notes itself).

    A stage path the model lacks is left for ``apply`` to report.
    """
    try:
        modules = [stage_submodule(model, path) for path in plan.stages]
    except AttributeError:
        return ()
    return check_made_for(model, plan, modules, force=force)


def stage_module(model: nn.Module, plan: Plan, path: str) -> nn.Module:
    """The plan's stage ``path`` in ``model``; UsageError when the model lacks it, naming
    the model the plan was made for where it records one (a plan for another model names
    paths this one does not have: that, not a typo, is the likelier cause)."""
    try:
        return stage_submodule(model, path)
    except AttributeError:
        made = plan.made_for.model if plan.made_for is not None else None
        if made:
            raise UsageError(
                f"the plan made for {made} does not fit this model: it names stage {path!r}, "
                f"which {type(model).__name__} has no submodule at; make a plan for this "
                "model with remat plan"
            ) from None
        raise UsageError(unknown_path_message(model, path)) from None
