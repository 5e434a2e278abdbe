"""The closed forms of remat.core.theory, against hand arithmetic and brute force."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest

from remat.core import theory
from remat.core.errors import UsageError

MiB = 1 << 20
GiB = 1 << 30


def exact_peak_copies(n: int, k: int) -> int:
    """Peak live copies of a uniform chain, walking the schedule one event at a time.

    Unlike the textbook total, backward frees each boundary once its segment is done.
    """
    kept = list(range(0, n, k))  # inputs of each segment stay alive through backward
    peak = 0
    for start in reversed(kept):
        stop = min(start + k, n)
        for alive_inside in range(1, stop - start + 1):  # rebuild stage by stage
            peak = max(peak, len(kept) + alive_inside)
        kept.remove(start)
    return peak


def test_default_table_matches_the_worked_example() -> None:
    rows = {r.k: r for r in theory.segment_table(64, 32 * MiB)}
    assert sorted(rows) == [1, 2, 4, 8, 16, 32, 64]
    assert rows[8].boundary_bytes == 8 * 32 * MiB
    assert rows[8].local_bytes == 8 * 32 * MiB
    assert rows[8].total_bytes == 512 * MiB
    assert rows[1].total_bytes == 65 * 32 * MiB
    best = theory.best_segment_length(64, 32 * MiB)
    assert (best.k, best.total_bytes) == (8, 512 * MiB)
    assert 64 * 32 * MiB == 2 * GiB


@pytest.mark.parametrize(("n", "k"), [(10, 4), (64, 7), (12, 5), (7, 7), (5, 9), (1, 1)])
def test_k_that_does_not_divide_n_keeps_ceil_boundaries_and_a_shorter_last_segment(
    n: int, k: int
) -> None:
    row = theory.segment_row(n, k, 3)
    assert row.segments == math.ceil(n / k)
    assert row.boundary_bytes == 3 * math.ceil(n / k)
    assert row.local_bytes == 3 * min(k, n)
    assert row.total_bytes == row.boundary_bytes + row.local_bytes
    # The textbook total bounds the exact schedule, one boundary at most above it.
    exact = 3 * exact_peak_copies(n, k)
    assert exact <= row.total_bytes <= exact + 3


@pytest.mark.parametrize("n", [1, 8, 12, 64, 100])
def test_textbook_total_is_exact_when_k_divides_n(n: int) -> None:
    for k in range(1, n + 1):
        if n % k == 0:
            assert theory.segment_row(n, k, 1).total_bytes == exact_peak_copies(n, k)


def test_n10_k4_by_hand() -> None:
    # Boundaries x0, x4, x8; segments of 4, 4 and 2 stages; 3 boundaries + the longest 4.
    row = theory.segment_row(10, 4, 1)
    assert (row.segments, row.boundary_bytes, row.local_bytes, row.total_bytes) == (3, 3, 4, 7)
    # Exactly: the last segment keeps 3 + 2; after x8 is freed the middle one keeps 2 + 4.
    assert exact_peak_copies(10, 4) == 6


@pytest.mark.parametrize("n", [1, 2, 3, 10, 17, 64, 100])
def test_best_integer_k_is_the_brute_force_minimum(n: int) -> None:
    best = theory.best_segment_length(n, 1)
    totals = {k: math.ceil(n / k) + k for k in range(1, n + 1)}
    assert best.total_bytes == min(totals.values())
    assert best.k == min(k for k, t in totals.items() if t == best.total_bytes)


def test_best_k_matches_brute_force_for_every_n_and_unequal_sizes() -> None:
    for n in range(1, 160):
        for ab, ai in ((1, 1), (7, 2), (2, 7), (1, 34), (5, 0), (0, 3)):
            rows = [theory.segment_row(n, k, ab, ai) for k in range(1, n + 1)]
            least = min(r.total_bytes for r in rows)
            want = next(r for r in rows if r.total_bytes == least)
            assert theory.best_segment_length(n, ab, ai) == want, (n, ab, ai)


def test_best_k_of_a_billion_stages_is_quick_and_exact() -> None:
    import time

    began = time.perf_counter()
    best = theory.best_segment_length(10**9, 1)
    assert time.perf_counter() - began < 2.0  # O(sqrt n), not a loop over n
    # n/k + k >= 2 sqrt(n) = 63245.6, so 63246 copies is the least any k keeps ...
    assert best.total_bytes == math.ceil(2 * math.sqrt(10**9))
    # ... and no shorter segment length reaches it
    assert all(theory.segment_row(10**9, k, 1).total_bytes > best.total_bytes
               for k in range(1, best.k))


@pytest.mark.parametrize("n", [4, 16, 64, 100, 144])
def test_continuous_optimum_is_sqrt_n_for_a_uniform_chain(n: int) -> None:
    k, total = theory.continuous_optimum(n, 5.0)
    assert k == pytest.approx(math.sqrt(n))
    assert total == pytest.approx(2 * math.sqrt(n) * 5.0)
    # k = sqrt(n) divides these n, so the integer optimum reaches the continuous one.
    assert theory.best_segment_length(n, 5).total_bytes == pytest.approx(total)


def test_unequal_sizes_optimum_and_totals() -> None:
    n, ab, ai = 48, 4 * MiB, 3 * MiB
    k, total = theory.continuous_optimum(n, ab, ai)
    assert k == pytest.approx(math.sqrt(n * ab / ai))  # = 8
    assert k == pytest.approx(8.0)
    assert total == pytest.approx(2 * math.sqrt(n * ab * ai))
    row = theory.segment_row(n, 8, ab, ai)
    assert row.boundary_bytes == 6 * ab
    assert row.local_bytes == 8 * ai
    assert row.total_bytes == pytest.approx(total)  # 8 divides 48, so the bound is reached
    assert theory.best_segment_length(n, ab, ai).k == 8


def test_small_boundaries_favour_short_segments() -> None:
    # A transformer layer keeps ~34 hidden states inside but passes one across: k* < 1.
    k, _ = theory.continuous_optimum(32, 1, 34)
    assert k < 1
    assert theory.best_segment_length(32, 1, 34).k == 1


def test_work_and_throughput_are_distinct_figures() -> None:
    f = 1.0
    assert theory.work_ratio(f, 2 * f, f) == pytest.approx(4 / 3)  # +33% work
    assert theory.throughput_ratio(f, 2 * f, f) == pytest.approx(3 / 4)  # -25% throughput
    assert 1 - theory.throughput_ratio(f, 2 * f, f) != pytest.approx(
        theory.work_ratio(f, 2 * f, f) - 1
    )
    assert theory.work_ratio(2, 5, 0) == 1.0


def test_transformer_sizes_by_hand() -> None:
    assert theory.hidden_state_bytes(2, 1024, 768, 2) == 2 * 1024 * 768 * 2
    # One 4096x4096 attention matrix for 32 heads at 2 bytes is 1 GiB.
    assert theory.attention_matrix_bytes(1, 32, 4096, 2) == GiB
    s, b, h, a = 2048, 4, 4096, 32
    full = theory.korthikanti_layer_bytes(b, s, h, a)
    assert full == s * b * h * (34 + 5 * a * s / h)
    flash = theory.korthikanti_layer_bytes(b, s, h, a, flash=True)
    assert flash == 34 * s * b * h
    assert full - flash == 5 * a * s * s * b
    assert theory.korthikanti_layer_bytes(b, s, h, a, elem_bytes=4) == 2 * full
    sizes = theory.transformer_sizes(b, s, h, a, 2)
    assert (sizes.layer_bytes, sizes.layer_bytes_flash) == (full, flash)


@pytest.mark.parametrize(
    "call",
    [
        lambda: theory.segment_row(0, 1, 1),
        lambda: theory.segment_row(4, 0, 1),
        lambda: theory.segment_row(4, 2, -1),
        lambda: theory.continuous_optimum(4, 1, 0),
        lambda: theory.work_ratio(0, 0, 1),
        lambda: theory.throughput_ratio(1, -1, 1),
        lambda: theory.hidden_state_bytes(0, 1, 1, 2),
    ],
)
def test_bad_arguments_raise_usage_errors(call) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(UsageError):
        call()


def test_theory_does_not_import_torch() -> None:
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import remat.core.theory, remat.core.units\nprint('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "ok"
