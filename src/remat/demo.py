"""Four worked examples of activation checkpointing, each computed and checked at run time.

``remat demo`` runs them: the memory table of a segmented chain (closed form against a
step-by-step simulation), the hand-derived gradients of a two-layer MLP (against
autograd), a hand-written checkpoint schedule on a pure function chain (against stored
activations and finite differences), and dropout (a rebuild that draws another mask
gives another gradient).  Each check can be handed a fault so a test can watch it fail.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import CheckpointError, checkpoint

import remat.core.theory as theory
from remat.core.errors import UsageError
from remat.core.units import format_bytes, parse_size

__all__ = [
    "DemoCheck",
    "all_passed",
    "check_checkpointed_chain",
    "check_dropout",
    "check_memory_table",
    "check_mlp_gradients",
    "mlp_hand_gradients",
    "run_all",
    "simulate_segment_peak",
]

SegmentFormula = Callable[[int, int, int], theory.SegmentRow]
HandGradients = Callable[[Tensor, Tensor, Tensor, Tensor], dict[str, Tensor]]


@dataclass(frozen=True)
class DemoCheck:
    """One worked example: its name, whether it passed, a one-line summary, its numbers."""

    name: str
    passed: bool
    summary: str
    details: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Ledger:
    """Which tensors a schedule holds, by name, and the most it ever held at once."""

    live: set[str] = field(default_factory=set)
    peak: int = 0

    def hold(self, name: str) -> None:
        if name in self.live:
            raise UsageError(f"{name} is already held; drop it before holding it again")
        self.live.add(name)
        self.peak = max(self.peak, len(self.live))

    def drop(self, name: str) -> None:
        self.live.remove(name)


# --------------------------------------------------------------------------- memory-table

MEMORY_N = 64
MEMORY_STAGE = "32MiB"
MEMORY_KS = (1, 2, 4, 8, 16, 32, 64)
# Chains whose segment length does not divide n, where ceil(n/k) and a short last segment
# matter; every k of these is simulated too.
MEMORY_EXTRA_CHAINS = (10,)
EXPECTED_BEST_K = 8
EXPECTED_BEST_COPIES = 16
EXPECTED_BEST = "512MiB"
EXPECTED_NO_CHECKPOINT = "2GiB"


def simulate_segment_peak(n: int, k: int, *, release_boundaries: bool = False) -> int:
    """Peak live activation copies of an ``n``-stage chain checkpointed every ``k`` stages.

    Forward (no grad) keeps only the segment inputs x0, xk, x2k, ...; other outputs live
    until the next stage has used them.  Backward rebuilds one segment at a time, last to
    first: each rebuilt stage keeps one copy until backward passes through it.  With
    ``release_boundaries`` a segment input is freed once its segment's backward is done
    (what autograd does); without, the inputs stay until the whole backward ends.
    """
    ledger = Ledger()
    ledger.hold("x0")
    for i in range(1, n + 1):
        ledger.hold(f"x{i}")
        if (i - 1) % k != 0:  # x_{i-1} was a passing output, not a segment input
            ledger.drop(f"x{i - 1}")
    ledger.drop(f"x{n}")  # the loss has read the output; its gradient does not need it
    for start in reversed(range(0, n, k)):
        stop = min(start + k, n)
        for i in range(start + 1, stop + 1):
            ledger.hold(f"r{i}")
        for i in range(stop, start, -1):
            ledger.drop(f"r{i}")
        if release_boundaries:
            ledger.drop(f"x{start}")
    return ledger.peak


def check_memory_table(formula: SegmentFormula = theory.segment_row) -> DemoCheck:
    """The segment memory formula against the simulation, and its optimum for n=64, A=32MiB.

    The formula counts every boundary alive while the longest segment is rebuilt, so it
    must equal the simulation that keeps boundaries to the end of backward, for every k.
    Freeing each boundary after its segment can only lower the peak: the formula must
    bound that simulation too (one copy under it when the last segment is shorter).
    """
    n, a = MEMORY_N, parse_size(MEMORY_STAGE)
    cases = [(n, k) for k in range(1, n + 1)]
    cases += [(m, k) for m in MEMORY_EXTRA_CHAINS for k in range(1, m + 3)]
    compared = [_compare_peak(formula, m, k, a) for m, k in cases]
    mismatches = [c for c in compared if c["simulated_copies"] != c["formula_copies"]]
    over_bound = [c for c in compared if c["released_copies"] > c["formula_copies"]]
    table = [formula(n, k, a) for k in MEMORY_KS]
    best = min(table, key=lambda r: (r.total_bytes, r.k))
    headline = {
        "best_k": best.k,
        "best_copies": best.total_bytes // a,
        "best_bytes": best.total_bytes,
        "best_simulated_k": min(MEMORY_KS, key=lambda k: (simulate_segment_peak(n, k), k)),
        "no_checkpoint_bytes": n * a,
    }
    expected = {
        "best_k": EXPECTED_BEST_K,
        "best_copies": EXPECTED_BEST_COPIES,
        "best_bytes": parse_size(EXPECTED_BEST),
        "best_simulated_k": EXPECTED_BEST_K,
        "no_checkpoint_bytes": parse_size(EXPECTED_NO_CHECKPOINT),
    }
    passed = not mismatches and not over_bound and headline == expected
    verdict = "=" if not mismatches else f"!= ({len(mismatches)} differ)"
    summary = (
        f"n={n}, A={format_bytes(a)}: simulated peak {verdict} formula for {len(cases)} (n, k)"
        f" incl. n=10,k=4 and n=64,k=7; best k={best.k} keeps {best.total_bytes // a} copies"
        f" = {format_bytes(best.total_bytes)} vs {format_bytes(n * a)} without checkpointing"
    )
    details = {
        "n": n,
        "stage_bytes": a,
        "rows": [_table_row(row, a) for row in table],
        "cases_checked": len(cases),
        "mismatches": mismatches,
        "released_over_bound": over_bound,
        "not_dividing": [c for c in compared if (c["n"], c["k"]) in ((10, 4), (64, 7))],
        "headline": headline,
        "expected": expected,
    }
    return DemoCheck("memory-table", passed, summary, details)


def _compare_peak(formula: SegmentFormula, n: int, k: int, a: int) -> dict[str, int]:
    return {
        "n": n,
        "k": k,
        "formula_copies": formula(n, k, a).total_bytes // a,
        "simulated_copies": simulate_segment_peak(n, k),
        "released_copies": simulate_segment_peak(n, k, release_boundaries=True),
    }


def _table_row(row: theory.SegmentRow, a: int) -> dict[str, int]:
    return {
        "k": row.k,
        "segments": row.segments,
        "boundary_bytes": row.boundary_bytes,
        "local_bytes": row.local_bytes,
        "total_bytes": row.total_bytes,
        "total_copies": row.total_bytes // a,
    }


# --------------------------------------------------------------------------- mlp-gradients

MLP_SHAPES = {"B": 4, "H": 5, "D": 6, "O": 3}


def mlp_hand_gradients(x: Tensor, w1: Tensor, w2: Tensor, g: Tensor) -> dict[str, Tensor]:
    """Backward of ``Y = tanh(X W1) W2`` by hand, given ``G = dL/dY``."""
    z = x @ w1
    a = torch.tanh(z)
    d_a = g @ w2.T
    d_z = d_a * (1 - a * a)  # tanh' = 1 - tanh^2
    return {"W1": x.T @ d_z, "W2": a.T @ g, "X": d_z @ w1.T}


def check_mlp_gradients(hand: HandGradients = mlp_hand_gradients, *, seed: int = 0) -> DemoCheck:
    """Hand-derived gradients of a bias-free two-layer tanh MLP against autograd (float64)."""
    gen = torch.Generator().manual_seed(seed)
    b, h, d, o = (MLP_SHAPES[key] for key in "BHDO")
    x, w1, w2, g_up = (
        torch.randn(*shape, generator=gen, dtype=torch.float64)
        for shape in ((b, h), (h, d), (d, o), (b, o))
    )
    leaves = {"X": x.requires_grad_(), "W1": w1.requires_grad_(), "W2": w2.requires_grad_()}
    loss = (torch.tanh(x @ w1) @ w2 * g_up).sum()  # dL/dY = g_up
    auto = dict(zip(leaves, torch.autograd.grad(loss, list(leaves.values())), strict=True))
    with torch.no_grad():
        by_hand = hand(x, w1, w2, g_up)
    errors = {name: _max_abs(by_hand[name], auto[name]) for name in leaves}
    close = {name: _close(by_hand[name], auto[name]) for name in leaves}
    passed = all(close.values())
    worst = max(errors.values())
    summary = (
        f"X {b}x{h}, W1 {h}x{d}, W2 {d}x{o}, tanh, float64: hand dW1, dW2, dX "
        f"{'match' if passed else 'DIFFER from'} autograd, max |diff| = {worst:.2e}"
    )
    details = {"shapes": dict(MLP_SHAPES), "max_abs_error": errors, "close": close}
    return DemoCheck("mlp-gradients", passed, summary, details)


def _max_abs(a: Tensor, b: Tensor) -> float:
    return float((a.detach() - b.detach()).abs().max())


def _close(a: Tensor, b: Tensor, rtol: float | None = None, atol: float | None = None) -> bool:
    """``torch.testing.assert_close`` as a predicate (its float64 defaults unless given)."""
    try:
        torch.testing.assert_close(a.detach(), b.detach(), rtol=rtol, atol=atol)
    except AssertionError:
        return False
    return True


# --------------------------------------------------------------------------- checkpointed-chain

CHAIN_LAYERS = 12
CHAIN_REGION = 4
CHAIN_WIDTH = 5
FD_STEP = 1e-6


@dataclass
class _Chain:
    """``f_i(x) = tanh(w_i * x + b_i)`` elementwise, counting every evaluation by phase."""

    weights: Tensor
    biases: Tensor
    calls: dict[str, int] = field(default_factory=dict)

    def layer(self, i: int, x: Tensor, phase: str) -> Tensor:
        self.calls[phase] = self.calls.get(phase, 0) + 1
        return torch.tanh(self.weights[i] * x + self.biases[i])

    def run(self, x: Tensor, phase: str) -> Tensor:
        for i in range(len(self.weights)):
            x = self.layer(i, x, phase)
        return x


def _checkpointed_input_grad(
    chain: _Chain, x0: Tensor, ledger: Ledger, rebuild_offset: int
) -> Tensor:
    """Gradient of ``sum(chain(x0))`` by x0, keeping only the region inputs through forward."""
    n, size = CHAIN_LAYERS, CHAIN_REGION
    kept: list[Tensor] = []
    with torch.no_grad():
        x = x0
        for i in range(n):
            if i % size == 0:
                kept.append(x)
            y = chain.layer(i, x, "forward")
            ledger.hold(f"x{i + 1}")
            if i % size != 0:
                ledger.drop(f"x{i}")  # a passing output dies once the next layer has read it
            x = y
        ledger.drop(f"x{n}")  # sum's gradient is all ones; the output itself is not needed
    grad = torch.ones_like(x)  # d sum(y) / dy
    for r in reversed(range(len(kept))):
        start = kept[max(r - rebuild_offset, 0)].detach().requires_grad_()
        h = start
        for i in range(r * size, (r + 1) * size):
            h = chain.layer(i, h, "rebuild")
            ledger.hold(f"r{i + 1}")
        (grad,) = torch.autograd.grad(h, start, grad_outputs=grad)
        for i in range(r * size, (r + 1) * size):
            ledger.drop(f"r{i + 1}")
        ledger.drop(f"x{r * size}")
    return grad


def _finite_difference_grad(chain: _Chain, x0: Tensor) -> Tensor:
    grad = torch.empty_like(x0)
    with torch.no_grad():
        for j in range(x0.numel()):
            step = torch.zeros_like(x0)
            step[j] = FD_STEP
            up = chain.run(x0 + step, "finite-difference").sum()
            down = chain.run(x0 - step, "finite-difference").sum()
            grad[j] = (up - down) / (2 * FD_STEP)
    return grad


def check_checkpointed_chain(*, rebuild_offset: int = 0, seed: int = 0) -> DemoCheck:
    """A 12-layer chain in 3 regions of 4, checkpointed by hand, against two references.

    ``rebuild_offset`` > 0 is a fault: region r is rebuilt from the input of region
    ``r - rebuild_offset`` (clamped at 0), the wrong boundary.
    """
    if rebuild_offset < 0:
        raise UsageError(f"rebuild_offset={rebuild_offset} must be 0 or more")
    gen = torch.Generator().manual_seed(seed)
    weights = 0.5 + torch.rand(CHAIN_LAYERS, CHAIN_WIDTH, generator=gen, dtype=torch.float64)
    biases = torch.randn(CHAIN_LAYERS, CHAIN_WIDTH, generator=gen, dtype=torch.float64) * 0.3
    chain = _Chain(weights, biases)
    x0 = torch.randn(CHAIN_WIDTH, generator=gen, dtype=torch.float64)
    regions = CHAIN_LAYERS // CHAIN_REGION

    ledger = Ledger()
    ledger.hold("x0")
    grad_ckpt = _checkpointed_input_grad(chain, x0, ledger, rebuild_offset)
    counts = dict(chain.calls)

    x_leaf = x0.clone().requires_grad_()
    (grad_stored,) = torch.autograd.grad(chain.run(x_leaf, "stored").sum(), x_leaf)
    grad_fd = _finite_difference_grad(chain, x0)

    err_stored = _max_abs(grad_ckpt, grad_stored)
    err_fd = _max_abs(grad_ckpt, grad_fd)
    matches_stored = _close(grad_ckpt, grad_stored)
    matches_fd = _close(grad_ckpt, grad_fd, rtol=1e-6, atol=1e-8)
    bound = regions + CHAIN_REGION
    counts_ok = counts == {"forward": CHAIN_LAYERS, "rebuild": CHAIN_LAYERS}
    passed = matches_stored and matches_fd and counts_ok and ledger.peak == bound
    summary = (
        f"{CHAIN_LAYERS} layers in {regions} regions of {CHAIN_REGION}: input grad vs stored "
        f"{err_stored:.1e}, vs finite diff {err_fd:.1e}; evaluations {counts.get('forward', 0)}"
        f" forward + {counts.get('rebuild', 0)} rebuild; peak live tensors {ledger.peak}"
        f" (bound {regions} boundaries + {CHAIN_REGION} intermediates = {bound})"
    )
    details = {
        "layers": CHAIN_LAYERS,
        "region": CHAIN_REGION,
        "width": CHAIN_WIDTH,
        "rebuild_offset": rebuild_offset,
        "max_abs_error_vs_stored": err_stored,
        "max_abs_error_vs_finite_difference": err_fd,
        "matches_stored": matches_stored,
        "matches_finite_difference": matches_fd,
        "evaluations": counts,
        "peak_live_tensors": ledger.peak,
        "live_tensor_bound": bound,
        "input_grad": grad_ckpt.tolist(),
    }
    return DemoCheck("checkpointed-chain", passed, summary, details)


# --------------------------------------------------------------------------- dropout

DROPOUT_SEED = 1234


def _scalar_dropout_example() -> dict[str, float]:
    """Inverted dropout ``Y = W X D / p`` with ``W = X = D = 1, p = 1/2`` and a wrong rebuild."""
    p = 0.5
    w = torch.tensor(1.0, dtype=torch.float64, requires_grad=True)
    x = torch.tensor(1.0, dtype=torch.float64)
    mask = torch.tensor(1.0, dtype=torch.float64)
    other_mask = torch.tensor(0.0, dtype=torch.float64)
    y = w * x * mask / p
    loss = y * y / 2
    (grad,) = torch.autograd.grad(loss, w, retain_graph=True)
    (d_loss_d_y,) = torch.autograd.grad(loss, y)
    # The wrong rebuild: the saved upstream gradient meets a local derivative from D'.
    rebuilt = w * x * other_mask / p
    (wrong,) = torch.autograd.grad(rebuilt, w, grad_outputs=d_loss_d_y)
    return {
        "Y": y.item(),
        "L": loss.item(),
        "dL_dW": grad.item(),
        "dL_dW_rebuilt_D0": wrong.item(),
    }


def _dropout_run(preserve_rng_state: bool | None) -> tuple[float, list[Tensor]]:
    """Loss and gradients (parameters, then input) of Linear -> Dropout -> Linear, seeded.

    ``None`` runs without checkpointing; otherwise the block is checkpointed with that flag.
    """
    torch.manual_seed(DROPOUT_SEED)
    net = nn.Sequential(
        nn.Linear(6, 16, dtype=torch.float64),
        nn.Dropout(p=0.5),
        nn.Linear(16, 3, dtype=torch.float64),
    ).train()
    x = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    if preserve_rng_state is None:
        out = net(x)
    else:
        out = checkpoint(net, x, use_reentrant=False, preserve_rng_state=preserve_rng_state)
    loss = out.square().sum()
    torch.rand(1)  # advance the global RNG between forward and backward
    loss.backward()
    grads = [p.grad for p in net.parameters()] + [x.grad]
    return loss.item(), [g for g in grads if g is not None]


def _grad_diff(a: list[Tensor], b: list[Tensor]) -> float:
    return max(_max_abs(u, v) for u, v in zip(a, b, strict=True))


def check_dropout(*, preserve_rng_state: bool = True) -> DemoCheck:
    """A rebuild must replay the same dropout mask, or the gradient is another computation's.

    ``preserve_rng_state`` is for the run that should match; passing False is the fault.
    """
    scalar = _scalar_dropout_example()
    scalar_ok = scalar == {"Y": 2.0, "L": 2.0, "dL_dW": 4.0, "dL_dW_rebuilt_D0": 0.0}
    error = None
    with torch.random.fork_rng(devices=[]):
        loss_plain, grads_plain = _dropout_run(None)
        try:
            loss_kept, grads_kept = _dropout_run(preserve_rng_state)
            loss_lost, grads_lost = _dropout_run(False)
        except CheckpointError as err:
            error = str(err)
    if error is not None:
        return DemoCheck(
            "dropout", False, f"checkpoint raised CheckpointError: {error}", {"error": error}
        )
    diff_kept = _grad_diff(grads_plain, grads_kept)
    diff_lost = _grad_diff(grads_plain, grads_lost)
    kept_matches = all(_close(a, b) for a, b in zip(grads_plain, grads_kept, strict=True))
    lost_differs = not all(_close(a, b) for a, b in zip(grads_plain, grads_lost, strict=True))
    same_loss = loss_plain == loss_kept == loss_lost
    passed = scalar_ok and kept_matches and lost_differs and same_loss
    summary = (
        f"p=1/2, W=X=D=1: Y={scalar['Y']:g}, dL/dW={scalar['dL_dW']:g}, rebuilt with D'=0: "
        f"{scalar['dL_dW_rebuilt_D0']:g}; nn.Dropout, max |grad - uncheckpointed grad|: "
        f"preserve_rng_state={preserve_rng_state} {diff_kept:.1e}, =False with the RNG "
        f"advanced before backward {diff_lost:.1e}; loss {'equal' if same_loss else 'differs'}"
    )
    details = {
        "scalar": scalar,
        "scalar_ok": scalar_ok,
        "preserve_rng_state": preserve_rng_state,
        "loss": {"plain": loss_plain, "preserved": loss_kept, "unpreserved": loss_lost},
        "max_abs_grad_diff_preserved": diff_kept,
        "max_abs_grad_diff_unpreserved": diff_lost,
        "preserved_matches": kept_matches,
        "unpreserved_differs": lost_differs,
        "checkpoint_error": None,
    }
    return DemoCheck("dropout", passed, summary, details)


# --------------------------------------------------------------------------- all

CHECKS: tuple[tuple[str, Callable[[], DemoCheck]], ...] = (
    ("memory-table", check_memory_table),
    ("mlp-gradients", check_mlp_gradients),
    ("checkpointed-chain", check_checkpointed_chain),
    ("dropout", check_dropout),
)


def run_all() -> list[DemoCheck]:
    """Run the four checks; the caller's global RNG state is left as it was."""
    results = []
    with torch.random.fork_rng(devices=[]):
        for name, check in CHECKS:
            try:
                results.append(check())
            except Exception as err:  # a demo that crashes is a failed check, not a traceback
                message = f"{type(err).__name__}: {err}"
                results.append(DemoCheck(name, False, f"raised {message}", {"error": message}))
    return results


def all_passed(checks: list[DemoCheck]) -> bool:
    return bool(checks) and all(c.passed for c in checks)
