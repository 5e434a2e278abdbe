"""remat on compiled stages against torch.compile's own budget: the targets, per model.

Reads the ``bench.json`` of ``remat bench --compile --strategies compile`` runs (one per
model) and checks, for the ``remat+compile`` rows:

1. measured peak within +-5% of the prediction and never above the budget, at every
   feasible budget (the budget rows and the rows at each compile row's peak);
2. at each compile row's measured peak, the median of per-round step-time ratios
   remat+compile / compile (both ran in the same interleaved rounds);
3. the lowest measured peak of remat+compile below compile's lowest;
4. gradients equal eager's (the compile rows' tolerance).

    PYTHONPATH=src .venv/bin/python benchmarks/compile_targets.py \\
        benchmarks/compile_bench/*/bench.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from remat.benchmarking.step_measures import paired
from remat.core.units import format_bytes

RC = "remat+compile"


def _grads(row: dict) -> str:
    if row["grads_match"]:
        return "equal"
    return "differ: float32 rounding only" if row.get("grads_rounding_only") else "DIFFER"


def _model(path: Path) -> list[str]:
    data = json.loads(path.read_text())
    rows = {r["key"]: r for r in data["rows"]}
    lines = [f"### {data['model']}", ""]
    lines.append("| row | budget | predicted | measured | error | within | grads | "
                 "ratio to compile |")
    lines.append("| --- | --- | --- | --- | --- | --- | --- | --- |")
    peaks_ok, ratios = [], []
    for key, r in rows.items():
        if r["strategy"] != RC:
            continue
        if r["status"] != "ok":
            lines.append(f"| {key} | {format_bytes(r['budget_bytes'] or 0)} | - | - | - | - | "
                         f"{r['status']}: {r.get('reason')} | - |")
            continue
        error = r["measured_peak_bytes"] / r["predicted_peak_bytes"] - 1
        within = r["measured_peak_bytes"] <= r["budget_bytes"]
        peaks_ok.append(abs(error) <= 0.05 and within)
        ratio = "-"
        matched = r.get("matched_to")
        if matched and matched in rows and rows[matched]["status"] == "ok":
            value, _ = paired(r["step_times_s"], rows[matched]["step_times_s"])
            ratios.append(value)
            ratio = f"{value:.2f}"
        lines.append(
            f"| {key} | {format_bytes(r['budget_bytes'])} | "
            f"{format_bytes(r['predicted_peak_bytes'])} | {format_bytes(r['measured_peak_bytes'])}"
            f" | {error:+.1%} | {'yes' if within else 'NO'} | "
            f"{_grads(r)} | {ratio} |"
        )
    compile_peaks = [r["measured_peak_bytes"] for r in rows.values()
                     if r["strategy"] == "compile" and r["status"] == "ok"]
    ours = [r["measured_peak_bytes"] for r in rows.values()
            if r["strategy"] == RC and r["status"] == "ok"]
    grads = all(r["grads_match"] for r in rows.values() if r["strategy"] == RC
                and r["status"] == "ok")
    compile_grads = [_grads(r) for r in rows.values() if r["strategy"] == "compile"
                     and r["status"] == "ok"]
    lines += [
        "",
        f"- peaks within +-5% of prediction and budget: {sum(peaks_ok)} of {len(peaks_ok)} "
        f"rows ({'met' if peaks_ok and all(peaks_ok) else 'NOT met'})",
        f"- at compile's peaks, remat+compile/compile median ratios: "
        f"{', '.join(f'{x:.2f}' for x in ratios) or '-'}; largest "
        f"{max(ratios):.2f}" if ratios else "- no matched rows ran",
        f"- lowest peak: remat+compile {format_bytes(min(ours)) if ours else '-'}, compile "
        f"{format_bytes(min(compile_peaks)) if compile_peaks else '-'} "
        f"({'met' if ours and compile_peaks and min(ours) < min(compile_peaks) else 'NOT met'})",
        f"- gradients of every remat+compile row equal eager's: {'met' if grads else 'NOT met'}"
        f" (the compile rows': {', '.join(compile_grads)})",
        "",
    ]
    return lines


def main() -> None:
    paths = [Path(p) for p in sys.argv[1:]]
    if not paths:
        raise SystemExit("give the bench.json files")
    out = []
    for path in paths:
        out += _model(path)
    print("\n".join(out))


if __name__ == "__main__":
    main()
