"""``remat estimate``: closed-form memory of a segmented chain, before touching a model."""

from __future__ import annotations

import argparse
from typing import Any

from rich.table import Table

import remat.core.theory as theory
from remat.cli.output import add_json_option, console_for, write_json
from remat.core.errors import UsageError
from remat.core.units import format_bytes, parse_size

DEFAULT_LAYERS = 64
DEFAULT_ACT = "32MiB"
# Bounds that keep the optimum quick (O(sqrt n)) and every figure a finite float.
MAX_LAYERS = 10**9
MAX_BYTES = 10**30


def add_parser(sub: Any, name: str) -> None:
    p = sub.add_parser(
        name,
        help="closed-form activation memory of a chain checkpointed every k stages",
        description=(
            "Activation memory of an n-stage chain checkpointed with segment length k: "
            "ceil(n/k) kept boundaries plus one segment rebuilt at a time. With no options, "
            "64 stages of 32MiB each."
        ),
    )
    p.add_argument("--layers", "-n", type=int, default=None, help="number of stages n (default 64)")
    p.add_argument(
        "--act",
        default=None,
        help="bytes one stage keeps, boundary and inside alike (default 32MiB)",
    )
    p.add_argument("--boundary", default=None, help="bytes of one kept boundary (A_b)")
    p.add_argument("--inner", default=None, help="bytes one stage keeps while rebuilt (A_i)")
    p.add_argument(
        "--transformer",
        metavar="B,S,H,Hq,BYTES",
        default=None,
        help=(
            "size a transformer layer: batch, sequence, hidden, query heads, bytes per element; "
            "the boundary is one hidden state, the inside the Korthikanti et al. estimate"
        ),
    )
    p.add_argument(
        "--flash",
        action="store_true",
        help="with --transformer: attention kernels that keep no S^2 probability matrix",
    )
    p.add_argument(
        "--k", default=None, help="segment lengths to list, comma-separated (e.g. 3,5,8)"
    )
    add_json_option(p)
    p.set_defaults(run=run)


def _parse_ks(text: str, n: int) -> list[int]:
    ks: list[int] = []
    for part in text.split(","):
        try:
            k = int(part)
        except ValueError:
            raise UsageError(
                f"--k {text!r} is not a list of whole numbers; write e.g. --k 2,4,8"
            ) from None
        if k < 1:
            raise UsageError(f"--k {k} is below 1; a segment holds at least one stage")
        ks.append(k)
    return sorted(set(ks))


def _check_size(nbytes: int, what: str) -> None:
    if nbytes > MAX_BYTES:
        raise UsageError(
            f"{what} is {nbytes:.3g} bytes, above the {MAX_BYTES:.0e} this estimate takes; "
            "give a smaller size"
        )


def _sizes(args: argparse.Namespace) -> tuple[int, int, dict[str, Any] | None]:
    """The (boundary, inner) bytes the options ask for, and transformer sizing if given."""
    if args.transformer is not None:
        if args.act or args.boundary or args.inner:
            raise UsageError(
                "--transformer sets the sizes itself; drop --act, --boundary and --inner"
            )
        parts = args.transformer.split(",")
        try:
            b, s, h, hq, nbytes = (int(x) for x in parts)
        except ValueError:
            raise UsageError(
                f"--transformer {args.transformer!r} needs five whole numbers B,S,H,Hq,BYTES, "
                "e.g. 1,4096,4096,32,2"
            ) from None
        sizes = theory.transformer_sizes(b, s, h, hq, nbytes)
        inner = sizes.layer_bytes_flash if args.flash else sizes.layer_bytes
        info = {
            "batch": b,
            "seq": s,
            "hidden": h,
            "q_heads": hq,
            "elem_bytes": nbytes,
            "flash": bool(args.flash),
            "hidden_state_bytes": sizes.hidden_state_bytes,
            "attention_matrix_bytes": sizes.attention_matrix_bytes,
            "layer_bytes": sizes.layer_bytes,
            "layer_bytes_flash": sizes.layer_bytes_flash,
        }
        _check_size(sizes.hidden_state_bytes, "--transformer's hidden state")
        _check_size(inner, "--transformer's layer estimate")
        return sizes.hidden_state_bytes, inner, info
    if args.flash:
        raise UsageError("--flash only applies with --transformer B,S,H,Hq,BYTES")
    if args.act is not None and (args.boundary is not None or args.inner is not None):
        raise UsageError("give either --act or --boundary/--inner, not both")
    act = parse_size(args.act if args.act is not None else DEFAULT_ACT, what="--act")
    boundary = parse_size(args.boundary, what="--boundary") if args.boundary is not None else act
    inner = parse_size(args.inner, what="--inner") if args.inner is not None else act
    _check_size(boundary, "--boundary" if args.boundary is not None else "--act")
    _check_size(inner, "--inner" if args.inner is not None else "--act")
    if inner == 0:
        raise UsageError(
            "the inner size is zero, so there is nothing to checkpoint; give a size above 0"
        )
    return boundary, inner, None


def estimate(args: argparse.Namespace) -> dict[str, Any]:
    n = DEFAULT_LAYERS if args.layers is None else args.layers
    if n < 1:
        raise UsageError(f"--layers {n} is below 1; a chain has at least one stage")
    if n > MAX_LAYERS:
        raise UsageError(
            f"--layers {n} is above {MAX_LAYERS}, the most this estimate takes; give fewer "
            "stages"
        )
    boundary, inner, transformer = _sizes(args)
    ks = _parse_ks(args.k, n) if args.k is not None else None
    rows = theory.segment_table(n, boundary, inner, ks)
    best = theory.best_segment_length(n, boundary, inner)
    k_cont, total_cont = theory.continuous_optimum(n, boundary, inner)
    result: dict[str, Any] = {
        "n": n,
        "act_bytes": inner,
        "boundary_bytes": boundary,
        "no_checkpoint_bytes": n * inner,
        "optimal_k": best.k,
        "optimal_total_bytes": best.total_bytes,
        "continuous_k": k_cont,
        "continuous_total_bytes": total_cont,
        "rows": [
            {
                "k": r.k,
                "segments": r.segments,
                "boundary_bytes": r.boundary_bytes,
                "local_bytes": r.local_bytes,
                "total_bytes": r.total_bytes,
            }
            for r in rows
        ],
    }
    if transformer is not None:
        result["transformer"] = transformer
    return result


def run(args: argparse.Namespace) -> int:
    result = estimate(args)
    console = console_for(args.json)
    n, inner, boundary = result["n"], result["act_bytes"], result["boundary_bytes"]
    uniform = inner == boundary
    head = (
        f"{n} stages of {format_bytes(inner)}"
        if uniform
        else (f"{n} stages, boundary {format_bytes(boundary)}, inside {format_bytes(inner)}")
    )
    if "transformer" in result:
        t = result["transformer"]
        console.print(
            f"transformer B={t['batch']} S={t['seq']} H={t['hidden']} Hq={t['q_heads']} "
            f"{t['elem_bytes']}-byte elements: "
            f"hidden state {format_bytes(t['hidden_state_bytes'])}, "
            f"one attention matrix {format_bytes(t['attention_matrix_bytes'])}, "
            f"layer estimate {format_bytes(t['layer_bytes'])} "
            f"({format_bytes(t['layer_bytes_flash'])} without the S^2 term)"
        )
    table = Table(title=f"Checkpoint every k stages: {head}")
    for col in ("k", "segments", "boundaries", "one segment", "total", "vs none"):
        table.add_column(col, justify="right")
    none_bytes = result["no_checkpoint_bytes"]
    for r in result["rows"]:
        mark = " *" if r["k"] == result["optimal_k"] else ""
        table.add_row(
            f"{r['k']}{mark}",
            str(r["segments"]),
            format_bytes(r["boundary_bytes"]),
            format_bytes(r["local_bytes"]),
            format_bytes(r["total_bytes"]),
            f"{r['total_bytes'] / none_bytes:.1%}" if none_bytes else "-",
        )
    console.print(table)
    copies = ""
    if uniform and inner:
        copies = f" ({result['optimal_total_bytes'] // inner} copies)"
    console.print(
        f"optimum: k={result['optimal_k']}, {format_bytes(result['optimal_total_bytes'])}{copies} "
        f"against {format_bytes(none_bytes)} with no checkpointing; "
        f"continuous optimum k*={result['continuous_k']:.2f}, "
        f"{format_bytes(result['continuous_total_bytes'])}"
    )
    write_json(result, args.json)
    return 0
