"""What a plan was made for: its stages' classes and parameter shapes, the batch, the profile.

Torch-free records (the profile and the plan carry them; :mod:`remat.runtime.identity`
reads them off a live model). A plan made for one model must not apply silently to
another: ``remat.apply`` compares each stage's :class:`StageIdentity` with the module it
finds at that path and refuses a mismatch (docs/runtime.md, "Plans know their model").

* ``StageIdentity``: the stage's class name, a ``fingerprint`` (12 hex digits of the
  SHA-256 of its parameters' and buffers' sorted names, shapes and dtypes) and a
  ``summary`` for people (``Block(128->512->128, 198.0K params)``).
* ``MadeFor``: the stages' identities (aligned with ``plan.stages``), ``model_stages``
  (how many stages the model had: the plan's and the unnamed blocks beside them, same
  class in the same container), the ``batch_shapes`` profiled and the profile's digest.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import remat.core.fields as fields
from remat.core.errors import UsageError

__all__ = ["MadeFor", "StageIdentity", "digest", "fingerprint"]

#: Hex digits kept of a SHA-256: short enough to read, long enough never to collide by chance.
FINGERPRINT_DIGITS = 12
DIGEST_DIGITS = 16


def digest(data: Any, digits: int = DIGEST_DIGITS) -> str:
    """The first ``digits`` hex digits of the SHA-256 of ``data``'s canonical JSON."""
    text = json.dumps(data, sort_keys=True, separators=(",", ":"), allow_nan=True)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:digits]


def fingerprint(tensors: Iterable[tuple[str, str, Iterable[int], str]]) -> str:
    """A short hash of ``(kind, name, shape, dtype)`` entries, sorted (order-free)."""
    entries = sorted([kind, name, [int(n) for n in shape], dtype]
                     for kind, name, shape, dtype in tensors)
    return digest(entries, FINGERPRINT_DIGITS)


def _text(value: object, what: str) -> str:
    if not isinstance(value, str) or not value:
        raise UsageError(f"{what}={value!r} is not a name; give a non-empty string")
    return value


def _hex(value: object, what: str) -> str:
    text = _text(value, what)
    if any(c not in "0123456789abcdef" for c in text):
        raise UsageError(f"{what}={value!r} is not a hex digest; regenerate the file with remat")
    return text


@dataclass(frozen=True)
class StageIdentity:
    """One stage as made for: ``cls`` (JSON ``class``), ``fingerprint`` and ``summary``."""

    cls: str
    fingerprint: str
    summary: str

    def __post_init__(self) -> None:
        _text(self.cls, "stage class")
        _hex(self.fingerprint, "stage fingerprint")
        _text(self.summary, "stage summary")

    def matches(self, other: StageIdentity) -> bool:
        """Same class and same parameter and buffer shapes and dtypes (the summary is prose)."""
        return self.cls == other.cls and self.fingerprint == other.fingerprint

    def to_dict(self) -> dict[str, str]:
        return {"class": self.cls, "fingerprint": self.fingerprint, "summary": self.summary}

    @classmethod
    def from_dict(cls, data: object, where: str) -> StageIdentity:
        _exact_keys(data, ("class", "fingerprint", "summary"), where)
        assert isinstance(data, Mapping)
        return cls(data["class"], data["fingerprint"], data["summary"])


def _exact_keys(data: object, keys: tuple[str, ...], where: str) -> None:
    fields.check_keys(data, keys, keys, where)


def _shapes(value: object, what: str) -> tuple[tuple[int, ...], ...]:
    if not isinstance(value, (list, tuple)) or not all(
        isinstance(shape, (list, tuple))
        and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape)
        for shape in value
    ):
        raise UsageError(f"{what}={value!r} is not a list of shapes; give lists of sizes >= 0")
    return tuple(tuple(shape) for shape in value)


def _count(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UsageError(f"{what}={value!r} is not a stage count; give a whole number >= 1")
    return value


_MADE_FOR_KEYS = ("model", "model_stages", "batch_shapes", "profile_sha256", "stages")


@dataclass(frozen=True)
class MadeFor:
    """What a plan was made for; each field None where its maker did not know it.

    ``stages`` holds one identity per plan stage, in plan order; ``model`` is the name
    the profile gave the model (its class name by default).
    """

    model: str | None = None
    stages: tuple[StageIdentity, ...] | None = None
    model_stages: int | None = None
    batch_shapes: tuple[tuple[int, ...], ...] | None = None
    profile_sha256: str | None = None

    def __post_init__(self) -> None:
        if self.model is not None:
            _text(self.model, "made_for model")
        if self.stages is not None:
            stages = tuple(self.stages)
            if not all(isinstance(s, StageIdentity) for s in stages):
                raise UsageError("made_for stages must be StageIdentity records")
            object.__setattr__(self, "stages", stages)
        if self.model_stages is not None:
            _count(self.model_stages, "made_for model_stages")
        if self.batch_shapes is not None:
            object.__setattr__(
                self, "batch_shapes", _shapes(self.batch_shapes, "made_for batch_shapes")
            )
        if self.profile_sha256 is not None:
            _hex(self.profile_sha256, "made_for profile_sha256")

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "model_stages": self.model_stages,
            "batch_shapes": None if self.batch_shapes is None else [
                list(shape) for shape in self.batch_shapes
            ],
            "profile_sha256": self.profile_sha256,
            "stages": None if self.stages is None else [s.to_dict() for s in self.stages],
        }

    @classmethod
    def from_dict(cls, data: object) -> MadeFor:
        _exact_keys(data, _MADE_FOR_KEYS, "the plan's made_for")
        assert isinstance(data, Mapping)
        stages = data["stages"]
        if stages is not None and not isinstance(stages, list):
            raise UsageError("the plan's made_for stages must be a list of stage objects")
        return cls(
            model=data["model"],
            model_stages=data["model_stages"],
            batch_shapes=data["batch_shapes"],
            profile_sha256=data["profile_sha256"],
            stages=None if stages is None else tuple(
                StageIdentity.from_dict(s, f"made_for stage {i}") for i, s in enumerate(stages)
            ),
        )
