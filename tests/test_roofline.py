"""Times without the hardware: the op counter, the roofline, the device table, calibrate."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
import torch
from torch import nn

import remat
from remat.cli import main
from remat.core.devices import BUILT_IN, Device, get_device
from remat.core.errors import UsageError
from remat.core.roofline import OUTSIDE, Work, conv_class, conv_rate, seconds
from remat.measure import malloc
from remat.models import load_model
from remat.profiling import device_calibration
from remat.profiling.device_calibration import STEADY, calibrate_device
from remat.profiling.op_costs import count_work


def _mlp(n: int = 64, d: int = 32) -> tuple[nn.Module, torch.Tensor, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
    return model, torch.randn(n, d), lambda m, x: m(x).square().mean()


def test_a_stage_is_charged_its_matmul_flops_forward_and_backward() -> None:
    n, d = 64, 32
    model, batch, loss_fn = _mlp(n, d)
    before = [p.detach().clone() for p in model.parameters()]
    work = count_work(model, batch, loss_fn, ["0", "2"])
    fwd = work.work("0", "forward", ["matmul"])
    bwd = work.work("0", "backward", ["matmul"])
    assert fwd.total_flops == 2 * n * d * 4 * d  # x @ W^T
    # the input needs no gradient: only the weight's, one matmul of the same size
    assert bwd.total_flops == 2 * n * d * 4 * d
    assert work.work("2", "backward", ["matmul"]).total_flops == 2 * 2 * n * 4 * d * d
    assert work.work("0", "forward", ["other"]).total_flops == 0
    assert work.work(OUTSIDE, "optimizer").ops > 0  # AdamW's step is counted apart
    # counting leaves the model as it was
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))
    assert all(p.grad is None for p in model.parameters())


def test_the_optimizer_is_counted_as_a_steady_step_and_a_given_one_left_as_it_was() -> None:
    model, batch, loss_fn = _mlp()
    params = list(model.parameters())
    work = count_work(model, batch, loss_fn, ["0", "2"])
    ops = {op for (s, phase, _, op) in work.table if phase == "optimizer"}
    # the first step's state (AdamW's two moments, zeroed) is made before counting
    assert "zeros_like" not in ops and "lerp_" in ops
    opt = torch.optim.AdamW(params, lr=0.1)
    loss_fn(model, batch).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    moments = [opt.state[p]["exp_avg"].clone() for p in params]
    steps = [float(opt.state[p]["step"]) for p in params]
    count_work(model, batch, loss_fn, ["0", "2"], opt)
    assert [float(opt.state[p]["step"]) for p in params] == steps
    assert all(torch.equal(opt.state[p]["exp_avg"], m)
               for p, m in zip(params, moments, strict=True))


class _Sines(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.n = n

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(self.n):
            x = torch.sin(x)
        return x


def test_a_rebuild_is_priced_as_its_forward_and_a_pack_per_saved_tensor() -> None:
    def packs(n: int) -> int:
        model = nn.Sequential(nn.Linear(8, 8), _Sines(n))
        work = count_work(model, torch.randn(4, 8), lambda m, x: m(x).sum(), ["0", "1"])
        return work.packs["1"]

    assert packs(7) - packs(2) == 5  # each sine saves its input, once, in forward
    model = nn.Sequential(nn.Linear(8, 8), _Sines(3))
    work = count_work(model, torch.randn(4, 8), lambda m, x: m(x).sum(), ["0", "1"])
    assert BUILT_IN["h100-sxm"].pack_seconds() == 0  # unmeasured there
    unpriced = Device("here", 1 << 30, {"float32": 1e12}, 1e11, False, False)
    here = Device("here", 1 << 30, {"float32": 1e12}, 1e11, False, False,
                  extra={"pack_s": 1e-5})
    assert work.rebuild("1", here) == pytest.approx(work.rebuild("1", unpriced)
                                                    + work.packs["1"] * 1e-5)


def test_a_rebuild_is_priced_without_the_ops_after_its_last_saved_tensor() -> None:
    # the block's last matmul: autograd packs its inputs before it runs, and the rebuild
    # stops at that pack (torch's early stop), so the matmul never runs again
    block = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 8))
    model = nn.Sequential(block, nn.Linear(8, 1))
    work = count_work(model, torch.randn(32, 8), lambda m, x: m(x).sum(), ["0", "1"])
    tail = work.tails["0"]
    assert [(op, w.ops) for (_, _, _, op), w in tail.items()] == [("addmm", 1)]
    assert next(iter(tail.values())).total_flops == 2 * 32 * 64 * 8
    device = BUILT_IN["h100-sxm"]
    skipped = seconds(next(iter(tail.values())), device, "addmm", "forward")
    assert work.rebuild("0", device) == pytest.approx(work.forward("0", device) - skipped)
    # a stage whose last op saves its output (a ReLU after the matmul) skips nothing
    model = nn.Sequential(nn.Sequential(nn.Linear(8, 8), nn.ReLU()), nn.Linear(8, 1))
    work = count_work(model, torch.randn(32, 8), lambda m, x: m(x).sum(), ["0", "1"])
    assert not work.tails["0"]


def test_the_roofline_adds_compute_memory_and_calls() -> None:
    device = Device("x", 1 << 30, {"float32": 1e12}, 1e11, False, False,
                    flop_efficiency=0.5, bandwidth_efficiency=0.25, op_overhead_s=1e-6)
    work = Work({"float32": 10**12}, bytes=10**11, ops=3)
    assert seconds(work, device) == pytest.approx(2.0 + 4.0 + 3e-6)
    # a rate measured for the op replaces the generic one
    measured = Device("y", 1 << 30, {"float32": 1e12}, 1e11, False, False,
                      extra={"op_rates": {"mm": [1e-12, 0.0]}, "call_s": {"forward": 2e-6}})
    assert seconds(work, measured, "mm", "forward") == pytest.approx(1.0 + 6e-6)
    # a kernel's own cost per call (a small convolution's) comes on top of the call's
    kernel = Device("z", 1 << 30, {"float32": 1e12}, 1e11, False, False,
                    extra={"op_rates": {"mm": [1e-12, 0.0, 5e-6]}, "call_s": {"forward": 2e-6}})
    assert seconds(work, kernel, "mm", "forward") == pytest.approx(1.0 + 3 * 7e-6)


def test_a_convolution_is_priced_at_the_rate_of_its_shape_class() -> None:
    # rows: kernel, stride, in and out channels, output side, forward FLOP/s
    grid = [[3, 1, 16, 16, 8, 2e10], [3, 1, 16, 16, 32, 8e10], [1, 2, 16, 32, 16, 1e9]]
    # halfway (in logarithms) between two shapes of its class: their geometric mean; a
    # shape of another class (the 1x1 stride-2 row) takes no part
    assert conv_rate(grid, (3, 1, 16, 16, 16)) == pytest.approx(4e10)
    assert conv_rate(grid, (1, 2, 16, 32, 16)) == pytest.approx(1e9)
    assert conv_rate(grid, (1, 1, 16, 16, 16)) is None  # no row of its class
    device = Device("c", 1 << 30, {"float32": 1e12}, 1e11, False, False,
                    extra={"conv_rates": grid, "call_s": {"forward": 2e-6, "backward": 2e-6},
                           "op_rates": {"convolution": [1e-12, 0.0, 0.0],
                                        "convolution_backward": [2e-12, 0.0, 0.0]}})
    shaped = Work({conv_class("float32", 1, 2, 16, 32, 16): 10**9}, bytes=10**8, ops=2)
    assert seconds(shaped, device, "convolution", "forward") == pytest.approx(1.0 + 4e-6)
    # a backward convolution keeps the rate fitted inside the reference network
    assert seconds(shaped, device, "convolution_backward", "backward") == pytest.approx(
        2e-3 + 4e-6)
    # a convolution without a class (grouped, transposed) keeps the op's measured rate
    plain = Work({"float32": 10**9}, bytes=10**8, ops=2)
    assert seconds(plain, device, "convolution", "forward") == pytest.approx(1e-3 + 4e-6)


def test_the_counter_charges_a_convolution_under_its_shape_class() -> None:
    model = nn.Sequential(nn.Sequential(nn.Conv2d(3, 8, 3, stride=2, padding=1),
                                        nn.Conv2d(8, 8, 3, padding=1, groups=8)),
                          nn.Flatten(), nn.Linear(8 * 8 * 8, 1))
    work = count_work(model, torch.randn(2, 3, 16, 16), lambda m, x: m(x).sum(), ["0"])
    forward = work.work("0", "forward").flops
    backward = work.work("0", "backward").flops
    key = conv_class("float32", 3, 2, 3, 8, 8)
    assert forward[key] == 2 * 2 * 8 * 8 * 8 * 3 * 9  # the dense convolution, classed
    assert backward[key] > 0
    assert forward["float32"] == 2 * 2 * 8 * 8 * 8 * 1 * 9  # the grouped one is not


def test_the_device_table_takes_entries_from_the_users_file(tmp_path: Any,
                                                            monkeypatch: Any) -> None:
    path = tmp_path / "devices.json"
    monkeypatch.setenv("REMAT_DEVICES", str(path))
    assert get_device("h100-sxm") == BUILT_IN["h100-sxm"]
    path.write_text(json.dumps({"h100-sxm": {**BUILT_IN["a100-80gb"].to_dict()}}))
    assert get_device("h100-sxm").memory_bytes == BUILT_IN["a100-80gb"].memory_bytes
    path.write_text(json.dumps({"bad": {"memory_bytes": 1}}))
    with pytest.raises(UsageError, match="device 'bad' is missing"):
        get_device("bad")
    path.write_text("{not json")
    with pytest.raises(UsageError, match="cannot read the device table"):
        get_device("cpu")


def test_calibrate_writes_an_entry_that_prices_its_own_model(tmp_path: Any, capsys: Any,
                                                             monkeypatch: Any) -> None:
    # it measures under the allocator remat profile and bench use (--malloc, keep)
    modes: list[str] = []
    monkeypatch.setattr(malloc, "set_malloc", lambda mode: modes.append(mode) or mode)
    out = tmp_path / "devices.json"
    sets = ["--set=n_layer=2", "--set=n_embd=64", "--set=n_head=2", "--set=block_size=64"]
    assert main(["calibrate", "--model", "gpt", *sets, "--repeats", "2", "--name", "here",
                 "--out", str(out)]) == 0
    assert "wrote here to" in capsys.readouterr().out
    entry = Device.from_dict("here", json.loads(out.read_text())["here"])
    assert modes == ["keep"] and entry.notes.endswith("; keep")
    assert entry.op_rates and entry.extra["conv_flops_per_s"] > 0
    # gpt runs no convolution: its rates come from the reference network, per FLOP and
    # per call (every rate now has its kernel's per-call part)
    conv = entry.op_rates["convolution"]
    assert conv[0] > 0 and conv[2] >= 0 and entry.op_rates["convolution_backward"][0] > 0
    assert "native_batch_norm" in entry.op_rates and len(entry.op_rates["mm"]) == 3
    assert entry.call_seconds("forward") > 0
    assert entry.pack_seconds() > 0  # a rebuild's cost per saved tensor, measured
    # the convolution grid: both kernel and both stride classes, each with its rate
    classes = {(int(r[0]), int(r[1])) for r in entry.extra["conv_rates"]}
    assert classes == {(1, 1), (1, 2), (3, 1), (3, 2)}
    assert all(len(r) == 6 and r[5] > 0 for r in entry.extra["conv_rates"])
    assert main(["calibrate", "--model", "gpt", *sets, "--repeats", "0"]) == 2


def test_a_fake_profile_for_a_device_has_the_rooflines_times() -> None:
    with remat.fake_mode():
        model, batch, loss_fn = load_model("gpt", n_layer=2, n_embd=64, n_head=2,
                                           block_size=64)
    profile = remat.profile(model, batch, loss_fn, fake=True, device="h100-sxm")
    assert profile.times_estimated and profile.device == "h100-sxm"
    for s in profile.stages:
        assert 0 < s.fwd_s < s.bwd_s  # backward does twice the matmul work
        # the block's last matmul and what follows it run after its last saved tensor:
        # a rebuild (torch's early stop) does not run them again
        assert 0 < s.rebuild_s < s.fwd_s
        # saving the matmuls' outputs leaves less to replay than saving nothing
        assert s.extra_bwd_s["selective:save-matmuls"] < s.extra_bwd_s["selective:save-nothing"]
    # identical stages, identical estimates; the step adds up its parts
    assert len({s.fwd_s for s in profile.stages}) == 1
    assert profile.step_s == pytest.approx(
        profile.outside_chain_s + sum(s.fwd_s + s.bwd_s for s in profile.stages))
    assert remat.Profile.from_dict(profile.to_dict()).times_estimated
    plain = remat.profile(model, batch, loss_fn, fake=True)
    assert not plain.times_estimated


class _Dozing(nn.Module):
    """A block whose forward also waits 5 ms outside any op: the machine's slow spell
    while the calibration profiles its model."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(0.005)
        return torch.tanh(self.lin(x))


def test_a_slow_spell_while_calibrating_is_not_read_as_a_calls_cost() -> None:
    # Note [A call's cost is the tiny op's]: read as the model's stage times less its
    # kernels, the sleep (5 ms over a block's few calls) became a call's cost
    torch.manual_seed(0)
    model = nn.Sequential(_Dozing(), _Dozing())
    device, _ = calibrate_device(model, torch.randn(4, 16), lambda m, b: m(b).sum(), repeats=1)
    for phase in ("forward", "backward"):
        assert 0 < device.call_seconds(phase) < 100e-6


def test_a_calibration_whose_own_stages_disagree_is_retaken_until_steady(
        monkeypatch: Any) -> None:
    # Note [A calibration is retaken while its model's own stages disagree]: the sleep is
    # in the measured stage times and in no op's kernel, so the fit never settles
    torch.manual_seed(0)
    model = nn.Sequential(_Dozing(), _Dozing())
    _, report = calibrate_device(model, torch.randn(4, 16), lambda m, b: m(b).sum(),
                                 repeats=1, attempts=2)
    assert report["median_abs_error"] > STEADY and report["attempts"] == 2
    # it keeps the closest of its tries, and stops at the first steady one
    fits = iter([0.3, 0.12, 0.2, 0.05, 0.01])
    monkeypatch.setattr(device_calibration, "_fit", lambda *a: {
        "stages": 2, "rows": 4, "median_abs_error": next(fits), "max_abs_error": 1.0})
    _, report = calibrate_device(model, torch.randn(4, 16), lambda m, b: m(b).sum(),
                                 repeats=1, attempts=3)
    assert report["attempts"] == 3 and report["median_abs_error"] == 0.12
    _, report = calibrate_device(model, torch.randn(4, 16), lambda m, b: m(b).sum(),
                                 repeats=1, attempts=3)
    assert report["attempts"] == 1 and report["median_abs_error"] == 0.05
