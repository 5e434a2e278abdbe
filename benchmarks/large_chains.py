"""Planning chains of hundreds to thousands of stages: time and peak memory of `remat plan`.

Each chain repeats the four stages of tests/fixtures/profile_mlp_tiny.json (renamed
blocks.0 .. blocks.{n-1}, activation bytes times 16); its measured peak without
checkpointing is set to the simulator's, so a budget of 50% means half of that. Every
plan runs as its own `remat plan` process under /usr/bin/time -v (wall time and maximum
resident set size), one at a time, with a wall-clock limit and a cap on its address
space (a shared machine: a plan that would take all of it is stopped instead); results
go to stdout as a Markdown table.

    .venv/bin/python benchmarks/large_chains.py               # 300 1000 2000 3000 stages
    .venv/bin/python benchmarks/large_chains.py 300 --limit 120 -- --slots 200

Arguments after `--` go to `remat plan` as they are.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "tests" / "fixtures" / "profile_mlp_tiny.json"
REMAT = ROOT / ".venv" / "bin" / "remat"
ACTIVATIONS = 16


def repeated_profile(n: int) -> dict:
    """The tiny profile's stages repeated to ``n`` stages (a valid profile)."""
    from remat.core.profile_format import Profile
    from remat.core.solve.from_profile import predict_no_checkpoint_peak

    data = json.loads(FIXTURE.read_text())
    base = data["stages"]
    stages = []
    for i in range(n):
        stage = dict(base[i % len(base)])
        stage["name"] = f"blocks.{i}"
        stage.pop("input_held_through", None)
        stage.pop("same_as", None)
        stages.append(stage)
    # one tensor between stages: every boundary the size of the first stage's input; the
    # activations 16 times the measured ones (as at batch size 64), so that they, not
    # the parameter gradients, decide the peak and a budget of 50% needs checkpointing
    for s in stages:
        s["boundary_bytes"] = s["output_bytes"] = base[0]["boundary_bytes"] * ACTIVATIONS
        s["saved_bytes"] = {o: b * ACTIVATIONS for o, b in s["saved_bytes"].items()}
        s["selective_bwd_transient_bytes"] = {
            o: b * ACTIVATIONS for o, b in s["selective_bwd_transient_bytes"].items()}
        for key in ("fwd_transient_bytes", "bwd_transient_bytes", "nosave_transient_bytes"):
            s[key] *= ACTIVATIONS
    data["stages"] = stages
    data["model"] = f"{data['model']} repeated to {n} stages"
    data.pop("model_stages", None)
    data.pop("timing_noise", None)
    profile = Profile.from_dict(data)
    data["measured_peak_bytes"] = data["predicted_peak_bytes"] = \
        predict_no_checkpoint_peak(profile)
    return data


def run(n: int, limit: float, cap_gib: int, extra: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"chain_{n}.json"
        path.write_text(json.dumps(repeated_profile(n)))
        plan = " ".join(shlex.quote(a) for a in [str(REMAT), "plan", "--profile", str(path),
                                                   "--budget", "50%", *extra])
        # the limits apply to the plan itself (a shared machine: no plan may take it all)
        cmd = ["/usr/bin/time", "-v", "timeout", "-s", "KILL", str(limit), "bash", "-c",
               f"ulimit -v {cap_gib << 20}; exec {plan}"]
        t0 = time.perf_counter()
        done = subprocess.run(cmd, capture_output=True, text=True)
        code, out, err = done.returncode, done.stdout, done.stderr
        wall = time.perf_counter() - t0
    rss = re.search(r"Maximum resident set size \(kbytes\): (\d+)", err)
    lines = [line for line in err.splitlines() if not line.startswith("\t")
             and "Command exited" not in line]
    plan = " ".join(line.strip() for line in out.splitlines()
                    if line.startswith(("solver ", "predicted step", "note: the chain")))
    return {"stages": n, "exit": code, "wall_s": wall,
            "max_rss_mib": int(rss.group(1)) / 1024 if rss else None,
            "said": (lines[-1] if lines else "")[:300], "plan": plan[:400]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sizes", nargs="*", type=int, default=[300, 1000, 2000, 3000])
    parser.add_argument("--limit", type=int, default=600,
                        help="wall-clock seconds per plan before it is killed (default 600)")
    parser.add_argument("--cap-gib", type=int, default=16,
                        help="address space per plan (ulimit -v), GiB (default 16)")
    args, extra = parser.parse_known_args()
    extra = [a for a in extra if a != "--"]
    print(f"`remat plan --budget 50% {' '.join(extra)}`".replace("  ", " "))
    print()
    print("| stages | exit | wall s | max RSS MiB | plan / message |")
    print("| ---: | ---: | ---: | ---: | --- |")
    for n in args.sizes:
        r = run(n, args.limit, args.cap_gib, extra)
        code = "killed at limit" if r["exit"] in (137, -9) else r["exit"]
        rss = "-" if r["max_rss_mib"] is None else f"{r['max_rss_mib']:.0f}"
        what = r["plan"] or r["said"]
        print(f"| {n} | {code} | {r['wall_s']:.1f} | {rss} | {what} |", flush=True)


if __name__ == "__main__":
    sys.exit(main())
