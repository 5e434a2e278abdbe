"""JSON reading and writing shared by the artifacts (plan, profile, problem); torch-free."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from remat.core.errors import UsageError

T = TypeVar("T", bound="JsonArtifact")

# The keys every JSON file of a kind has (and no other kind has all of), what to call it
# and what writes it: a file of the wrong kind is named as such instead of failing on a
# missing key. Keyed by ``JsonArtifact.artifact`` where the kind is one.
KINDS: dict[str, tuple[tuple[str, ...], str, str]] = {
    "plan": (("regions", "options"), "plan", "remat plan --json"),
    "profile": (("fixed_bytes", "measured_peak_bytes"), "profile", "remat profile --json"),
    "problem": (("params_bytes", "measured_no_checkpoint_peak_bytes"), "problem file",
                "Problem.save"),
    "auto": (("verify_ok", "within_budget"), "remat auto report", "remat auto --json"),
    "bench": (("rows", "findings"), "remat bench report", "remat bench --json"),
    "verify": (("checks", "hazards"), "remat verify report", "remat verify --json"),
    "estimate": (("optimal_k", "rows"), "remat estimate result", "remat estimate --json"),
}


def kind_of(data: Any) -> str | None:
    """Which kind of remat JSON ``data`` is (a key of :data:`KINDS`), or None."""
    if not isinstance(data, dict):
        return None
    return next((kind for kind, (keys, _, _) in KINDS.items() if all(k in data for k in keys)),
                None)


def check_kind(data: Any, expected: str, source: str | None = None) -> None:
    """Raise UsageError naming what ``data`` is when it is not a remat ``expected``."""
    if not isinstance(data, dict) or expected not in KINDS:
        return
    keys, name, writer = KINDS[expected]
    where = f"{source!r}" if source else "this JSON"
    found = kind_of(data)
    if found is not None and found != expected:
        version = data.get("schema_version")
        schema = f" (schema {version})" if isinstance(version, int) else ""
        raise UsageError(
            f"{where} is a {KINDS[found][1]}{schema}, not a {name}; give the {name} {writer} "
            "wrote"
        )
    if found is None and not any(k in data for k in keys):
        raise UsageError(
            f"{where} is not a remat {name}: it has none of the keys one has "
            f"({', '.join(keys)}); give the {name} {writer} wrote"
        )


class JsonArtifact:
    """``to_json``/``from_json``/``save``/``load`` on top of ``to_dict``/``from_dict``.

    Each artifact names itself (``artifact = "plan"``) for its error messages and says
    which command writes its files (``written_by``), so a bad path or file tells the user
    what to give instead.
    """

    artifact: ClassVar[str] = "artifact"
    written_by: ClassVar[str] = ""

    def to_dict(self) -> dict[str, Any]:
        raise NotImplementedError

    @classmethod
    def from_dict(cls: type[T], data: Any) -> T:
        raise NotImplementedError

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_json(cls: type[T], text: str, source: str | None = None) -> T:
        """Read ``text``; ``source`` (a path) names the file in the errors."""
        try:
            data = json.loads(text)
        except (json.JSONDecodeError, RecursionError) as err:
            raise UsageError(
                f"the {cls.artifact} is not valid JSON ({err}); check the file"
            ) from None
        check_kind(data, cls.artifact, source)
        return cls.from_dict(data)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json() + "\n", encoding="utf-8")

    @classmethod
    def load(cls: type[T], path: str | Path) -> T:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as err:
            hint = f"; give the path {cls.written_by} wrote" if cls.written_by else ""
            raise UsageError(
                f"cannot read {cls.artifact} file {str(path)!r} ({err.strerror}){hint}"
            ) from None
        return cls.from_json(text, str(path))
