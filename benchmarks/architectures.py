"""``remat auto`` on the architectures users bring, at 75% and at the minimum it names.

For each model: the stages discovery finds and the share of the activation memory they
cover, then the main job (profile, plan, apply, verify, measure) at ``--budget 75%`` and
at the smallest budget any plan reaches (read from the first run's profile, exactly as
the planning error names it). Per run: the plan, predicted against measured peak (the
live-storage tracker, a whole training step), whether it stayed within the budget,
whether gradients were equal and verify passed, and ``auto``'s verdict (exit 0 or 1).

Models: the built-ins (``resnet``, ``convnext``, ``encdec``, ``unet``, ``gpt``,
``mlp-hetero``, ``convnet-bn``; ``mobilenet``, ``efficientnet`` and ``vgg``, blocks in a
container beside a stem and a head, at width 4, 32 x 32 images, batch 8), transformers
families from configs (``hf:bert``, ``hf:t5``, ``hf:gpt_neox``, ``hf:mixtral``,
``hf:mamba``, ``hf:llama``, ``hf:albert`` with its one shared layer group, and
``HF_TYPES``: 30 and more types of every modality, each with the head
:mod:`remat.models.hf` chooses and the sizes benchmarks/hf_heads.py builds it with, or
smaller where ``HF_SIZES`` says so and why), a
diffusers ``UNet2DModel`` (``diffusers-unet``, skipped without diffusers), and models
written here: three loops with code between their blocks (``loop-add``:
``x = x + block(x)`` over LayerNorm-MLP blocks; ``loop-relu-add``: the blocks end in a
ReLU; ``loop-gate``: ``x = x * sigmoid(block(x))``), ``lstm-stack`` (four
``nn.LSTM`` blocks, as tests/test_verify_lstm.py) and ``looped-shared`` (one shared
``TransformerEncoderLayer`` called six times, as tests/test_shared_layers.py). Random
weights, nothing downloaded.

Where no plan fits 75% (the parameters and their AdamW state alone take more), the 75%
row says so and the minimum row still runs, at the budget the planning error names.

Run from the repository root::

    PYTHONPATH=src .venv/bin/python benchmarks/architectures.py [--models resnet unet ...]

Prints the rows and merges them into ``benchmarks/architectures.md`` by model name as
each model finishes (rows of models not run stay as recorded; each row names the run
that made it: commit, date and the machine's load).
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from remat.benchmarking.main_job import AutoReport, Stopped, auto
from remat.core.coverage import coverage
from remat.core.solve import solvers
from remat.core.solve.from_profile import problem_from_profile

sys.path.insert(0, str(Path(__file__).parent))
from hf_heads import options as hf_options  # a sibling script

COMMAND = "PYTHONPATH=src .venv/bin/python benchmarks/architectures.py"
BUILTINS = ["resnet", "convnext", "encdec", "unet", "gpt", "mlp-hetero", "convnet-bn"]
#: blocks in a container beside a stem and a head, small enough for a run under a minute
MIXED = ["mobilenet", "efficientnet", "vgg"]
SMALL = {"width": 4, "image_size": 32, "batch_size": 8}
HF = ["hf:bert", "hf:t5", "hf:gpt_neox", "hf:mixtral", "hf:mamba", "hf:llama", "hf:albert"]
#: transformers types of every modality that pass in benchmarks/hf_heads.md, each with the
#: head remat.models.hf chooses, at the sizes hf_heads.py builds them with (its --tiny)
HF_TYPES = [
    # text
    "gpt2", "qwen2", "mistral", "roberta", "electra", "distilbert", "bart", "opt",
    "falcon", "phi",
    # vision
    "vit", "deit", "beit", "dinov2", "data2vec-vision", "vit_msn", "ijepa", "mobilenet_v2",
    "focalnet", "hiera", "levit", "segformer",
    # video
    "videomae", "vivit", "timesformer",
    # audio
    "whisper", "audio-spectrogram-transformer", "moonshine", "speech_to_text", "wav2vec2",
    "hubert",
    # image and text
    "clip", "siglip", "chinese_clip", "blip", "metaclip_2",
]  # fmt: skip


def diffusers_unet(*, batch_size: int = 4, seed: int = 0) -> tuple[Any, Any, Callable]:
    """A small diffusers UNet2DModel (two levels, attention in the lower one)."""
    from diffusers import UNet2DModel

    torch.manual_seed(seed)
    model = UNet2DModel(
        sample_size=16, in_channels=3, out_channels=3, layers_per_block=2,
        block_out_channels=(32, 64), norm_num_groups=8,
        down_block_types=("DownBlock2D", "AttnDownBlock2D"),
        up_block_types=("AttnUpBlock2D", "UpBlock2D"),
    )
    noisy, noise = torch.randn(batch_size, 3, 16, 16), torch.randn(batch_size, 3, 16, 16)
    t = torch.randint(0, 1000, (batch_size,))

    def loss_fn(m: Any, batch: Any) -> torch.Tensor:
        x, steps, target = batch
        return torch.nn.functional.mse_loss(m(x, steps).sample, target)

    return model, (noisy, t, noise), loss_fn


class _LoopBlock(torch.nn.Module):
    def __init__(self, d: int, relu: bool) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(d)
        self.fc1, self.fc2 = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)
        self.relu = relu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x))))
        return torch.relu(y) if self.relu else y


class _Loop(torch.nn.Module):
    """A user's loop with code between the blocks: ``x = x + block(x)`` or a gate."""

    def __init__(self, glue: str, relu: bool, d: int = 128, n: int = 6) -> None:
        super().__init__()
        self.inp, self.out = torch.nn.Linear(64, d), torch.nn.Linear(d, 10)
        self.blocks = torch.nn.ModuleList(_LoopBlock(d, relu) for _ in range(n))
        self.glue = glue

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = x + block(x) if self.glue == "add" else x * torch.sigmoid(block(x))
        return self.out(x)


def _loop(glue: str, relu: bool) -> Callable[..., Any]:
    def make(*, batch_size: int = 16, seed: int = 0) -> tuple[Any, Any, Callable]:
        torch.manual_seed(seed)
        batch = torch.randn(batch_size, 128, 64), torch.randint(0, 10, (batch_size, 128))

        def loss_fn(m: Any, b: Any) -> torch.Tensor:
            return torch.nn.functional.cross_entropy(m(b[0]).flatten(0, 1), b[1].flatten())

        return _Loop(glue, relu), batch, loss_fn

    return make


class _LSTMBlock(torch.nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.lstm = torch.nn.LSTM(d, d, batch_first=True)
        self.proj = torch.nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, _ = self.lstm(x)
        return x + self.proj(y)


class _Stack(torch.nn.Module):
    def __init__(self, blocks: list[torch.nn.Module]) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def lstm_stack(*, batch_size: int = 4, seed: int = 0) -> tuple[Any, Any, Callable]:
    """Four LSTM blocks (width 32) over a (batch, 16, 32) tensor, a mean-square loss."""
    torch.manual_seed(seed)

    def loss_fn(m: Any, x: torch.Tensor) -> torch.Tensor:
        return m(x).square().mean()

    return _Stack([_LSTMBlock(32) for _ in range(4)]), torch.randn(batch_size, 16, 32), loss_fn


class _Looped(torch.nn.Module):
    """An embedding, one shared encoder layer called ``depth`` times, a head."""

    def __init__(self, vocab: int = 64, width: int = 32, depth: int = 6) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.layer = torch.nn.TransformerEncoderLayer(width, 4, 4 * width, dropout=0.1,
                                                      batch_first=True)
        self.depth = depth
        self.head = torch.nn.Linear(width, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for _ in range(self.depth):
            h = self.layer(h)
        return self.head(h)


def looped_shared(*, batch_size: int = 4, seed: int = 0) -> tuple[Any, Any, Callable]:
    torch.manual_seed(seed)
    ids = torch.randint(0, 64, (batch_size, 16))

    def loss_fn(m: Any, b: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(m(b).flatten(0, 1), b.flatten())

    return _Looped(), ids, loss_fn


EXTRA: dict[str, Callable[..., Any]] = {
    "diffusers-unet": diffusers_unet,
    "loop-add": _loop("add", relu=False),
    "loop-relu-add": _loop("add", relu=True),
    "loop-gate": _loop("gate", relu=False),
    "lstm-stack": lstm_stack,
    "looped-shared": looped_shared,
}
ALL = [*BUILTINS, *MIXED, *HF, *(f"hf:{t}" for t in HF_TYPES), *EXTRA]


#: types built smaller than the module's defaults, and why (the row's notes say so too)
HF_SIZES: dict[str, dict[str, Any]] = {
    # at the defaults (width 96, 224 x 224 images, 20.5M parameters) the benchmark's
    # process grew past 17.9 GB during hf:focalnet (run R3) and was killed on this shared
    # 24 GB machine; at width 48 and 160 x 160 images a plain step peaks at 168 MiB
    "focalnet": {"hidden_size": 48, "image_size": 160},
    # at the defaults (width 96, 18.4M parameters, a plain step's peak 588 MiB) the
    # process passed 7 GB without a row in 17 min (run R5, stopped by hand); at width 48
    # a plain step peaks at 235 MiB
    "hiera": {"hidden_size": 48},
    # at the defaults (batch 4) 28.22 of the 50.08 MiB a plain step peaks at are
    # parameters, gradients and AdamW state, so no plan reaches 75% (the least 79%, run R3);
    # at batch 16, as contrastive training runs, the activations are the larger part
    "clip": {"batch_size": 16},
    "metaclip_2": {"batch_size": 16},
}


def target_of(name: str) -> tuple[Any, dict[str, Any]]:
    """What ``auto`` builds for a row name, and the options it is built with."""
    if name in EXTRA:
        return EXTRA[name], {}
    if name in MIXED:
        return name, dict(SMALL)
    if name.startswith("hf:") and name[3:] in HF_TYPES:
        return name, {**hf_options(name[3:], tiny=False), **HF_SIZES.get(name[3:], {})}
    return name, {}


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f}"


def _plan_text(report: AutoReport) -> str:
    plan = report.plan
    regions = " ".join(f"[{r.start},{r.stop})" for r in plan.regions) or "none"
    counts: dict[str, int] = {}
    for o in plan.options:
        counts[o.removeprefix("selective:")] = counts.get(o.removeprefix("selective:"), 0) + 1
    return f"{regions}; " + ", ".join(f"{o} x{c}" for o, c in counts.items())


def _row(name: str, budget: str, report: AutoReport) -> str:
    err = 100 * (report.measured_peak_bytes - report.predicted_peak_bytes) / max(
        1, report.predicted_peak_bytes)
    return (
        f"| `{name}` | {budget} ({_mib(report.budget_bytes)}) | {_plan_text(report)} | "
        f"{_mib(report.baseline_peak_bytes)} | {_mib(report.predicted_peak_bytes)} | "
        f"{_mib(report.measured_peak_bytes)} ({err:+.2f}%) | "
        f"{'yes' if report.within_budget else 'NO'} | "
        f"{'equal' if report.grads_match else 'DIFFER'}, verify "
        f"{'passed' if report.verify_ok else 'FAILED'} | {0 if report.ok else 1} |"
    )


def _where(name: str, budget: str, report: AutoReport) -> str:
    """Where the predicted and the measured peaks fell, in bytes (printed, not in the md:
    what the notes quote for a prediction off by more than 1%)."""
    return (f"  {name} {budget}: budget {report.budget_bytes}, predicted "
            f"{report.predicted_peak_bytes} ({report.predicted_peak_event}), measured "
            f"{report.measured_peak_bytes} ({report.peak_phase} of {report.peak_module})")


def _stopped(name: str, budget: str, err: Stopped, run: str) -> str:
    reason = str(err).replace("|", "/").replace("\n", " ")
    return f"| `{name}` | {budget} | stopped: {reason} | | | | | | {err.exit_code} | {run} |"


def _at_minimum(target: Any, least: int, kwargs: dict[str, Any]) -> AutoReport:
    """``auto`` at the least budget the first run's profile names; where its own profile
    names a larger one (a profile's fixed bytes can differ from run to run: hf:opt's
    pre_chain_at_return was 262,144 or 524,288 bytes), once more at that one, as a user
    told so by the planning error would."""
    try:
        return auto(target, budget=least, **kwargs)
    except Stopped as err:
        if err.minimum_budget_bytes is None or err.minimum_budget_bytes <= least:
            raise
        print(f"minimum: {err}; once more at {err.minimum_budget_bytes} bytes", flush=True)
        return auto(target, budget=err.minimum_budget_bytes, **kwargs)


def run_model(name: str, repeats: int, run: str) -> tuple[list[str], str]:
    target, options = target_of(name)
    kwargs: dict[str, Any] = {"repeats": repeats, "verify_steps": 2, "threads": 1,
                              "options": options}
    rows: list[str] = []
    first: AutoReport | None = None
    try:
        first = auto(target, budget="75%", **kwargs)
        rows.append(_row(name, "75%", first) + f" {run} |")
        print(_where(name, "75%", first), flush=True)
        assert first.profile is not None
        least = solvers.minimum_budget(problem_from_profile(first.profile))
    except Stopped as err:
        rows.append(_stopped(name, "75%", err, run))
        if err.minimum_budget_bytes is None:
            return rows, ""
        least = err.minimum_budget_bytes
    try:
        last = _at_minimum(target, least, kwargs)
        rows.append(_row(name, "minimum", last) + f" {run} |")
        print(_where(name, "minimum", last), flush=True)
    except Stopped as err:
        rows.append(_stopped(name, f"minimum ({_mib(least)})", err, run))
        last = None
    report = first or last
    if report is None or report.profile is None:
        return rows, ""
    cov = coverage(report.profile)
    chain = (f"| `{name}` | {len(cov.stages)}: `{cov.stages[0]}` .. `{cov.stages[-1]}` | "
             f"{100 * cov.share:.0f}% | {run} |")
    return rows, chain


CHAINS_HEAD = ["| model | stages found | covered | run |", "| --- | --- | --- | --- |"]
RUNS_HEAD = ["| model | budget (MiB) | plan | no checkpointing | predicted | measured | "
             "within budget | gradients | exit | run |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
#: the runs recorded before rows named theirs (the 2026-12-01 run; diffusers-unet rerun)
FIRST_RUN = "R0"


def _name(line: str) -> str | None:
    found = re.match(r"\| `([^`]+)` \|", line)
    return found.group(1) if found else None


NOTES = "## Notes"


def _recorded(path: Path) -> tuple[list[str], dict[str, str], dict[str, list[str]], str]:
    """The runs listed in the md, its rows by model name (a run cell added to the rows
    written before rows carried one) and its notes (from ``## Notes`` on, kept as written)."""
    if not path.exists():
        return [], {}, {}, ""
    runs_list: list[str] = []
    chains: dict[str, str] = {}
    rows: dict[str, list[str]] = {}
    text, _, notes = path.read_text().partition(NOTES)
    for line in text.splitlines():
        if line.startswith("- R"):
            runs_list.append(line)
        name = _name(line)
        if name is None:
            continue
        cells = line.count("|") - 1
        if cells in (3, 9):  # no run cell: the first run's rows
            run = "R1" if name == "diffusers-unet" else FIRST_RUN
            line = f"{line} {run} |"
            cells += 1
        if cells == 4:
            chains[name] = line
        else:
            rows.setdefault(name, []).append(line)
    return runs_list, chains, rows, NOTES + notes if notes else ""


def _write(path: Path, runs_list: list[str], chains: dict[str, str],
           rows: dict[str, list[str]], notes: str) -> str:
    order = [*ALL, *(n for n in {**chains, **rows} if n not in ALL)]
    text = "\n".join([
        "# remat auto on the architectures users bring",
        "",
        "Each model: the stages discovery finds and the share of the activation memory they "
        "cover, then `remat auto` (profile, plan, apply, verify, measure) at 75% of the peak "
        "without checkpointing and at 'minimum', the smallest budget any plan reaches, as "
        "the planning error names it. Peaks in MiB, measured by the live-storage tracker "
        "over a whole training step; one thread. The last column names the run that made "
        "the row:",
        "",
        *runs_list,
        "",
        *CHAINS_HEAD,
        *(chains[n] for n in order if n in chains),
        "",
        *RUNS_HEAD,
        *(line for n in order for line in rows.get(n, [])),
        "",
    ]) + (f"\n{notes.rstrip()}\n" if notes else "")
    path.write_text(text)
    return text


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=ALL)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=str(Path(__file__).with_suffix(".md")))
    args = parser.parse_args(argv)
    default_out = str(Path(__file__).with_suffix(".md"))
    out_flag = "" if args.out == default_out else f" --out {args.out}"
    path = Path(args.out)
    runs_list, chains, rows, notes = _recorded(path)
    if not runs_list and (chains or rows):
        runs_list = [
            f"- {FIRST_RUN}: `{COMMAND} --models resnet convnext encdec unet gpt mlp-hetero "
            "convnet-bn hf:bert hf:t5 hf:gpt_neox hf:mixtral hf:mamba hf:llama "
            "diffusers-unet`; x86_64, 2 cores (shared), torch 2.13.0+cpu, Python 3.11.7, "
            "3 timed steps; 2026-12-01 20:39 UTC, 6 min.",
            f"- R1: `{COMMAND} --models diffusers-unet`; commit 80045e4, 2026-12-03 21:37 UTC "
            "(discovery made the mid block's attention a stage, docs/stages.md rule 5: 20 "
            "stages where R0 found 19).",
        ]
    run = f"R{len(runs_list)}"
    started, commit = time.time(), _commit()
    load = os.getloadavg()[0]
    done: list[str] = []

    def record(minutes_note: str) -> str:
        line = (
            f"- {run}: `{COMMAND} --models {' '.join(args.models)}{out_flag}`; commit "
            f"{commit} (HEAD at the start), "
            f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(started))}; "
            f"{platform.machine()}, {os.cpu_count()} cores shared with other jobs (load "
            f"average {load:.1f} at the start, {os.getloadavg()[0]:.1f} now), torch "
            f"{torch.__version__}, Python {platform.python_version()}, {args.repeats} timed "
            f"steps; {minutes_note}."
        )
        return _write(path, [*runs_list, line], chains, rows, notes)

    for name in args.models:
        t0 = time.time()
        try:
            new_rows, chain = run_model(name, args.repeats, run)
        except ImportError as err:
            new_rows, chain = [f"| `{name}` | skipped: {err} | | | | | | | | {run} |"], ""
        except Exception as err:  # a benchmark records failures, it does not stop at one
            traceback.print_exc()
            failed = f"failed: {type(err).__name__}: {err}".replace("|", "/")
            new_rows, chain = [f"| `{name}` | {failed} | | | | | | | 1 | {run} |"], ""
        chains.pop(name, None)
        if chain:
            chains[name] = chain
        rows[name] = new_rows
        done.append(name)
        print("\n".join(new_rows), f"({time.time() - t0:.0f} s)", flush=True)
        record(f"{len(done)} of {len(args.models)} models done, "
               f"{(time.time() - started) / 60:.0f} min so far")
    print(record(f"{(time.time() - started) / 60:.0f} min"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
