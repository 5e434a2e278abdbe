"""The C allocator setting that steadies CPU step times (remat.measure.malloc)."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

from remat.core.errors import UsageError
from remat.measure.malloc import set_malloc

glibc = pytest.mark.skipif(
    not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc",
    reason="mallopt is glibc's",
)

# Resident memory kept after freeing a 64 MiB tensor: glibc's default serves a block that
# large with mmap and gives it back when freed; with freed memory kept it stays resident.
_KEPT_AFTER_FREE = """
import sys, torch
from remat.measure.malloc import set_malloc
print(set_malloc(sys.argv[1]), file=sys.stderr)
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096
before = rss()
x = torch.ones(16 * 2**20)
del x
print((rss() - before) / 2**20)
"""


def _kept_mib(mode: str) -> float:
    done = subprocess.run([sys.executable, "-c", _KEPT_AFTER_FREE, mode],
                          capture_output=True, text=True, check=True)
    return float(done.stdout.strip())


@glibc
def test_keep_holds_freed_memory_and_system_returns_it() -> None:
    assert _kept_mib("keep") > 48
    assert _kept_mib("system") < 16


def test_an_unknown_mode_is_a_usage_error() -> None:
    with pytest.raises(UsageError, match="malloc='fast' is unknown; use one of keep, system"):
        set_malloc("fast")
