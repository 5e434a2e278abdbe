"""JSON reading and writing shared by the artifacts (plan, profile, problem); torch-free."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from remat.core.errors import UsageError

T = TypeVar("T", bound="JsonArtifact")

# The keys every JSON file of a kind has (and no other kind has all of), what to call it
# and what writes it: a file of the wrong kind is named as such instead of failing on a
# missing key. Keyed by ``JsonArtifact.artifact`` where the kind is one.
KINDS: dict[str, tuple[tuple[str, ...], str, str]] = {
    "plan": (("regions", "options"), "plan", "remat plan --json"),
    "plan-set": (("buckets", "plans"), "plan set", "remat plan --shapes --json"),
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


class DuplicateKey(ValueError):
    """A JSON object that names one key twice (raised by :func:`loads`)."""

    def __init__(self, key: str) -> None:
        super().__init__(f"the key {key!r} appears twice in one object; keep one of them")
        self.key = key


def unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``json.loads``'s ``object_pairs_hook``: the object, or DuplicateKey for a key given twice."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise DuplicateKey(key)
        out[key] = value
    return out


def loads(text: str | bytes, what: str) -> Any:
    """``json.loads`` refusing an object that names a key twice (JSON's readers disagree on
    which one wins: remat takes neither); UsageError naming ``what`` otherwise."""
    try:
        return json.loads(text, object_pairs_hook=unique_keys)
    except DuplicateKey as err:
        raise UsageError(
            f"{what} names the key {err.key!r} twice in one object; keep one of them"
        ) from None
    except UnicodeDecodeError as err:
        raise UsageError(
            f"{what} is not UTF-8 text ({err.reason} at byte {err.start}); give the JSON file "
            "itself, saved as UTF-8"
        ) from None
    except (json.JSONDecodeError, RecursionError) as err:
        raise UsageError(f"{what} is not valid JSON ({err}); check the file") from None


@contextmanager
def replacing(path: str | Path) -> Iterator[Path]:
    """A temporary path beside ``path`` to write, moved over ``path`` when the block ends
    without an error (``os.replace``: a reader sees the old file or the whole new one,
    never a part); removed otherwise. Keeps the suffix, so writers that go by it (PNG
    plots) still do."""
    target = Path(path)
    handle, name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=target.suffix or ".tmp",
                                    dir=target.parent)
    os.close(handle)
    temporary = Path(name)
    try:
        yield temporary
        os.replace(temporary, target)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def write_text(path: str | Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically (:func:`replacing`), as UTF-8; the new file
    gets the mode a plain write would give it."""
    target = Path(path)
    with replacing(target) as temporary:
        temporary.write_text(text, encoding="utf-8")
        try:
            mode = target.stat().st_mode & 0o7777 if target.exists() else 0o666 & ~_umask()
            os.chmod(temporary, mode)
        except OSError:
            pass


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _path(path: Any, artifact: str, verb: str) -> Path:
    if isinstance(path, (str, os.PathLike)) and not isinstance(path, bytes):
        return Path(path)
    raise UsageError(
        f"cannot {verb} a {artifact} at {path!r}: a path is a str or pathlib.Path, not "
        f"{type(path).__name__}; give the file's path"
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
        if not isinstance(text, (str, bytes, bytearray)):
            raise UsageError(
                f"{cls.__name__}.from_json takes the JSON text (str), not "
                f"{type(text).__name__}; give the file's contents, or {cls.__name__}.load a path"
            )
        data = loads(text, f"the {cls.artifact}" + (f" {source!r}" if source else ""))
        check_kind(data, cls.artifact, source)
        return cls.from_dict(data)

    def save(self, path: str | Path) -> None:
        """Write the JSON to ``path`` atomically (a temporary file beside it, then a rename)."""
        write_text(_path(path, self.artifact, "save"), self.to_json() + "\n")

    @classmethod
    def load(cls: type[T], path: str | Path) -> T:
        target = _path(path, cls.artifact, "load")
        try:
            text = target.read_bytes().decode("utf-8")
        except UnicodeDecodeError as err:
            raise UsageError(
                f"{cls.artifact} file {str(path)!r} is not UTF-8 text ({err.reason} at byte "
                f"{err.start}); give the JSON file {cls.written_by or 'remat'} wrote"
            ) from None
        except OSError as err:
            hint = f"; give the path {cls.written_by} wrote" if cls.written_by else ""
            raise UsageError(
                f"cannot read {cls.artifact} file {str(path)!r} ({err.strerror}){hint}"
            ) from None
        return cls.from_json(text, str(path))
