"""Closed-form estimates of checkpointing memory and time (pure Python, no torch).

These are the back-of-the-envelope formulas a user reaches for before touching a model:
how many activation copies a segmented chain keeps, where the segment length that
minimizes them lies, what one extra forward costs in work and in throughput, and how big
a transformer's activations are.  The measured cost model lives in the simulator; these
formulas are the textbook limit it must agree with on uniform chains.

Vocabulary: a chain of ``n`` stages, each keeping ``A`` bytes for backward.  Checkpointing
with segment length ``k`` keeps only the input of every segment (``ceil(n/k)`` boundaries)
and, during backward, rebuilds one segment at a time, so at most one segment's
intermediates (``min(k, n)`` stages, the last segment may be shorter) are alive on top of
the boundaries: ``total = ceil(n/k) * A_b + min(k, n) * A_i``.

That textbook total counts every boundary alive while the longest segment is rebuilt.
Backward frees each boundary once its segment is done, so when ``k`` does not divide
``n`` the exact peak can be one boundary lower (n=10, k=4: 6 copies, not 7); the
simulator computes exact peaks for real plans, these formulas are the bound users quote.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from remat.core.errors import UsageError

__all__ = [
    "SegmentRow",
    "TransformerSizes",
    "attention_matrix_bytes",
    "best_segment_length",
    "continuous_optimum",
    "hidden_state_bytes",
    "korthikanti_layer_bytes",
    "segment_row",
    "segment_table",
    "throughput_ratio",
    "transformer_sizes",
    "work_ratio",
]


def _check_positive_int(value: int, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UsageError(f"{name} must be a whole number of at least 1, got {value!r}")


def _check_nonnegative(value: float, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise UsageError(f"{name} must be a number of bytes of zero or more, got {value!r}")


@dataclass(frozen=True)
class SegmentRow:
    """Memory of a chain checkpointed with segment length ``k``.

    ``boundary_bytes`` are all kept segment inputs, ``local_bytes`` the intermediates of
    the longest segment while it is rebuilt, ``total_bytes`` their sum (the textbook
    activation peak; exact when ``k`` divides ``n``, see the module docstring).
    """

    k: int
    segments: int
    boundary_bytes: int
    local_bytes: int
    total_bytes: int


def segment_row(n: int, k: int, boundary_bytes: int, inner_bytes: int | None = None) -> SegmentRow:
    """Activation memory of an ``n``-stage chain split into segments of ``k`` stages.

    ``boundary_bytes`` is the size of one kept segment input (A_b) and ``inner_bytes``
    what one stage keeps for backward while its segment is rebuilt (A_i, defaults to
    A_b: the uniform chain).  ``k`` need not divide ``n``: there are ``ceil(n/k)``
    boundaries and the last segment is shorter.  ``k >= n`` means no checkpointing
    inside one segment of the whole chain; ``k == 1`` checkpoints every stage.
    """
    _check_positive_int(n, "the number of stages n")
    _check_positive_int(k, "the segment length k")
    _check_nonnegative(boundary_bytes, "the boundary size")
    inner = boundary_bytes if inner_bytes is None else inner_bytes
    _check_nonnegative(inner, "the inner size")
    segments = -(-n // k)  # ceil(n / k), exact for any n
    boundary = segments * int(boundary_bytes)
    local = min(k, n) * int(inner)
    return SegmentRow(k, segments, boundary, local, boundary + local)


def segment_table(
    n: int, boundary_bytes: int, inner_bytes: int | None = None, ks: list[int] | None = None
) -> list[SegmentRow]:
    """Rows for each ``k`` in ``ks`` (default: the powers of two up to ``n``, and ``n``)."""
    _check_positive_int(n, "the number of stages n")
    if ks is None:
        ks = sorted({1 << p for p in range(n.bit_length()) if (1 << p) <= n} | {n})
    return [segment_row(n, k, boundary_bytes, inner_bytes) for k in ks]


def best_segment_length(n: int, boundary_bytes: int, inner_bytes: int | None = None) -> SegmentRow:
    """The integer segment length with the smallest total (the smallest such k on ties).

    Exact in ``O(sqrt(n))``: of the lengths giving the same number of segments
    ``s = ceil(n/k)`` the shortest, ``ceil(n/s)``, keeps the least, and those are the
    ``k <= isqrt(n) + 1`` together with ``ceil(n/s)`` for ``s <= isqrt(n) + 1``.
    """
    _check_positive_int(n, "the number of stages n")
    r = math.isqrt(n) + 1
    candidates = sorted({k for k in range(1, r + 1) if k <= n} | {-(-n // s) for s in
                                                                  range(1, r + 1)})
    best = segment_row(n, candidates[0], boundary_bytes, inner_bytes)
    for k in candidates[1:]:
        row = segment_row(n, k, boundary_bytes, inner_bytes)
        if row.total_bytes < best.total_bytes:
            best = row
    return best


def continuous_optimum(
    n: int, boundary_bytes: float, inner_bytes: float | None = None
) -> tuple[float, float]:
    """The real-valued optimum ``(k*, total*)`` of ``n/k * A_b + k * A_i``.

    ``k* = sqrt(n * A_b / A_i)`` and ``total* = 2 * sqrt(n * A_b * A_i)``; for a uniform
    chain that is ``sqrt(n)`` and ``2 * sqrt(n) * A``.
    """
    _check_positive_int(n, "the number of stages n")
    inner = boundary_bytes if inner_bytes is None else inner_bytes
    _check_nonnegative(boundary_bytes, "the boundary size")
    _check_nonnegative(inner, "the inner size")
    if inner == 0:
        raise UsageError("the inner size must be above zero to have an optimal segment length")
    k = math.sqrt(n * boundary_bytes / inner)
    return k, 2.0 * math.sqrt(n * boundary_bytes * inner)


def work_ratio(fwd: float, bwd: float, rebuild: float) -> float:
    """Work of a step with rebuilding over work without: ``(F + B + R) / (F + B)``.

    One extra forward with ``B = 2F`` gives 4/3: 33% more work.
    """
    _check_times(fwd, bwd, rebuild)
    return (fwd + bwd + rebuild) / (fwd + bwd)


def throughput_ratio(fwd: float, bwd: float, rebuild: float) -> float:
    """Throughput with rebuilding over throughput without: ``(F + B) / (F + B + R)``.

    The reciprocal of :func:`work_ratio`: one extra forward with ``B = 2F`` gives 3/4, a
    25% drop in samples per second.  33% more work is not 33% less throughput.
    """
    _check_times(fwd, bwd, rebuild)
    return (fwd + bwd) / (fwd + bwd + rebuild)


def _check_times(fwd: float, bwd: float, rebuild: float) -> None:
    for name, value in (("forward", fwd), ("backward", bwd), ("rebuild", rebuild)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
            raise UsageError(f"the {name} time must be a number of zero or more, got {value!r}")
    if fwd + bwd <= 0:
        raise UsageError("forward plus backward time must be above zero")


def hidden_state_bytes(batch: int, seq: int, hidden: int, elem_bytes: int) -> int:
    """One hidden state: ``B * S * H * b`` bytes (what crosses a transformer layer boundary)."""
    for name, v in (("batch", batch), ("sequence", seq), ("hidden", hidden), ("bytes", elem_bytes)):
        _check_positive_int(v, f"the {name} size")
    return batch * seq * hidden * elem_bytes


def attention_matrix_bytes(batch: int, q_heads: int, seq: int, elem_bytes: int) -> int:
    """One materialized attention matrix: ``B * Hq * S^2 * b`` bytes."""
    for name, v in (("batch", batch), ("head", q_heads), ("sequence", seq), ("bytes", elem_bytes)):
        _check_positive_int(v, f"the {name} size")
    return batch * q_heads * seq * seq * elem_bytes


def korthikanti_layer_bytes(
    batch: int, seq: int, hidden: int, heads: int, *, flash: bool = False, elem_bytes: int = 2
) -> int:
    """Activations one transformer layer keeps for backward, Korthikanti et al. (2022).

    ``s * b * h * (34 + 5 * a * s / h)`` bytes with 16-bit activations, no tensor or
    sequence parallelism.  The ``5as/h`` term is the attention scores, softmax output and
    its dropout mask; FlashAttention-style kernels do not keep them, so ``flash=True``
    drops it.  For other element sizes the whole estimate is scaled by ``elem_bytes / 2``
    (an approximation: the paper's dropout masks are one byte whatever the dtype).
    """
    for name, v in (("batch", batch), ("sequence", seq), ("hidden", hidden), ("head", heads)):
        _check_positive_int(v, f"the {name} size")
    _check_positive_int(elem_bytes, "the element size")
    # 34*s*b*h + 5*a*s^2*b, kept in integers so the result is exact.
    per16 = 34 * seq * batch * hidden + (0 if flash else 5 * heads * seq * seq * batch)
    return per16 * elem_bytes // 2


@dataclass(frozen=True)
class TransformerSizes:
    """The sizes ``remat estimate --transformer`` reports for one layer."""

    hidden_state_bytes: int
    attention_matrix_bytes: int
    layer_bytes: int
    layer_bytes_flash: int


def transformer_sizes(
    batch: int, seq: int, hidden: int, q_heads: int, elem_bytes: int
) -> TransformerSizes:
    return TransformerSizes(
        hidden_state_bytes=hidden_state_bytes(batch, seq, hidden, elem_bytes),
        attention_matrix_bytes=attention_matrix_bytes(batch, q_heads, seq, elem_bytes),
        layer_bytes=korthikanti_layer_bytes(batch, seq, hidden, q_heads, elem_bytes=elem_bytes),
        layer_bytes_flash=korthikanti_layer_bytes(
            batch, seq, hidden, q_heads, flash=True, elem_bytes=elem_bytes
        ),
    )
