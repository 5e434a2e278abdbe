"""Plans ``remat.auto_checkpoint`` made, kept on disk for the next launch of the script.

Note [The plan cache]
~~~~~~~~~~~~~~~~~~~~~
A training script calls ``auto_checkpoint`` at every launch; profiling costs seconds to
minutes, applying a known plan milliseconds. An entry is one JSON file per *slot*: the
model's class, the stages, the budget and the optimizer (what the caller chose), so a
launch finds the entry the previous launch of the same script wrote. Inside it, the
*fields* a plan depends on: every parameter's and buffer's name, shape and dtype (the
model's stage fingerprint), which parameters require grad, the batch's shapes and dtypes,
the device, the optimizer, torch's and remat's versions; for a plan set, the range of
shapes it covers and the batch's dtypes and number of axes instead of its shapes. A
launch whose fields equal the entry's applies its plan; one whose fields differ profiles
and plans again, says which fields changed, and replaces the entry. Files are written
whole (a temporary file, then a rename), so a crash never leaves half an entry.

Where: ``cache=`` (a folder, or False for none), else ``REMAT_CACHE`` (a folder, or
``off``), else ``$XDG_CACHE_HOME/remat/plans`` (``~/.cache/remat/plans``).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from remat.core.artifact import write_text
from remat.core.errors import UsageError
from remat.core.model_identity import digest
from remat.core.plan_format import Plan
from remat.core.plan_set import PlanSet

__all__ = ["CacheEntry", "cache_folder", "changed_fields", "load_entry", "save_entry"]

SCHEMA = "remat.plan_cache/1"
_OFF = ("", "0", "off", "false", "no", "none")


def cache_folder(cache: str | os.PathLike[str] | bool | None) -> Path | None:
    """The folder entries live in, or None when caching is off (module docstring)."""
    if cache is False:
        return None
    if cache is not None and cache is not True:
        if not isinstance(cache, (str, os.PathLike)):
            raise UsageError(f"cache={cache!r} is not a folder; give a path, True or False")
        return Path(cache)
    env = os.environ.get("REMAT_CACHE")
    if env is not None:
        return None if env.strip().lower() in _OFF else Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "remat" / "plans"


@dataclass(frozen=True)
class CacheEntry:
    """One slot's plan and the fields it was made for."""

    path: Path
    fields: dict[str, Any]
    plan: Plan | PlanSet | None  # None: there was a file, but not one this remat can read


def slot_path(folder: Path, slot: dict[str, Any]) -> Path:
    return folder / f"{slot['model']}-{digest(slot)}.json"


def load_entry(path: Path) -> CacheEntry | None:
    """The entry at ``path``; None where there is none. An unreadable entry (another
    remat's, cut short by hand) is an entry without a plan: planned again, and replaced."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return CacheEntry(path, {}, None)
    try:
        if data.get("schema") != SCHEMA:
            return CacheEntry(path, {}, None)
        found = data["plan"]
        plan = (PlanSet.from_dict(found) if isinstance(found, dict) and "buckets" in found
                else Plan.from_dict(found))
        return CacheEntry(path, dict(data["fields"]), plan)
    except (AttributeError, KeyError, TypeError, ValueError):  # UsageError is a ValueError
        return CacheEntry(path, {}, None)


def save_entry(path: Path, fields: dict[str, Any], plan: Plan | PlanSet) -> None:
    """Write the entry whole; a folder that cannot be written is a UsageError."""
    text = json.dumps({"schema": SCHEMA, "fields": fields, "plan": plan.to_dict()}, indent=1)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text(path, text + "\n")
    except OSError as err:
        raise UsageError(
            f"cannot write the plan cache at {str(path.parent)!r} ({err.strerror}); set "
            "REMAT_CACHE to a writable folder, or pass cache=False") from err


_WHAT = {
    "parameters": "the model's parameters or buffers (names, shapes or dtypes)",
    "trainable": "which parameters require grad",
    "batch": "the batch's shapes or dtypes",
    "shapes": "the range of batch shapes",
    "device": "the device",
    "torch": "torch's version",
    "remat": "remat's version",
}


def changed_fields(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """What differs between an entry's fields and this launch's, in words."""
    said = []
    for key in new:
        if old.get(key) != new[key]:
            before, now = old.get(key), new[key]
            what = _WHAT.get(key, key)
            said.append(f"{what} changed ({before} -> {now})"
                        if key not in ("parameters", "trainable") else f"{what} changed")
    return said
