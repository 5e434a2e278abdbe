"""``remat.apply(model, plan)`` and ``remat.remove(model)``: install a plan in place, reversibly.

Applying replaces each stage module's ``forward`` with an instance attribute (module
objects, parameters and ``state_dict`` keys stay the same), adds a forward pre-hook
and an ``always_call`` forward hook to the root model, and a forward pre-hook and a
forward hook to each stage inside a multi-stage region. Everything is checked before the
first change, so an error never leaves the model half-wrapped; ``remove`` deletes
exactly what ``apply`` added.

Side effects: unlike plain ``torch.utils.checkpoint``, which re-runs in-place buffer
updates during its rebuild (BatchNorm's running statistics move twice per step), remat
puts mutated buffers back after each rebuild, so they change once per step, as without
checkpointing (see Note [Buffers mutated in forward] in ``engine.py``).

Limits: the model must be called as ``model(...)`` (the hooks mark the pass); in a
multi-stage region each stage's input must be made inside the region and the code between
stages must not read tensor values (checked at run time; Note [Glue between stages] in
``glue.py``); tensors a region uses from outside it are kept alive until its rebuild
(usually masks and rotary tables, alive anyway); the model must not wrap single
stage calls in saved-tensor hooks of its own (regions span calls, and those hooks are a
stack), nor enable its own gradient checkpointing; a rebuild repeats non-tensor side
effects of a stage (e.g. appending to a key/value cache object). ``copy.deepcopy`` of the
model gives a copy with the plan applied to its own stages; pickling it is refused
(Note [Copies of an applied model] in ``engine.py``).
"""

from __future__ import annotations

import contextlib
import copy
import warnings
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

from torch import nn
from torch.utils.hooks import RemovableHandle

from remat.core.errors import UsageError
from remat.core.plan_format import KEEP, Plan
from remat.core.plan_set import OUTSIDE, PlanSet
from remat.core.stage_names import call_index, module_path
from remat.runtime._torch_checkpoint import check_available
from remat.runtime.batch_shape import ShapeHook
from remat.runtime.compiled_stages import CompiledForward, stages_compiled
from remat.runtime.engine import NOT_PICKLED, Engine, PassHook, StageObserver
from remat.runtime.existing import check_apply
from remat.runtime.fsdp_units import check_fsdp_units
from remat.runtime.identity import check_made_for, stage_module
from remat.runtime.policies import ROUTING_OPS, StagePolicy, resolve

__all__ = ["Handle", "applied", "apply", "installed_hook_ids", "observe", "remove"]

_MISSING = object()


@dataclass(eq=False)
class _Installation:
    """What ``apply`` changed on one model; refers to the root only weakly (it is the
    registry's value, the root its key)."""

    engine: Engine
    stages: tuple[nn.Module, ...]
    previous: tuple[Any, ...]  # each stage's own instance-level ``forward``, or _MISSING
    hooks: tuple[RemovableHandle, ...]
    root: weakref.ref[nn.Module] | None = None

    def uninstall(self) -> None:
        for hook in self.hooks:
            hook.remove()
        restore_forwards(self.stages, self.previous)

    def __deepcopy__(self, memo: dict[int, Any]) -> _Installation:
        """The installation on a deep copy of the model, registered as applied to it
        (Note [Copies of an applied model] in engine.py): reached through the root's
        pass hook, while deepcopy copies the root."""
        new = object.__new__(_Installation)
        memo[id(self)] = new
        root = self.root() if self.root is not None else None
        copied_root = memo.get(id(root)) if root is not None else None
        stages = copy.deepcopy(self.stages, memo)
        new.__init__(  # type: ignore[misc]
            copy.deepcopy(self.engine, memo), stages,
            tuple(p if p is _MISSING else copy.deepcopy(p, memo) for p in self.previous),
            tuple(_copied_handle(h, memo) for h in self.hooks),
            None if copied_root is None else weakref.ref(copied_root))
        if copied_root is not None:
            _APPLIED[copied_root] = new
            _WRAPPED.update(stages)
        return new

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise UsageError(NOT_PICKLED)


def _copied_handle(handle: RemovableHandle, memo: dict[int, Any]) -> RemovableHandle:
    """``handle`` on the copies of the hook dictionaries it removes from (the same key)."""
    hooks = handle.hooks_dict_ref()
    extra = [ref() for ref in handle.extra_dict_ref]
    new = RemovableHandle(copy.deepcopy(hooks, memo) if hooks is not None else {},
                          extra_dict=[copy.deepcopy(d, memo) for d in extra if d is not None])
    new.id = handle.id
    return new


def restore_forwards(stages: tuple[nn.Module, ...], previous: tuple[Any, ...]) -> None:
    """Give each stage back its own instance-level ``forward`` (``previous``, or none)."""
    for module, before in zip(stages, previous, strict=True):
        _WRAPPED.discard(module)
        if before is _MISSING:
            del module.forward
        else:
            module.forward = before


@dataclass(eq=False)
class _TracedInstallation:
    """What ``remat.trace_regions`` changed on one model (``remat.runtime.traced``): stage
    forwards only, no engine and no hooks."""

    stages: tuple[nn.Module, ...]
    previous: tuple[Any, ...]

    def uninstall(self) -> None:
        restore_forwards(self.stages, self.previous)


_APPLIED: weakref.WeakKeyDictionary[nn.Module, _Installation | _TracedInstallation] = (
    weakref.WeakKeyDictionary())
_WRAPPED: weakref.WeakSet[nn.Module] = weakref.WeakSet()  # stage modules of applied plans


class AppliedPlan:
    """What a plan applied to a model leaves with the caller: ``remove()`` undoes it, as
    ``remat.remove(model)`` does; ``active`` says whether it is still applied."""

    def __init__(self, model: nn.Module, plan: Plan | PlanSet, installation: Any) -> None:
        self.model = model
        self.plan = plan
        self._installation = installation

    @property
    def active(self) -> bool:
        """Whether the plan is still applied to the model."""
        return _APPLIED.get(self.model) is self._installation

    def remove(self) -> None:
        """Restore the model exactly; same as ``remat.remove(model)``."""
        if not self.active:
            raise UsageError("this plan was already removed from the model; nothing to undo")
        remove(self.model)


class Handle(AppliedPlan):
    """A plan applied to a model: ``handle.remove()`` undoes it, as ``remat.remove`` does."""

    _installation: _Installation

    @property
    def stages(self) -> tuple[nn.Module, ...]:
        """The stage modules, in plan order (a module that is several stages, one per call,
        appears once per call)."""
        return self._installation.engine.modules

    @property
    def running(self) -> Plan:
        """The plan the last training forward ran (of a plan set: its bucket's)."""
        return self._installation.engine.plan

    @property
    def rebuilds(self) -> int:
        """How many region rebuilds ran so far (each backward rebuilds each region once)."""
        return self._installation.engine.rebuilds

    @property
    def notes(self) -> tuple[str, ...]:
        """Things worth knowing about how the plan ran, e.g. offloads that did nothing."""
        engine = self._installation.engine
        return tuple(
            f"offload of stage {engine.names[i]!r} was a no-op: its input is on {device}, "
            "and offloading only pays for inputs on an accelerator"
            for i, device in sorted(engine.offload_noop.items())
        )

    def rebuilt_without_running(self) -> dict[int, frozenset[str]]:
        """Per stage index, the ops whose outputs its rebuild gets back saved instead of
        running them: its selective policy's, and the routing decisions where a region
        over it or its selective option keeps them (Note [Routing saved in regions])."""
        engine = self._installation.engine
        saved = {i: {str(op) for op in policy.ops}
                 for i, policy in enumerate(engine.policies) if policy.kind == "selective"}
        for i in engine.routing_saved | {i for i, policy in enumerate(engine.policies)
                                         if policy.kind == "selective" and engine.routes[i]}:
            saved.setdefault(i, set()).update(str(op) for op in ROUTING_OPS)
        return {i: frozenset(ops) for i, ops in saved.items()}

    def __repr__(self) -> str:
        if isinstance(self.plan, PlanSet):
            return (f"Handle(plan set of {len(self.plan.plans)} plans over "
                    f"{self.plan.dims}, active={self.active})")
        return (
            f"Handle({len(self.plan.stages)} stages, {len(self.plan.regions)} regions, "
            f"solver={self.plan.solver!r}, active={self.active})"
        )


def kv_cache_in_training(model: nn.Module) -> bool:
    """Whether a transformers model builds a key/value cache in its training forwards.

    ``config.use_cache`` is True by default almost everywhere, but only decoders read it:
    a config that declares ``is_decoder`` (BERT, RoBERTa, ...) has a cache only when that
    or ``is_encoder_decoder`` is set or the model generates (a causal LM head).
    """
    config = getattr(model, "config", None)
    if getattr(config, "use_cache", False) is not True:
        return False
    if not hasattr(config, "is_decoder") or getattr(config, "is_decoder", False):
        return True
    if getattr(config, "is_encoder_decoder", False):
        return True
    can_generate = getattr(model, "can_generate", None)
    return bool(can_generate()) if callable(can_generate) else False


USE_CACHE_NOTE = (
    "the model's config has use_cache=True, which checkpointing cannot replay (a rebuild "
    "appends to the key/value cache again), so remat set model.config.use_cache = False for "
    "this run, as transformers' gradient_checkpointing_enable does; set it so in your "
    "training too"
)


_NOTED: list[str] = []  # notes already issued in this process
_CACHE_WARNED: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def cache_off_for_training(model: nn.Module) -> bool:
    """Switch a transformers model's key/value cache off, with a note, where it has one.

    For models remat builds itself to train (``remat profile``, ``auto``, ``bench``). Every
    submodule's config counts (T5's stacks keep copies). The note is issued once per
    process, however many models a command builds.
    """
    if not kv_cache_in_training(model):
        return False
    for module in model.modules():
        config = getattr(module, "config", None)
        if getattr(config, "use_cache", False) is True:
            config.use_cache = False  # type: ignore[union-attr]
    if USE_CACHE_NOTE not in _NOTED:
        _NOTED.append(USE_CACHE_NOTE)
        warnings.warn(USE_CACHE_NOTE, stacklevel=2)
    return True


def _check_compiled(model: nn.Module, plan: Plan) -> None:
    compiled = stages_compiled(model, plan.stages)
    if plan.predicted_peak_bytes is None or compiled == plan.compiled:
        return
    if plan.compiled:
        raise UsageError(
            "the plan was priced for compiled stages and this model's stages are eager; "
            "compile them first (remat.compile_stages(model)), or pass "
            "allow_compile_mismatch=True"
        )
    raise UsageError(
        "the plan was priced for eager stages and this model's stages are compiled; profile "
        "and plan the compiled model (remat.profile(..., compile=True)), or pass "
        "allow_compile_mismatch=True"
    )


def apply(
    model: nn.Module,
    plan: Plan | PlanSet,
    *,
    preserve_rng_state: bool = True,
    force: bool = False,
    allow_compile_mismatch: bool = False,
    split_backward: bool = False,
    outside: str | None = None,
) -> Handle:
    """Apply ``plan`` to ``model`` in place and return a :class:`Handle`.

    ``plan`` may be a :class:`~remat.core.plan_set.PlanSet` (``remat plan --shapes``):
    each training forward then runs the plan of the bucket its batch's shape falls in
    (Note [One engine, several plans] in engine.py); ``outside`` (``error`` or
    ``conservative``) overrides what the set does with a batch outside its range.

    Training-mode forwards with grad enabled then run the plan's regions and options;
    eval or no-grad forwards call each stage's own forward directly.

    A plan that records what it was made for (``plan.made_for``) is refused, with a
    UsageError naming the first stage whose class or parameter shapes differ, before the
    model is touched; ``force=True`` applies it anyway (with a warning). A model with
    more stages than the plan names gets a warning naming those left out.

    A plan priced by the planner (it has a predicted peak) for compiled stages
    (``plan.compiled``, from a profile of compiled stages) is refused on eager stages, and
    an eager-priced one on compiled stages, since its figures are for the other program;
    ``allow_compile_mismatch=True`` applies it anyway. Plans from the builders in
    :mod:`remat.plans` carry no price and apply to either.

    ``preserve_rng_state=False`` is a debugging switch, never for training: rebuilds then
    draw fresh random numbers (another dropout mask), so gradients are wrong; it exists
    so that ``remat.verify`` can be shown catching exactly that.

    ``split_backward=True`` is for a backward run as several passes over one forward
    (torch's zero-bubble pipeline schedules: an input-gradient pass, then weight-gradient
    passes): each region is then rebuilt once, at the first pass that reaches it, and its
    rebuilt tensors stay until the pass that releases them (Note [One rebuild for a
    backward in passes] in remat.runtime.rebuild_once). Plans with nested regions or a
    selective option inside a region are refused with it.
    """
    plan_set, plan = _plan_or_set(plan, outside, split_backward)
    plans = plan_set.plans if plan_set is not None else (plan,)
    switches = _Switches(preserve_rng_state, force, allow_compile_mismatch, split_backward)
    check_target(model, plan)
    switches.check()
    stages, notes = _checked_stages(model, plan, plans, switches)
    if any(each.regions for each in plans):
        _warn_use_cache(model)
    all_policies = _resolved_policies(plans, plan_set, stages)
    policies = list(all_policies[0])  # the first plan's, changed below for compiled stages
    for note in notes:  # before any change: a warning turned into an error leaves no trace
        warnings.warn(note, stacklevel=2)
    forwards = _stage_forwards(plan, stages, policies)

    # Everything is checked: from here on nothing can fail half-way.
    engine = _engine(plan, plan_set, stages, policies, all_policies, switches)
    installation = _install(model, engine, plan_set, forwards)
    return Handle(model, plan_set if plan_set is not None else plan, installation)


@dataclass(frozen=True)
class _Switches:
    """``apply``'s True/False switches, which travel together through its checks."""

    preserve_rng_state: bool
    force: bool
    allow_compile_mismatch: bool
    split_backward: bool

    def check(self) -> None:
        """UsageError for a switch that is not a bool."""
        for name, flag in (("preserve_rng_state", self.preserve_rng_state),
                           ("force", self.force),
                           ("allow_compile_mismatch", self.allow_compile_mismatch),
                           ("split_backward", self.split_backward)):
            if not isinstance(flag, bool):
                raise UsageError(f"{name}={flag!r} is not a bool; pass True or False")


def _plan_or_set(plan: Plan | PlanSet, outside: str | None,
                 split_backward: bool) -> tuple[PlanSet | None, Plan]:
    """The plan set to run (``outside`` applied), if ``plan`` is one, and the plan whose
    stages are installed (a set's first); UsageError for ``outside`` or
    ``split_backward`` where they do not fit."""
    if isinstance(plan, PlanSet):
        if outside is not None and outside not in OUTSIDE:
            raise UsageError(f"outside={outside!r} is not one of {', '.join(OUTSIDE)}")
        plan_set = plan if outside is None else replace(plan, outside=outside)
        if split_backward:
            raise UsageError("split_backward=True runs one plan; apply a single plan, not a "
                             "plan set")
        return plan_set, plan_set.plans[0]
    if outside is not None:
        raise UsageError("outside= is for plan sets; a single plan runs at every shape")
    return None, plan


def _checked_stages(model: nn.Module, plan: Plan, plans: tuple[Plan, ...],
                    switches: _Switches) -> tuple[tuple[nn.Module, ...], tuple[str, ...]]:
    """The plan's stage modules and the notes to issue about them, after every check that
    the plans fit the model (UsageError where one does not); changes nothing."""
    check_free(model)
    for each in plans:
        each.validate()  # again: a frozen dataclass can still be changed behind its back
    if switches.split_backward:
        check_split_backward(plan)
    check_apply(model, plan)  # never checkpoint twice: see remat.runtime.existing
    check_available()
    stages = _resolve_stages(model, plan)
    check_fsdp_units(model, plan.stages, stages, plan.regions)  # again at the first pass
    # the plan's model is this one
    notes = check_made_for(model, plan, stages, force=switches.force)
    if not switches.allow_compile_mismatch:
        for each in plans:
            _check_compiled(model, each)
    return stages, notes


def _warn_use_cache(model: nn.Module) -> None:
    """Warn, once per model, that a key/value cache built in training forwards breaks
    rebuilds (for plans with regions)."""
    if kv_cache_in_training(model) and model not in _CACHE_WARNED:
        _CACHE_WARNED.add(model)  # once per model: profiling applies many plans to one
        # transformers: a key/value cache appended to in forward is appended to again by
        # every rebuild, so the rebuilt attention sees other keys (remat verify: hazard).
        # Only a warning: the model is the caller's, and eval forwards may want the cache.
        warnings.warn(
            "the model's config has use_cache=True: a rebuild would append to the key/value "
            "cache again and compute other values; set model.config.use_cache = False for "
            "training",
            stacklevel=3,  # apply's caller
        )


def _resolved_policies(plans: tuple[Plan, ...], plan_set: PlanSet | None,
                       stages: tuple[nn.Module, ...]) -> list[list[StagePolicy]]:
    """Each plan's stage policies; UsageError for a plan set with selective options on
    compiled stages."""
    all_policies = [[resolve(opt, name) for name, opt in zip(p.stages, p.options, strict=True)]
                    for p in plans]
    if plan_set is not None and any(
            isinstance(m.__dict__.get("forward"), CompiledForward) for m in stages) and any(
            not q.is_keep for pol in all_policies for q in pol):
        raise UsageError("a plan set with selective options cannot run on compiled stages "
                         "yet; plan it for eager stages, or apply one plan")
    return all_policies


def _stage_forwards(plan: Plan, stages: tuple[nn.Module, ...],
                    policies: list[StagePolicy]) -> list[Any]:
    """The forward each stage runs: its own, or for a selective option on a compiled stage
    the compiled program that saves the option's ops (its policy then becomes keep, in
    ``policies``); UsageError for a budget option on an eager stage."""
    # Note [Selective options on compiled stages] in compiled_stages.py
    forwards = [m.forward for m in stages]
    for i, module in enumerate(stages):
        own = module.__dict__.get("forward")
        budget = policies[i].budget
        if isinstance(own, CompiledForward) and policies[i].kind == "selective":
            forwards[i] = (own.selective(policies[i].ops) if budget is None
                           else own.partitioned(budget))
            policies[i] = StagePolicy(KEEP.kind)
        elif budget is not None:
            raise UsageError(
                f"stage {plan.stages[i]!r} has option {plan.options[i]!r}, which needs the "
                "stage compiled: call remat.compile_stages(model) first (--compile)")
    return forwards


def _engine(plan: Plan, plan_set: PlanSet | None, stages: tuple[nn.Module, ...],
            policies: list[StagePolicy], all_policies: list[list[StagePolicy]],
            switches: _Switches) -> Engine:
    """The engine that runs ``plan`` on ``stages`` (of a plan set: each plan at its
    shapes, Note [One engine, several plans] in engine.py)."""
    engine = Engine(plan, stages, policies, preserve_rng_state=switches.preserve_rng_state,
                    split_backward=switches.split_backward)
    if plan_set is not None:
        engine.add_layouts(plan_set.plans, all_policies)
    return engine


def _install(model: nn.Module, engine: Engine, plan_set: PlanSet | None,
             forwards: list[Any]) -> _Installation:
    """Wrap the stage forwards in ``engine`` and hook the model's passes; registered as
    applied to ``model``. Nothing here can fail half-way."""
    # one forward per module, also for a module that is several stages (its calls: Note
    # [Calls of one module as stages] in engine.py)
    distinct = engine.calls_of()
    modules = tuple(module for module, _ in distinct)
    previous = tuple(m.__dict__.get("forward", _MISSING) for m in modules)
    for module, indices in distinct:
        module.forward = engine.wrap(indices, [forwards[i] for i in indices])
        _WRAPPED.add(module)
    begin = PassHook(engine, begin=True)
    chooser = () if plan_set is None else (  # before the pass begins: it picks the plan
        model.register_forward_pre_hook(ShapeHook(engine, plan_set), with_kwargs=True),)
    hooks = (  # objects, not closures: Note [Copies of an applied model] in engine.py
        *chooser,
        model.register_forward_pre_hook(begin),
        model.register_forward_hook(PassHook(engine, begin=False), always_call=True),
        *engine.install_stage_hooks(),  # Note [Stages with hooks of their own] in engine.py
    )
    installation = _Installation(engine, modules, previous, hooks, weakref.ref(model))
    begin.installation = installation  # a deep copy of the model copies it
    _APPLIED[model] = installation
    return installation


def check_split_backward(plan: Plan) -> None:
    """UsageError for a plan ``split_backward=True`` cannot run: a nested region, or a
    selective option inside a region or on a compiled stage (each nests a checkpoint,
    which the rebuild-once frame does not)."""
    nested = plan.first_nested()
    if nested is not None:
        raise UsageError(
            f"region {nested} lies inside region {plan.parent(nested)}, and with "
            "split_backward=True remat runs one level of regions only; plan with the "
            "segments-optimal solver (disjoint regions) or apply without split_backward")
    inside = {i for r in plan.regions for i in range(r.start, r.stop)}
    selective = next((name for i, (name, option) in enumerate(zip(
        plan.stages, plan.parsed_options, strict=True))
        if option.is_partitioned or (option.is_selective and i in inside)), None)
    if selective is not None:
        raise UsageError(
            f"stage {selective!r} has a selective option inside a region (or a compiled "
            "one), which would nest a checkpoint in the region's, and split_backward=True "
            "runs one level; keep it outside regions or use keep for it")


def check_target(model: nn.Module, plan: Plan) -> None:
    """UsageError unless ``model`` is a module and ``plan`` a remat Plan."""
    if not isinstance(model, nn.Module):
        raise UsageError(f"model is a {type(model).__name__}, not a torch.nn.Module")
    if not isinstance(plan, Plan):
        raise UsageError(
            f"plan is a {type(plan).__name__}, not a remat Plan; load one with Plan.load(path)"
        )


def check_free(model: nn.Module) -> None:
    """UsageError when a plan is applied to ``model`` already (one at a time)."""
    if model in _APPLIED:
        raise UsageError(
            "a plan is already applied to this model; call remat.remove(model) before "
            "applying another"
        )


def remove(model: nn.Module) -> None:
    """Undo ``apply``: stage forwards and root hooks go back to what they were."""
    installation = _APPLIED.pop(model, None)
    if installation is None:
        raise UsageError("no remat plan is applied to this model; there is nothing to remove")
    installation.uninstall()


def _resolve_stages(model: nn.Module, plan: Plan) -> tuple[nn.Module, ...]:
    """The plan's stage modules; UsageError for unknown, nested or already-wrapped ones.

    Stages ``path#0``, ``path#1``, ... are calls of one module (Note [Stages that are calls
    of one module] in remat.core.stage_names); the same module under two other names is
    refused."""
    modules: list[nn.Module] = []
    for path in plan.stages:
        module = stage_module(model, plan, path)
        if module is model:
            raise UsageError(f"stage {path!r} is the model itself; stages must be submodules")
        if module in _WRAPPED:
            raise UsageError(
                f"stage {path!r} is already a stage of another applied plan; remove that "
                "plan first"
            )
        modules.append(module)
    index: dict[int, int] = {}
    for i, module in enumerate(modules):
        index.setdefault(id(module), i)
    for i, module in enumerate(modules):
        if index[id(module)] != i:
            continue  # checked with its first stage
        calls = [plan.stages[j] for j, m in enumerate(modules) if m is module]
        other = next((c for c in calls if module_path(c) != module_path(calls[0])), None)
        if other is not None or (len(calls) > 1 and call_index(calls[0]) is None):
            raise UsageError(
                f"stages {calls[0]!r} and {other or calls[1]!r} are the same module; list it "
                f"once, or name each of its calls as {module_path(calls[0])}#0, "
                f"{module_path(calls[0])}#1, ... (docs/stages.md)"
            )
        if call_index(calls[0]) is not None:
            expected = [f"{module_path(calls[0])}#{k}" for k in range(len(calls))]
            if calls != expected:
                raise UsageError(
                    f"the plan names the calls of module {module_path(calls[0])!r} as "
                    f"{', '.join(calls)}; name every call of it in one forward, in order: "
                    f"{', '.join(expected)}")
        for sub in module.modules():
            j = index.get(id(sub))
            if sub is not module and j is not None:
                raise UsageError(
                    f"stage {plan.stages[j]!r} lies inside stage {plan.stages[i]!r}; "
                    "stages must not contain each other"
                )
    return tuple(modules)


@contextlib.contextmanager
def observe(model: nn.Module, observer: StageObserver) -> Iterator[None]:
    """Within the block, tell ``observer`` about every stage call of the applied plan.

    A debugging aid for ``remat.verify`` (see Note [Observing stage calls] in
    ``engine.py``); one observer per model at a time.
    """
    installation = _APPLIED.get(model)
    if installation is None:
        raise UsageError("no remat plan is applied to this model; apply one before observing it")
    engine = _engine_of(installation)
    if engine.observer is not None:
        raise UsageError("this model's stages are already observed; end that observation first")
    engine.observer = observer
    try:
        yield
    finally:
        engine.observer = None


def installed_hook_ids(model: nn.Module) -> frozenset[int]:
    """Ids of the hooks ``apply`` put on ``model`` and its stages (``remat.verify`` counts
    only the model's own)."""
    installation = _APPLIED.get(model)
    return (frozenset(h.id for h in installation.hooks)
            if isinstance(installation, _Installation) else frozenset())


def applied(model: nn.Module) -> bool:
    """Whether a remat plan is currently applied to ``model``."""
    return model in _APPLIED


def applied_stages(model: nn.Module) -> tuple[str, ...]:
    """The stage paths of the plan applied to ``model``, in the order an observer's stage
    indices count them (:func:`observe`)."""
    installation = _APPLIED.get(model)
    if installation is None:
        raise UsageError("no remat plan is applied to this model")
    return tuple(_engine_of(installation).names)


def _engine_of(installation: _Installation | _TracedInstallation) -> Engine:
    if isinstance(installation, _TracedInstallation):
        raise UsageError(
            "this model's regions were written by remat.trace_regions, which runs no remat "
            "engine to observe; remat.remove(model), then remat.apply(model, plan) to verify "
            "the plan"
        )
    return installation.engine

