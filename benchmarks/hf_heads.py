"""``hf:<model_type>`` with the head each family trains with, across modalities.

For each model type: build it as ``hf:<model_type>`` (its default head, or the one named
after a ``/``: ``whisper/audio-classification``), find its stages, then profile, plan at
75% of its peak, verify the plan (one step, dropout as the family has it) and apply it to
a fresh copy and measure one training step against the prediction. Where no plan fits
75% (the parameters and AdamW state alone take more), the plan is at the least budget
remat names. A type passes when
every step ran and verify passed; otherwise the row says where and why it stopped. Each
type runs in a process of its own, with a time limit.

Sizes: the module's CPU defaults (4 layers, hidden size 128, 4 heads, 64 x 64 images,
128 audio frames, batch 4); ``--tiny`` runs the test suite's sizes instead (2 layers,
hidden size 32, 2 heads, batch 2, seq_len 32, 64 x 64 images).

Run from the repository root::

    PYTHONPATH=src .venv/bin/python benchmarks/hf_heads.py [--types vit clip ...] [--tiny]

Prints the table and writes it to ``benchmarks/hf_heads.md`` (all types only); then
``--docs`` copies its type, head, stages and result columns into docs/transformers.md
(between the ``hf_heads`` markers).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

COMMAND = "PYTHONPATH=src .venv/bin/python benchmarks/hf_heads.py"
LIMIT_S = 240
#: The types tried, by modality (a head after "/" where it is not the family's default).
TYPES = {
    "vision": [
        "vit", "deit", "beit", "dinov2", "data2vec-vision", "vit_msn", "ijepa", "swin",
        "swinv2", "convnext", "convnextv2", "resnet", "regnet", "bit", "levit", "cvt",
        "efficientnet", "mobilenet_v2", "mobilevit", "poolformer", "pvt", "pvt_v2",
        "segformer", "focalnet", "hiera", "dinat",
    ],
    "video": ["videomae", "vivit", "timesformer"],
    "audio": [
        "wav2vec2", "hubert", "wavlm", "sew", "sew-d", "unispeech", "unispeech-sat",
        "data2vec-audio", "wav2vec2-conformer", "wav2vec2/audio-classification", "whisper",
        "whisper/audio-classification", "speech_to_text", "audio-spectrogram-transformer",
        "moonshine",
    ],
    "multimodal": [
        "clip", "siglip", "siglip2", "chinese_clip", "altclip", "align", "blip",
        "metaclip_2",
    ],
    "text": [
        "gpt2", "llama", "qwen2", "mistral", "bert", "roberta", "electra", "distilbert",
        "t5", "bart", "gpt_neox", "opt", "falcon", "phi", "bert/text-classification",
    ],
}
IMAGES = ("image-classification", "video-classification", "contrastive")
TINY = {"num_hidden_layers": 2, "hidden_size": 32, "num_attention_heads": 2, "batch_size": 2}


def options(model_type: str, tiny: bool) -> dict[str, Any]:
    """The sizes a type is built with: the module's defaults, or the tiny ones (those size
    names the family has)."""
    from remat.models.hf import _heads, size_options

    if not tiny:
        return {}
    has = set(size_options(model_type))
    found: dict[str, Any] = {k: v for k, v in TINY.items() if k in has or k == "batch_size"}
    heads = _heads(model_type)
    if heads and heads[0] in ("causal", "seq2seq", "masked", "text-classification"):
        found.update(vocab_size=64, seq_len=32)
    elif heads and heads[0] in ("ctc", "speech-seq2seq", "audio-classification"):
        found.update(seq_len=32)
    elif heads and heads[0] in IMAGES and model_type != "siglip2":  # siglip2 takes patches
        found.update(image_size=64)
    return found


def one(spec: str, tiny: bool) -> dict[str, Any]:
    """Build, discover, profile, plan at 75%, verify, apply and measure one type."""
    import torch

    import remat
    from remat.core.errors import CheckFailed
    from remat.core.solve import solvers
    from remat.core.solve.from_profile import problem_from_profile
    from remat.measure import measure_step
    from remat.models import load_model
    from remat.runtime.stages import discover_stages

    torch.set_num_threads(1)
    model_type, _, head = spec.partition("/")
    opts = options(model_type, tiny)
    if head:
        opts["head"] = head
    row: dict[str, Any] = {"type": spec, "stage": "build"}
    start = time.perf_counter()
    try:
        model, batch, loss_fn = load_model(f"hf:{model_type}", **opts)
        row.update(model=type(model).__name__, inputs=sorted(batch))
        row["stage"] = "stages"
        stages = discover_stages(model, batch, loss_fn)
        row["stages"] = stages
        row["stage"] = "profile"
        prof = remat.profile(model, batch, loss_fn, stages=stages, repeats=1)
        row["stage"] = "plan"
        try:
            plan = remat.plan(prof, "75%")
            row["budget"] = "75%"
        except CheckFailed:  # the parameters and optimizer state alone take more
            least = solvers.minimum_budget(problem_from_profile(prof))
            plan = remat.plan(prof, least)
            row["budget"] = "minimum"
        row["plan"] = {"regions": [str(r) for r in plan.regions], "options": list(plan.options)}
        row["predicted"] = plan.predicted_peak_bytes
        row["unplanned"] = prof.measured_peak_bytes
        row["stage"] = "verify"
        report = remat.verify(lambda: load_model(f"hf:{model_type}", **opts), batch, plan,
                              loss_fn, steps=1)
        row["verify"] = report.ok
        if not report.ok:
            failing = [f"{c.name}: {c.message}" for c in report.checks if not c.passed]
            hazards = [f"{h.kind} at {h.stage}" for h in report.blocking_hazards]
            row["reason"] = "; ".join([*failing, *hazards])[:300]
        row["stage"] = "apply"
        fresh, batch, loss_fn = load_model(f"hf:{model_type}", **opts)
        handle = remat.apply(fresh, plan)
        row["measured"] = measure_step(fresh, batch, loss_fn).peak_bytes
        handle.remove()
        row["stage"] = "done"
    except Exception as err:  # the row records where and why it stopped
        lines = str(err).strip().splitlines()
        row["reason"] = f"{type(err).__name__}: {lines[0] if lines else ''}"[:300]
    row["seconds"] = round(time.perf_counter() - start, 1)
    return row


def run(spec: str, tiny: bool) -> dict[str, Any]:
    """:func:`one` in a process of its own (a crash or a hang is a row too)."""
    args = [sys.executable, __file__, "--one", spec, *(["--tiny"] if tiny else [])]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent / "src")}
    try:
        done = subprocess.run(args, capture_output=True, text=True, timeout=LIMIT_S, env=env)
    except subprocess.TimeoutExpired:
        return {"type": spec, "stage": "?", "reason": f"over the {LIMIT_S} s limit"}
    last = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if not last:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return {"type": spec, "stage": "?", "reason": f"exit {done.returncode}: {tail}"[:300]}
    return json.loads(last[-1])


def _mib(value: int | None) -> str:
    return "" if value is None else f"{value / 2**20:.2f}"


def _stages(names: list[str] | None) -> str:
    if not names:
        return "none"
    if len(names) == 1:
        return f"1: `{names[0]}`"
    return f"{len(names)}: `{names[0]}` .. `{names[-1]}`"


def row_text(modality: str, row: dict[str, Any]) -> str:
    from remat.models.hf import _heads

    model_type, _, head = row["type"].partition("/")
    if not head:
        heads = _heads(model_type)
        head = heads[0] if heads else "none"
    ok = row["stage"] == "done" and row.get("verify")
    error = ""
    if row.get("measured") and row.get("predicted"):
        error = f"{100 * (row['measured'] / row['predicted'] - 1):+.1f}%"
    where = "verify" if row["stage"] == "done" else row["stage"]  # ran through, verify failed
    result = "pass" if ok else f"NO ({where}): {row.get('reason', '')}"
    return (
        f"| {modality} | `{row['type']}` | {head} | {row.get('model', '')} | "
        f"{_stages(row.get('stages'))} | {row.get('budget', '')} | {_mib(row.get('predicted'))} | "
        f"{_mib(row.get('measured'))} | {error} | {result} | {row.get('seconds', '')} |"
    ).replace("\n", " ")


BEGIN, END = "<!-- hf_heads: begin -->", "<!-- hf_heads: end -->"


def docs() -> None:
    """The recorded table's type, head, stages and result, into docs/transformers.md."""
    root = Path(__file__).parent.parent
    recorded = Path(__file__).with_suffix(".md").read_text().splitlines()
    rows = [line for line in recorded if line.startswith("| ") and "`" in line]
    lines = ["| type | head | stages found | result |", "| --- | --- | --- | --- |"]
    for line in rows:
        cells = [c.strip() for c in line.strip("|").split(" | ")]
        _, spec, head, _, stages, *_, result, _ = cells
        lines.append(f"| {spec} | {head} | {stages} | {result} |")
    summary = next((line for line in recorded if line.startswith("`")), "")
    page = root / "docs" / "transformers.md"
    text = page.read_text()
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    block = "\n".join(["", summary, "", *lines, ""])
    page.write_text(text[:start] + block + text[end:])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--types", nargs="+", help="model types (default: all of TYPES)")
    parser.add_argument("--tiny", action="store_true", help="the test suite's sizes")
    parser.add_argument("--docs", action="store_true", help="the recorded table into the docs")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.docs:
        docs()
        return 0
    if args.one:
        print(json.dumps(one(args.one, args.tiny)))
        return 0
    chosen = [
        (modality, spec)
        for modality, specs in TYPES.items()
        for spec in specs
        if not args.types or spec in args.types
    ]
    header = [
        "| modality | type | head | model | stages found | budget | predicted (MiB) "
        "| measured (MiB) | measured - predicted | pass | seconds |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    print("\n".join(header), flush=True)
    lines: list[str] = []
    for modality, spec in chosen:
        line = row_text(modality, run(spec, args.tiny))
        print(line, flush=True)
        lines.append(line)
        if not args.types:  # after each row, so that a run cut short leaves its rows
            write(lines, len(chosen), header, args.tiny)
    return 0


def write(lines: list[str], total: int, header: list[str], tiny: bool) -> None:
    import torch
    import transformers

    passed = sum("| pass |" in line for line in lines)
    sizes = "the test suite's tiny sizes" if tiny else "the module's CPU defaults"
    cut = "" if len(lines) == total else f" (cut short: {len(lines)} of {total} types run)"
    Path(__file__).with_suffix(".md").write_text(
        "# `hf:<model_type>` heads across modalities\n\n"
        f"`{COMMAND}{' --tiny' if tiny else ''}` (sizes: {sizes}; plan at 75% of "
        "the unplanned peak, or at the least budget remat names where none fits 75%, "
        "verify one step, measured on a fresh copy with the plan "
        f"applied). torch {torch.__version__}, transformers {transformers.__version__}, "
        f"{platform.machine()} CPU shared with other jobs (seconds are wall time under "
        f"that load), one thread. {passed} of {len(lines)} pass{cut}.\n\n"
        + "\n".join([*header, *lines])
        + "\n"
    )


if __name__ == "__main__":
    sys.exit(main())
