"""JSON reading and writing shared by the artifacts (plan, profile, problem); torch-free."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from remat.errors import UsageError

T = TypeVar("T", bound="JsonArtifact")


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
    def from_json(cls: type[T], text: str) -> T:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise UsageError(
                f"the {cls.artifact} is not valid JSON ({err}); check the file"
            ) from None
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
        return cls.from_json(text)
