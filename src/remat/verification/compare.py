"""Comparing the tensors of the two twins: element-wise errors and one check row per group."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from remat.verification.tolerance import TolerancePolicy
from remat.verification.verify_report import Check

__all__ = ["Diff", "check_tensors", "diff"]


@dataclass(frozen=True)
class Diff:
    """How far ``a`` (with the plan) is from ``b`` (plain); ``ok`` within tolerance."""

    ok: bool
    max_abs_error: float
    max_rel_error: float  # max|a - b| / max|b|


_MISSING = Diff(False, math.inf, math.inf)


def _as_float64(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    if t.is_complex():
        t = torch.view_as_real(t)
    return t.to(torch.float64)


def diff(a: torch.Tensor | None, b: torch.Tensor | None, policy: TolerancePolicy) -> Diff:
    """Compare two tensors (None: no gradient); NaNs in the same places count as equal."""
    if a is None and b is None:
        return Diff(True, 0.0, 0.0)
    if a is None or b is None or a.shape != b.shape or a.dtype != b.dtype:
        return _MISSING
    if a.numel() == 0 or torch.equal(a, b.to(a.device)):  # the common case, cheaply
        return Diff(True, 0.0, 0.0)
    tol = policy.for_dtype(b.dtype)
    a64, b64 = _as_float64(a), _as_float64(b.to(a.device))
    same = (a64 == b64) | (a64.isnan() & b64.isnan())
    err = torch.nan_to_num((a64 - b64).abs().masked_fill(same, 0.0), nan=math.inf)
    max_abs = float(err.max())
    finite_b = b64.abs().masked_fill(~b64.isfinite(), 0.0)
    scale = float(finite_b.max())
    max_rel = 0.0 if max_abs == 0 else (max_abs / scale if scale > 0 else math.inf)
    within = same if tol.exact else err <= tol.atol + tol.rtol * finite_b
    ok = bool(within.all())
    return Diff(ok, max_abs, max_rel)


def check_tensors(
    name: str,
    pairs: Iterable[tuple[str, torch.Tensor | None, torch.Tensor | None]],
    policy: TolerancePolicy,
    *,
    what: str = "tensors",
) -> Check:
    """One check row over ``(label, with_plan, plain)`` pairs: fail if any pair differs."""
    results: list[tuple[str, Diff]] = []
    dtypes: dict[torch.dtype, None] = {}
    for label, a, b in pairs:
        results.append((label, diff(a, b, policy)))
        for t in (b, a):
            if t is not None:
                dtypes[t.dtype] = None
                break
    if not results:
        return Check(name, "skip", f"no {what} to compare", tolerance=policy.describe())
    failed = [(label, d) for label, d in results if not d.ok]
    pool = failed or results
    worst_label, worst = max(pool, key=lambda item: (item[1].max_rel_error, item[1].max_abs_error))
    tolerance = "; ".join(policy.describe(dt) for dt in dtypes) or policy.describe()
    if failed:
        message = f"{len(failed)} of {len(results)} {what} differ; worst {worst_label!r}"
    elif len(results) == 1:
        message = f"the {worst_label} agrees"
    else:
        message = f"{len(results)} {what} agree"
    return Check(
        name=name,
        status="fail" if failed else "pass",
        message=message,
        compared=len(results),
        max_abs_error=worst.max_abs_error,
        max_rel_error=worst.max_rel_error,
        worst=worst_label,
        tolerance=tolerance,
    )
