"""The plan: which consecutive stages run as checkpoint regions, and how each stage saves.

Torch-free on purpose (solvers, the simulator and the CLI read and write plans without
importing torch). A plan is a chain of ``stages`` (module paths in call order), a
laminar family of ``regions`` (half-open ranges of stage indices that nest or are
disjoint; the tree is implied by nesting) and one ``option`` per stage::

    Plan(stages=("h.0", "h.1", "h.2", "h.3"),
         regions=(Region(0, 4), Region(0, 2), Region(2, 4)),
         options=("keep", "selective:save-matmuls", "keep", "offload"))

Options are ``keep``, ``offload`` or ``selective:<policy>`` where the policy is one of
:data:`POLICIES` or a comma-separated list of aten op names (``selective:mm,addmm``,
``selective:convolution.default``); the plan checks only the syntax, the runtime
resolves the names against the installed torch. On a compiled stage there is one more:
``selective:budget=<fraction>`` (``0 <= fraction < 1``), the stage compiled with
inductor's own min-cut partitioner under that ``activation_memory_budget``
(docs/compile.md).

A plan made from a profile (or by a builder of :mod:`remat.plans`) also records what it
was made for (``made_for``, :class:`remat.core.model_identity.MadeFor`): ``remat.apply``
refuses it on a model whose stages differ. Plans without it (older files, hand-written
ones, plans solved from a bare problem) apply unchecked.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, cast

import remat.core.fields as fields
from remat.core.artifact import JsonArtifact
from remat.core.errors import UsageError
from remat.core.model_identity import MadeFor

__all__ = ["KEEP", "OFFLOAD", "POLICIES", "SCHEMA_VERSION", "Option", "Plan", "Region",
           "parse_option"]

SCHEMA_VERSION = 1

#: Named selective policies; the runtime maps each to a set of ops to save
#: (``save-collectives``: the outputs of functional collectives, so a rebuild under tensor
#: or sequence parallelism repeats no communication; ``save-routing``: a router's top-k
#: and arg-max decisions, so a rebuild routes to the experts the forward chose).
POLICIES = ("save-matmuls", "save-attention", "save-nothing", "save-collectives",
            "save-routing")

_OP_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)?\Z")
_OPTION_HINT = "use keep, offload, or selective:<policy> with a policy from " + ", ".join(
    POLICIES
) + (", a comma-separated list of aten op names such as selective:mm,addmm, or "
     "selective:budget=<fraction> (compiled stages)")
_BUDGET = re.compile(r"budget=(\d+(\.\d*)?|\.\d+)\Z")


@dataclass(frozen=True, order=True)
class Region:
    """Stages ``start, ..., stop - 1`` run under one checkpoint (half-open ``[start, stop)``)."""

    start: int
    stop: int

    def __post_init__(self) -> None:
        for name in ("start", "stop"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise UsageError(f"region {name}={value!r} is not a whole number; use integers")
        if not 0 <= self.start < self.stop:
            raise UsageError(
                f"region {self} is empty or negative; a region needs 0 <= start < stop"
            )

    def __str__(self) -> str:
        return f"[{self.start}, {self.stop})"

    def __len__(self) -> int:
        return self.stop - self.start

    def __contains__(self, stage: object) -> bool:
        """``i in region``: whether stage index ``i`` lies inside the region."""
        return isinstance(stage, int) and self.start <= stage < self.stop

    def covers(self, other: Region) -> bool:
        """Whether ``other`` lies inside this region (a region covers itself)."""
        return self.start <= other.start and other.stop <= self.stop


class Option(str):
    """A stage option, parsed once: ``keep``, ``offload`` or ``selective:<spec>``.

    A ``str`` (so it is its own JSON, a key of ``saved_bytes`` and equal to the name it
    was written as) that carries its parts: ``kind`` (``keep``, ``selective`` or
    ``offload``), for a selective option ``policy`` (one of :data:`POLICIES`, or None for
    a custom op list) and ``ops`` (custom aten op names, e.g. ``("mm",
    "convolution.default")``), or ``budget`` (``selective:budget=0.5``: the fraction
    inductor's partitioner is given on a compiled stage; None otherwise). Code asks
    ``option.is_keep``, never compares names; the parser (:func:`parse_option`, or
    ``Option(text)``) is the one place that reads them.
    """

    kind: str
    policy: str | None
    ops: tuple[str, ...]
    budget: float | None

    def __new__(cls, text: object) -> Option:
        if isinstance(text, Option):
            return text
        ops: tuple[str, ...] = ()
        policy: str | None = None
        budget: float | None = None
        if text in ("keep", "offload"):
            kind = str(text)
        elif isinstance(text, str) and text.startswith("selective:"):
            spec = text[len("selective:"):]
            names = tuple(name.strip() for name in spec.split(","))
            kind = "selective"
            if spec in POLICIES:
                policy = spec
            elif spec.startswith("budget="):
                if not _BUDGET.match(spec) or not float(spec[len("budget="):]) < 1:
                    raise UsageError(
                        f"option {text!r} is not valid; give selective:budget=<fraction> "
                        "with a fraction from 0 up to (not including) 1, such as "
                        "selective:budget=0.5 (1 is keep)")
                budget = float(spec[len("budget="):])
            elif names and all(_OP_NAME.match(name) for name in names):
                ops = names
            else:
                raise UsageError(f"option {text!r} is not valid; {_OPTION_HINT}")
        else:
            raise UsageError(f"option {text!r} is not valid; {_OPTION_HINT}")
        option = super().__new__(cls, text)
        object.__setattr__(option, "kind", kind)
        object.__setattr__(option, "policy", policy)
        object.__setattr__(option, "ops", ops)
        object.__setattr__(option, "budget", budget)
        return option

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("an Option is immutable")

    def __reduce__(self) -> tuple[type[Option], tuple[str]]:
        return Option, (str(self),)

    @property
    def is_keep(self) -> bool:
        return self.kind == "keep"

    @property
    def is_offload(self) -> bool:
        return self.kind == "offload"

    @property
    def is_selective(self) -> bool:
        return self.kind == "selective"

    @property
    def is_partitioned(self) -> bool:
        """``selective:budget=<fraction>``: inductor's partitioner chooses what to save."""
        return self.budget is not None

    @classmethod
    def selective(cls, spec: str) -> Option:
        """``selective:<spec>`` for a policy name or comma-separated op names."""
        return cls(f"selective:{spec}")


#: The two options without parts.
KEEP = Option("keep")
OFFLOAD = Option("offload")


def parse_option(text: object) -> Option:
    """Parse ``keep``, ``offload`` or ``selective:<policy|op,op,...|budget=<fraction>>``;
    raise UsageError."""
    return Option(text)


_META_FIELDS = (
    "solver",
    "budget_bytes",
    "predicted_peak_bytes",
    "predicted_step_time_s",
    "baseline_step_time_s",
    "solve_time_s",
)
_KEYS = ("schema_version", *_META_FIELDS, "stages", "regions", "options")
# written only when set: plans from before them still load
_OPTIONAL_KEYS = ("made_for", "compiled", "reshard_after_rebuild", "notes")


@dataclass(frozen=True)
class Plan(JsonArtifact):
    """A checkpointing plan over a chain of stages; validated on construction.

    ``regions`` is normalized to sorted order by ``(start, -stop)`` (parents before their
    children); ``options`` defaults to ``keep`` for every stage.
    """

    artifact: ClassVar[str] = "plan"

    stages: tuple[str, ...]
    regions: tuple[Region, ...] = ()
    # Given as names (str); parsed on construction into Option objects, which are str.
    options: tuple[str, ...] = field(default=())
    solver: str = "manual"
    budget_bytes: int | None = None
    predicted_peak_bytes: int | None = None
    predicted_step_time_s: float | None = None
    baseline_step_time_s: float | None = None
    solve_time_s: float | None = None
    # What the plan was made for (remat.core.model_identity); None: unknown, nothing is checked.
    made_for: MadeFor | None = None
    # Priced for stages whose forward is compiled by torch.compile (a profile with
    # compile=True); remat.apply refuses it on eager stages, and an eager plan on compiled
    # ones, unless told otherwise.
    compiled: bool = False
    # FSDP2 (Note [Resharding after a rebuild] in remat/core/solve/simulator.py): each unit
    # a region's rebuild gathered, other than the one whose backward comes next, is
    # resharded right after its call and gathered again for its own backward; False keeps
    # it gathered from the rebuild to its backward (torch 2.13's behaviour).
    reshard_after_rebuild: bool = False
    # What the solver chose on its own and why, one sentence each (a chain too large for
    # the nested tables planned with the one-level solver); written only when set.
    notes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if (isinstance(self.notes, str) or not isinstance(self.notes, Iterable)
                or not all(isinstance(x, str) for x in self.notes)):
            raise UsageError(f"notes={self.notes!r} must be a list of sentences")
        object.__setattr__(self, "notes", tuple(self.notes))
        if isinstance(self.stages, str) or not isinstance(self.stages, Iterable):
            raise UsageError(f"stages={self.stages!r} is not a list; give module paths")
        stages = tuple(self.stages)
        regions = tuple(
            sorted((_as_region(r) for r in self.regions), key=lambda r: (r.start, -r.stop))
        )
        object.__setattr__(self, "stages", stages)
        object.__setattr__(self, "regions", regions)
        object.__setattr__(self, "options", _parsed(self.options, stages))
        self.validate()

    @property
    def parsed_options(self) -> tuple[Option, ...]:
        """The options as parsed on construction, one :class:`Option` per stage."""
        return cast(tuple[Option, ...], self.options)

    def option(self, index: int) -> Option:
        """Stage ``index``'s option, parsed (``plan.option(i).is_offload``)."""
        return self.parsed_options[index]

    @property
    def checkpoints_nothing(self) -> bool:
        """No regions and every stage under keep: applying the plan changes nothing."""
        return not self.regions and all(o.is_keep for o in self.parsed_options)

    # -- checks -------------------------------------------------------------------------

    def validate(self) -> None:
        """Raise UsageError naming the first offending stage, region, option or field."""
        n = len(self.stages)
        seen: set[str] = set()
        for i, name in enumerate(self.stages):
            if not isinstance(name, str) or not name:
                raise UsageError(f"stage {i} has name {name!r}; give each stage a module path")
            if name in seen:
                raise UsageError(f"stage {name!r} is listed twice; each stage must be distinct")
            seen.add(name)
        if len(self.options) != n:
            raise UsageError(
                f"the plan has {len(self.options)} options for {n} stages; give one per stage"
            )
        for name, option in zip(self.stages, self.options, strict=True):
            if not isinstance(option, Option):
                raise UsageError(f"stage {name!r}: option {option!r} was not parsed; build "
                                 "plans with Plan(...) or dataclasses.replace")
        for a, b in itertools.pairwise(self.regions):
            if a == b:
                raise UsageError(f"region {a} is listed twice; list each region once")
        for r in self.regions:
            if r.stop > n:
                raise UsageError(
                    f"region {r} reaches past the last stage; stage indices go from 0 to {n - 1}"
                )
        # Sorted by (start, -stop): a partial overlap shows up between a region and a
        # later one that starts inside it but ends outside.
        for i, a in enumerate(self.regions):
            for b in self.regions[i + 1:]:
                if b.start >= a.stop:
                    break
                if b.stop > a.stop:
                    raise UsageError(
                        f"regions {a} and {b} overlap partially; regions must nest or be disjoint"
                    )
        if not isinstance(self.solver, str) or not self.solver:
            raise UsageError(f"solver={self.solver!r} is not a name; give a non-empty string")
        for name in ("budget_bytes", "predicted_peak_bytes"):
            value = getattr(self, name)
            if isinstance(value, float):  # a plan's bytes are whole numbers, as written
                raise UsageError(f"{name}={value!r} is not a byte count; give an int >= 0")
            if value is not None:
                fields.byte_count(value, name, largest=None)
        for name in ("predicted_step_time_s", "baseline_step_time_s", "solve_time_s"):
            if getattr(self, name) is not None:
                fields.seconds(getattr(self, name), name)
        if not isinstance(self.compiled, bool):
            raise UsageError(f"compiled={self.compiled!r} is not a bool; give true or false")
        if not isinstance(self.reshard_after_rebuild, bool):
            raise UsageError(f"reshard_after_rebuild={self.reshard_after_rebuild!r} is not a "
                             "bool; give true or false")
        if self.made_for is not None:
            if not isinstance(self.made_for, MadeFor):
                raise UsageError(f"made_for={self.made_for!r} is not a MadeFor record or None")
            known = self.made_for.stages
            if known is not None and len(known) != n:
                raise UsageError(
                    f"made_for names {len(known)} stage identities for {n} stages; give one "
                    "per stage"
                )
            count = self.made_for.model_stages
            if count is not None and count < n:
                raise UsageError(
                    f"made_for model_stages={count} is below the plan's {n} stages; give at "
                    f"least {n} or null"
                )

    # -- the region tree ------------------------------------------------------------------

    def parent(self, region: Region) -> Region | None:
        """The smallest region strictly containing ``region``, or None at the top level."""
        self._check_member(region)
        best: Region | None = None
        for r in self.regions:
            if r != region and r.covers(region) and (best is None or best.covers(r)):
                best = r
        return best

    def first_nested(self) -> Region | None:
        """The first region that lies inside another, or None for a one-level plan."""
        return next((r for r in self.regions if self.parent(r) is not None), None)

    def children(self, region: Region | None = None) -> tuple[Region, ...]:
        """The maximal regions strictly inside ``region`` (``None``: the top-level regions)."""
        if region is not None:
            self._check_member(region)
        return tuple(r for r in self.regions if self.parent(r) == region)

    def depth(self, stage: int) -> int:
        """How many regions contain stage index ``stage`` (0: it runs outside every region)."""
        if isinstance(stage, bool) or not isinstance(stage, int) or not 0 <= stage < len(
            self.stages
        ):
            raise UsageError(
                f"stage index {stage!r} is out of range; give 0 to {len(self.stages) - 1}"
            )
        return sum(stage in r for r in self.regions)

    def _check_member(self, region: Region) -> None:
        if region not in self.regions:
            raise UsageError(f"region {region} is not in this plan; pick one of plan.regions")

    # -- serialization ----------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict with every key of the schema (see ``from_dict``)."""
        return {
            "schema_version": SCHEMA_VERSION,
            **{name: getattr(self, name) for name in _META_FIELDS},
            "stages": list(self.stages),
            "regions": [[r.start, r.stop] for r in self.regions],
            "options": list(self.options),
            **({"made_for": self.made_for.to_dict()} if self.made_for is not None else {}),
            **({"compiled": True} if self.compiled else {}),
            **({"reshard_after_rebuild": True} if self.reshard_after_rebuild else {}),
            **({"notes": list(self.notes)} if self.notes else {}),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Plan:
        """Build a plan from ``to_dict()`` output; UsageError on a schema or key problem."""
        if not isinstance(data, Mapping):
            raise UsageError(f"a plan must be a JSON object, got {type(data).__name__}")
        fields.schema_version(data, (SCHEMA_VERSION,), "plan",
                              "regenerate the plan with this version of remat",
                              default=SCHEMA_VERSION)
        fields.check_keys(data, _KEYS, (*_KEYS, *_OPTIONAL_KEYS), "the plan")
        for key in ("stages", "regions", "options"):
            if not isinstance(data[key], list):
                raise UsageError(f"plan key {key!r} must be a list, got {data[key]!r}")
        for r in data["regions"]:
            if not isinstance(r, list) or len(r) != 2:
                raise UsageError(f"region {r!r} is not a [start, stop] pair; write e.g. [0, 4]")
        return cls(
            stages=tuple(data["stages"]),
            regions=tuple(Region(*r) for r in data["regions"]),
            options=tuple(data["options"]),
            made_for=None if data.get("made_for") is None else MadeFor.from_dict(data["made_for"]),
            compiled=data.get("compiled", False),
            reshard_after_rebuild=data.get("reshard_after_rebuild", False),
            notes=_notes(data.get("notes", [])),
            **{name: data[name] for name in _META_FIELDS},
        )


def _notes(value: object) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(x, str) for x in value):
        raise UsageError(f"plan key 'notes' must be a list of strings, got {value!r}")
    return tuple(value)


def _parsed(options: Iterable[object], stages: tuple[str, ...]) -> tuple[Option, ...]:
    """The plan's options parsed, each distinct one once (chains can be long); keep for
    every stage when none are given."""
    if isinstance(options, str) or not isinstance(options, Iterable):
        raise UsageError(f"options={options!r} is not a list; give one option per stage")
    given = tuple(options)
    if not given:
        return (KEEP,) * len(stages)
    seen: dict[object, Option] = {}
    out = []
    for i, option in enumerate(given):
        try:
            parsed = seen.get(option) if isinstance(option, str) else None
            if parsed is None:
                parsed = Option(option)
                seen[option] = parsed
        except UsageError as err:
            name = stages[i] if i < len(stages) else f"#{i}"
            raise UsageError(f"stage {name!r}: {err}") from None
        out.append(parsed)
    return tuple(out)


def _as_region(value: object) -> Region:
    if isinstance(value, Region):
        return value
    if isinstance(value, (tuple, list)) and len(value) == 2:
        return Region(*value)
    raise UsageError(f"region {value!r} is not a Region or a (start, stop) pair")
