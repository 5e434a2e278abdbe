"""remat.verify on recurrent layers: a kernel's workspace that differs from run to run is
no difference in training (issue 49), and a real difference in the same stage still is.

oneDNN's LSTM (``aten.mkldnn_rnn_layer``) hands back a byte workspace whose scratch bytes
hold whatever memory it got; its backward saves it, yet computes equal gradients from
either. Note [What backward reads] in remat/verification/fingerprint.py.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from remat.cli import main
from remat.core.plan_format import Plan, Region
from remat.verification import VerifyReport, verify
from remat.verification.fingerprint import Fingerprint, compare_call, unread_differences
from remat.verification.tolerance import parse_tolerance

pytestmark = pytest.mark.usefixtures("one_thread")

D, T = 32, 16
STAGES = tuple(f"blocks.{i}" for i in range(4))
PER_STAGE = Plan(stages=STAGES, regions=tuple(Region(i, i + 1) for i in range(4)))
ONEDNN = torch.backends.mkldnn.is_available()  # else torch's own LSTM runs: no workspace
WORKSPACE = "aten.mkldnn_rnn_layer.default output 3"


def mean_square(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).square().mean()  # conftest's, here so the command line loads this file


class TanhBlock(nn.Module):
    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x))


class LSTMBlock(nn.Module):
    def __init__(self, d: int = D) -> None:
        super().__init__()
        self.lstm = nn.LSTM(d, d, batch_first=True)
        self.proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, _ = self.lstm(x)
        return x + self.proj(y)


class NoisyLSTMBlock(LSTMBlock):
    """Adds noise from NumPy's generator, which torch's checkpoint does not restore: its
    rebuild feeds the LSTM other values."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        noise = torch.from_numpy(np.random.standard_normal(tuple(x.shape))).to(x.dtype)
        return super().forward(x + 0.1 * noise)


class Stack(nn.Module):
    def __init__(self, blocks: list[nn.Module]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def lstm_stack() -> tuple[nn.Module, torch.Tensor, Any]:
    """Four LSTM blocks over a (batch, seq, feat) tensor, as a factory for the command line."""
    torch.manual_seed(0)
    return Stack([LSTMBlock() for _ in STAGES]), torch.randn(4, T, D), mean_square


def _values(report: VerifyReport) -> Any:
    assert report.value_check is not None
    return report.value_check


def test_an_lstm_stack_verifies_with_its_workspaces_skipped_and_counted() -> None:
    model, x, loss = lstm_stack()
    report = verify(model, x, PER_STAGE, loss, steps=2)
    assert report.check("parameter-gradients").status == "pass"
    assert report.ok, [c.message for c in report.checks if not c.passed]
    values = _values(report)
    assert values.rebuilt_calls == 4 and values.mismatches == ()
    if ONEDNN:  # the workspace is compared and its scratch bytes differed
        assert set(values.skipped_outputs) <= {WORKSPACE}
        if values.outputs_skipped:
            check = report.check("rebuilt-values")
            assert f"{values.outputs_skipped} output(s) skipped: not read by backward" in (
                check.message) and WORKSPACE in check.message


def test_a_real_difference_in_an_lstm_stage_is_still_caught() -> None:
    torch.manual_seed(0)
    blocks = [LSTMBlock(), LSTMBlock(), NoisyLSTMBlock(), LSTMBlock()]
    report = verify(Stack(blocks), torch.randn(4, T, D), PER_STAGE, mean_square, steps=1)
    assert not report.ok and report.check("rebuilt-values").status == "fail"
    first = _values(report).first
    assert first is not None and (first.stage, first.kind) == ("blocks.2", "value")
    assert f"{first.rebuilt_op} output {first.output_index}" != WORKSPACE
    assert [m.stage for m in _values(report).mismatches] == ["blocks.2"]


def test_the_cli_verifies_an_lstm_stack(tmp_path: Path) -> None:
    out = tmp_path / "verify.json"
    assert main(["verify", "--model", f"{__file__}:lstm_stack", "--plan", "per-stage",
                 "--steps", "1", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["ok"] and data["value_check"]["mismatches"] == []
    assert set(data["value_check"]["skipped_outputs"]) <= {WORKSPACE}


@pytest.mark.slow
def test_auto_on_an_lstm_stack_says_verify_passed(tmp_path: Path) -> None:
    out = tmp_path / "auto.json"
    main(["auto", "--model", f"{__file__}:lstm_stack", "--budget", "75%", "--repeats", "2",
          "--profile-repeats", "1", "--verify-steps", "1", "--threads", "1",
          "--out", str(tmp_path / "out"), "--json", str(out)])
    data = json.loads(out.read_text())  # the exit code also weighs the memory prediction
    assert data["grads_match"] and data["verify_ok"], data["verify_detail"]


# ---------------------------------------------------------------------------------------
# The rule itself, on an op whose second output is a workspace that differs every call

_calls = itertools.count()
_defined = itertools.count()


def _setup(ctx: Any, inputs: Any, output: Any) -> None:
    ctx.save_for_backward(output[1])


def _backward(ctx: Any, grad: torch.Tensor, _grad_workspace: Any) -> tuple[Any, None]:
    return grad * 2, None


def workspace_op() -> tuple[Any, str]:
    """A custom op returning ``2 x`` (plus ``drift`` times the call's number) and a
    workspace that differs each call; backward saves the workspace and reads nothing from
    it. The op and its name as fingerprints print it.

    Each test defines its own, under a new name: one defined at import, shared by the
    worker's whole run, twice failed under xdist with torch's "schema_.has_value()
    INTERNAL ASSERT" on its first call (never alone: 150 calls in one process passed),
    which a fresh registration cannot meet.
    """
    name = f"double_with_workspace_{next(_defined)}"

    @torch.library.custom_op(f"remat_test::{name}", mutates_args=())
    def op(x: torch.Tensor, drift: float) -> tuple[torch.Tensor, torch.Tensor]:
        n = float(next(_calls))
        return x * 2 + drift * n, torch.full((8,), n)

    @op.register_fake
    def _(x: torch.Tensor, drift: float) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.empty_like(x), x.new_empty((8,))

    op.register_autograd(_backward, setup_context=_setup)

    def call(x: torch.Tensor, drift: float) -> tuple[torch.Tensor, torch.Tensor]:
        return op(x, drift)  # a plain function: the twins' deepcopy keeps it as it is

    return call, f"remat_test.{name}.default"


class WorkspaceBlock(TanhBlock):
    def __init__(self, op: Any, drift: float = 0.0) -> None:
        super().__init__()
        self.op, self.drift = op, drift

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        doubled, _ = self.op(self.fc(x), self.drift)
        return x + torch.tanh(doubled)


OP = "remat_test.double_with_workspace.default"  # a name for the records made by hand


def test_an_output_no_later_op_reads_is_skipped_and_one_that_is_read_is_compared() -> None:
    op, name = workspace_op()
    torch.manual_seed(0)
    chain = Stack([TanhBlock(), WorkspaceBlock(op), TanhBlock()])
    plan = Plan(stages=STAGES[:3], regions=(Region(0, 3),))
    report = verify(chain, torch.randn(4, 8), plan, mean_square, steps=1)
    assert report.ok, [c.message for c in report.checks if not c.passed]
    values = _values(report)
    assert (values.outputs_skipped, values.skipped_outputs) == (1, (f"{name} output 1",))
    assert "1 output(s) skipped: not read by backward" in report.check("rebuilt-values").message

    torch.manual_seed(0)
    chain = Stack([TanhBlock(), WorkspaceBlock(op, drift=1e-3), TanhBlock()])
    report = verify(chain, torch.randn(4, 8), plan, mean_square, steps=1)
    first = _values(report).first
    assert not report.ok and first is not None
    assert (first.stage, first.rebuilt_op, first.output_index) == ("blocks.1", name, 0)


def _fp(sums: tuple[float, float], read: tuple[bool, ...] | None) -> Fingerprint:
    return Fingerprint(OP, ((2,), (2,)), (torch.float32,) * 2,
                       tuple((s, 1.0, s) for s in sums), read=read)


def test_compare_call_skips_unread_outputs_only() -> None:
    auto = parse_tolerance("auto")
    forward = [_fp((1.0, 1.0), (True, False))]
    workspace = [_fp((1.0, 5.0), None)]
    assert compare_call(forward, workspace, auto) == (None, None)
    assert unread_differences(forward, workspace, auto) == [(0, OP, 1)]
    value = [_fp((2.0, 1.0), None)]
    first, path = compare_call(forward, value, auto)
    assert path is None and first is not None and first.output_index == 0
    assert unread_differences(forward, value, auto) == []
    unknown = [_fp((1.0, 1.0), None)]  # no read flags (a record made by hand): all compared
    assert compare_call(unknown, workspace, auto)[0] is not None
