"""How much rebuild time the optimal solver saves over every-k and segments-k at equal peak.

For each chain, every baseline plan (``every-k`` and ``segments-k`` for every ``k``) is
scored by the simulator; its simulated peak is a budget. At that budget the best
baseline is the one with the least rebuild time among the baselines that fit it, and
``optimal`` is solved at it. Both are compared on the simulator's time breakdown:
``rebuild`` (forward runs inside rebuilds, ``StepTime.rebuild_s``) and ``recompute``
(everything a plan adds to a step without checkpointing: rebuilds, selective stages'
partial rebuilds, offload transfers, region overheads). ``optimal`` minimizes the step
time, that is recompute, not rebuild alone.

Target (issue "Plan optimally under a memory budget"): on heterogeneous chains like
mlp-hetero, at least 15% less rebuild time than the best baseline at the same peak.

Chains: a fresh profile of the built-in ``mlp-hetero`` (``OMP_NUM_THREADS=1 remat profile
--model mlp-hetero --repeats 5``; or ``--profile PATH`` for a saved one), and the
``chain_hetero_6`` fixture.

Run from the repository root::

    PYTHONPATH=src .venv/bin/python benchmarks/solver_quality.py [--profile PATH]

Prints the figures and writes them to ``benchmarks/solver_quality.md``.
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from remat.core.plan_format import Plan
from remat.core.solve import Problem, simulate, solvers
from remat.core.solve.from_profile import problem_from_profile
from remat.core.units import format_bytes

ROOT = Path(__file__).resolve().parent.parent
COMMAND = "PYTHONPATH=src .venv/bin/python benchmarks/solver_quality.py"
TARGET = 0.15


@dataclass(frozen=True)
class Scored:
    name: str
    peak: int
    rebuild_s: float
    recompute_s: float


def score(plan: Plan, problem: Problem, name: str) -> Scored:
    sim = simulate(plan, problem)
    base = simulate(Plan(problem.stage_names), problem).step_time_s
    return Scored(name, sim.peak_bytes, sim.time.rebuild_s, sim.step_time_s - base)


def baselines(problem: Problem) -> list[Scored]:
    out = [score(solvers.every(problem, k), problem, f"every-{k}") for k in range(1, problem.n + 1)]
    out += [score(solvers.segments(problem, k), problem, f"segments-{k}")
            for k in range(1, problem.n + 1)]
    return out


@dataclass(frozen=True)
class Row:
    budget: int
    best: Scored  # least rebuild among baselines that fit
    best_recompute: Scored  # least recompute among them
    opt: Scored
    options: str


def compare(problem: Problem) -> list[Row]:
    base = baselines(problem)
    rows = []
    for budget in sorted({b.peak for b in base}):
        fit = [b for b in base if b.peak <= budget]
        best = min(fit, key=lambda b: (b.rebuild_s, b.peak))
        best_rc = min(fit, key=lambda b: (b.recompute_s, b.peak))
        plan = solvers.optimal(problem, budget)
        assert plan.predicted_peak_bytes is not None and plan.predicted_peak_bytes <= budget
        opt = score(plan, problem, "optimal")
        regions = " ".join(f"[{r.start},{r.stop})" for r in plan.regions) or "-"
        chosen = sorted({o for o in plan.options if o != "keep"})
        rows.append(Row(budget, best, best_rc, opt, f"{regions}; {', '.join(chosen) or 'keep'}"))
    return rows


def extra_budget(problem: Problem, budget: int, target_s: float) -> int:
    """The least budget above ``budget`` (within 64 bytes) at which ``optimal`` is as fast
    as ``target_s`` of recompute: how much the slot rounding costs there."""
    base = simulate(Plan(problem.stage_names), problem).step_time_s

    def good(b: int) -> bool:
        plan = solvers.optimal(problem, b)
        assert plan.predicted_step_time_s is not None
        return plan.predicted_step_time_s - base <= target_s + 1e-12

    lo, hi = budget, budget + max(1024, budget // 64)
    while not good(hi):
        lo, hi = hi, hi + (hi - budget)
    while hi - lo > 64:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if good(mid) else (mid, hi)
    return hi


def saving(ours: float, theirs: float) -> float | None:
    return None if theirs <= 0 else 1 - ours / theirs


def pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def report(title: str, problem: Problem) -> tuple[str, list[float]]:
    rows = compare(problem)
    opts = sorted({o for i in range(problem.n) for o in problem.options(i)})
    lines = [f"## {title}", "",
             f"{problem.n} stages, backward base {format_bytes(problem.backward_base_bytes)}, "
             f"options per stage: {', '.join(opts)}; "
             f"early stop {'on' if problem.early_stop else 'off'}, {problem.slots} slots.", "",
             "| budget (= a baseline's peak) | best baseline by rebuild | its rebuild "
             "| optimal rebuild "
             "| rebuild saved | best baseline by recompute | its recompute | optimal recompute "
             "| recompute saved | optimal peak | optimal plan |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    savings = []
    for r in rows:
        s_reb = saving(r.opt.rebuild_s, r.best.rebuild_s)
        s_rc = saving(r.opt.recompute_s, r.best_recompute.recompute_s)
        if s_reb is not None:
            savings.append(s_reb)
        lines.append(
            f"| {format_bytes(r.budget)} | {r.best.name} | {1e3 * r.best.rebuild_s:.3f} ms "
            f"| {1e3 * r.opt.rebuild_s:.3f} ms | {pct(s_reb)} | {r.best_recompute.name} "
            f"| {1e3 * r.best_recompute.recompute_s:.3f} ms | {1e3 * r.opt.recompute_s:.3f} ms "
            f"| {pct(s_rc)} | {format_bytes(r.opt.peak)} | {r.options} |")
    lines.append("")
    slower = [r for r in rows if r.opt.recompute_s > r.best_recompute.recompute_s + 1e-12]
    if slower:
        lines.append("Where `optimal` is slower than a baseline that fits, it is the slot "
                     "rounding (Note [The recursion]: every held quantity rounds up to a "
                     "slot): the budget `optimal` needs to match that baseline's recompute:")
        lines.append("")
        for r in slower:
            need = extra_budget(problem, r.budget, r.best_recompute.recompute_s)
            avail = r.budget - problem.backward_base_bytes
            slot = max(1, -(-avail // problem.slots))
            lines.append(f"- at {format_bytes(r.budget)} ({r.best_recompute.name}, peak "
                         f"{format_bytes(r.best_recompute.peak)}): {format_bytes(need)}, "
                         f"{need - r.budget} bytes more "
                         f"({(need - r.budget) / slot:.1f} slots of {slot} bytes).")
        lines.append("")
    if savings:
        worst = min(savings)
        lines.append(
            f"Rebuild time saved at equal peak: least {pct(worst)}, median "
            f"{pct(sorted(savings)[len(savings) // 2])} over {len(savings)} budgets, "
            f"{sum(x >= TARGET for x in savings)} of them at least {pct(TARGET)}; target "
            f"{pct(TARGET)} at every budget: **{'met' if worst >= TARGET else 'missed'}**.")
    lines.append("")
    return "\n".join(lines), savings


def profile_mlp_hetero() -> Path:
    out = Path(tempfile.mkdtemp()) / "mlp-hetero.json"
    # As `remat bench` profiles (README-bench.md): one intra-op thread, five timed rounds;
    # with two threads on this shared machine and two rounds, per-stage option times were
    # noise-sized and made selective stages look free.
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), OMP_NUM_THREADS="1")
    subprocess.run([sys.executable, "-m", "remat", "profile", "--model", "mlp-hetero",
                    "--repeats", "5", "--json", str(out)], check=True, env=env, cwd=ROOT,
                   stdout=subprocess.DEVNULL)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", help="a saved profile of mlp-hetero (default: profile now)")
    parser.add_argument("--out", default=str(Path(__file__).with_name("solver_quality.md")))
    args = parser.parse_args()
    from remat.core.profile_format import Profile

    path = Path(args.profile) if args.profile else profile_mlp_hetero()
    mlp = problem_from_profile(Profile.load(path))
    hetero = Problem.load(ROOT / "tests" / "fixtures" / "chain_hetero_6.json")
    parts = [
        "# Optimal solver against every-k and segments-k at equal peak", "",
        f"Reproduce with `{COMMAND}`. Python {platform.python_version()}. Every figure is "
        "the simulator's (`remat.core.solve.simulate`), so it does not depend on the machine "
        "except through the profile's measured times. For each baseline plan (every-k and "
        "segments-k, every k) its simulated peak is a budget; at it the best baseline that "
        "fits is compared with `optimal` solved at that budget. *rebuild*: "
        "`StepTime.rebuild_s`; *recompute*: everything the plan adds to the step without "
        "checkpointing (rebuild, selective partial rebuilds, offload, region overhead), "
        "which is what `optimal` minimizes.", "",
    ]
    verdicts = []
    mlp_title = ("mlp-hetero (profiled on this machine, one thread, 5 rounds)" if not args.profile
                 else f"mlp-hetero (the profile {path.name})")
    for title, problem in ((mlp_title, mlp),
                           ("chain_hetero_6 fixture", hetero)):
        text, savings = report(title, problem)
        parts.append(text)
        verdicts.append((title, min(savings) if savings else None))
    parts.append("## Summary")
    parts.append("")
    for title, worst in verdicts:
        parts.append(f"- {title}: least rebuild saving {pct(worst)} (target {pct(TARGET)} at "
                     "every budget).")
    parts += ["",
              "Why the target is missed where it is: (1) at a budget exactly equal to a "
              "baseline's peak, the 500-slot rounding can leave that baseline's plan "
              "infeasible for the DP (listed above, each within a few slots); (2) at some "
              "budgets the best baseline is already the fastest plan there is (0% saved: "
              "`optimal` returns the same plan); (3) `optimal` minimizes recompute, and may "
              "trade rebuild time for selective stages' partial rebuilds, which count as "
              "recompute, not rebuild."]
    parts.append("")
    text = "\n".join(parts)
    print(text)
    Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
