"""Shape-aware profiles and plan sets on a real model (issue 48, items 1 and 2): bytes fitted
exactly at a shape never profiled for the fit, every shape of the range run within the
budget by its bucket's plan with gradients equal to the plain model's, batches outside
the range refused or run conservatively as the user chose."""

from __future__ import annotations

import copy
import dataclasses
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import remat
from remat.core.errors import UsageError
from remat.core.plan_format import Plan
from remat.core.plan_set import PlanSet, plan_set
from remat.core.shape_profiles import at_shape
from remat.measure.step import measure_step
from remat.models.gpt import gpt
from remat.profiling.shaped import (
    batch_axes,
    check_fit,
    infer_shapes,
    interleaved_steps,
    profile_shapes,
    resize,
)

RANGE = "seq=8..64:8"


def _model() -> tuple[torch.nn.Module, Any, Any]:
    return gpt(n_layer=4, n_embd=32, n_head=2, block_size=64, vocab_size=64, batch_size=2,
               seed=0)


def _cut(batch: Any, seq: int) -> Any:
    return tuple(t[:, :seq] for t in batch)


@pytest.fixture(scope="module")
def ranged() -> Any:
    model, batch, loss = _model()
    prof = profile_shapes(model, _cut(batch, 16), loss, RANGE, repeats=1)
    return model, batch, loss, prof


def test_a_range_profile_is_exact_in_bytes_at_a_shape_the_fit_never_saw(ranged: Any) -> None:
    model, batch, loss, prof = ranged
    fit = prof.shapes
    assert fit is not None and str(fit.dims) == RANGE and fit.inputs == {"seq": (0, 1, 0)}
    seen = {*fit.byte_points, *fit.time_points}
    assert (40,) not in seen and 40 not in fit.rungs[0]
    report = check_fit(model, _cut(batch, 16), loss, prof, (40,), repeats=1)
    assert report.byte_fields > 50
    assert report.polynomial_exact, report.bytes_wrong
    # the peaks (no-save and selective forward transients) are maxima of per-op totals,
    # each fitted exactly (Note [Maxima fitted term by term]): every figure to the byte
    assert "stages.0.nosave_transient_bytes" in fit.envelopes
    assert report.bytes_wrong == ()
    assert report.stepped_under == 0, report.bytes_wrong  # a stepped figure is never under
    # the polynomial figures are most of them: sums of tensors, exact at every shape
    assert len(report.stepped) < report.byte_fields / 2


def test_a_regions_own_time_is_fitted_across_the_range_not_kept_from_the_largest_shape(
        ranged: Any) -> None:
    # it grows with the shape (1.6 ms a region at seq 32, 14.6 ms at 1024 on hf:llama):
    # the largest shape's, kept for the whole range, priced short batches' regions 3x over
    prof = ranged[3]
    fit = prof.shapes
    assert "region_overhead_s" in fit.times
    for seq in (8, 24, 40):
        assert at_shape(prof, (seq,)).region_overhead_s == pytest.approx(
            fit.time_value("region_overhead_s", (seq,)), rel=1e-12)


def test_the_profile_at_a_profiled_shape_is_the_profile_itself(ranged: Any) -> None:
    prof = ranged[3]
    assert at_shape(prof, prof.shapes.at) is prof
    with pytest.raises(UsageError, match="not in the profile's range"):
        at_shape(prof, (12,))


def test_every_shape_runs_within_the_budget_and_trains_as_the_plain_model(
        ranged: Any, tmp_path: Path) -> None:
    model, batch, loss, prof = ranged
    plain = copy.deepcopy(model)
    chosen = plan_set(prof, "80%")
    assert chosen.shapes == 8 and len(chosen.plans) >= 2  # short batches run a cheaper plan
    assert chosen.slowest_ratio <= 1.02
    path = tmp_path / "set.json"
    chosen.save(path)
    loaded = PlanSet.load(path)
    assert loaded.to_dict() == chosen.to_dict()
    with pytest.raises(UsageError, match="is a plan set, not a plan"):
        Plan.load(path)
    handle = remat.apply(model, loaded)
    try:
        ran = set()
        for seq in range(8, 65, 8):
            k = loaded.choose((seq,))
            step = measure_step(model, _cut(batch, seq), loss,
                                torch.optim.SGD(model.parameters(), lr=0.0))
            assert handle.running == loaded.plans[k]
            ran.add(k)
            assert step.peak_bytes <= loaded.budget_bytes, seq
            for m in (model, plain):
                m.zero_grad(set_to_none=True)
                torch.manual_seed(seq)
                loss(m, _cut(batch, seq)).backward()
            for (name, p), q in zip(model.named_parameters(), plain.parameters(), strict=True):
                assert torch.equal(p.grad, q.grad), (seq, name)
        assert len(ran) == len(loaded.plans)
    finally:
        handle.remove()


def test_a_batch_between_the_steps_runs_the_plan_above_it_within_the_budget(
        ranged: Any, tmp_path: Path) -> None:
    """Note [Shapes between the steps]: a collator without pad_to_multiple_of gives lengths
    off the range's step; each was priced under the plan of the lattice shape above it, and
    its measured step stays within the budget and the plan's predicted peak."""
    model, batch, loss, prof = ranged
    chosen = plan_set(prof, "80%")
    assert chosen.between == 57 - 8  # every whole length from 8 to 64 off the step
    assert any("between the steps" in line for line in chosen.describe())
    path = tmp_path / "set.json"
    chosen.save(path)
    assert PlanSet.load(path).between == chosen.between
    older = {k: v for k, v in chosen.to_dict().items() if k != "between"}
    assert PlanSet.from_dict(older).between == 0  # written before: off-step is outside
    handle = remat.apply(model, chosen)
    try:
        for seq in (9, 15, 37, 63):
            k = chosen.choose((seq,))
            assert k == chosen.choose((-(-seq // 8) * 8,)) and k is not None
            step = measure_step(model, _cut(batch, seq), loss,
                                torch.optim.SGD(model.parameters(), lr=0.0))
            assert handle.running == chosen.plans[k]
            assert step.peak_bytes <= chosen.budget_bytes, seq
            assert step.peak_bytes <= chosen.plans[k].predicted_peak_bytes, seq
    finally:
        handle.remove()


def test_two_forwards_of_different_shapes_before_one_backward_rebuild_each_its_own_plan(
        ranged: Any) -> None:
    model, batch, loss, prof = ranged
    model.zero_grad(set_to_none=True)
    plain = copy.deepcopy(model)
    stages = prof.stage_names
    # the long shape's plan nests a region and runs a selective stage inside it: its
    # rebuild must open the child and the option of the plan that ran its forward, not
    # of the short shape's plan (no regions) that the later forward switched to
    nested = Plan(stages, regions=((0, 4), (0, 2)),
                  options=("keep", "selective:save-matmuls", "keep", "keep"))
    chosen = PlanSet(dims=prof.shapes.dims, plans=(Plan(stages), nested),
                     buckets=((((8, 56),),), (((64, 64),),)), inputs={"seq": (0, 1)},
                     budget_bytes=1 << 40, conservative=1)
    handle = remat.apply(model, chosen)
    try:
        for m in (model, plain):  # gradient accumulation over two shapes
            torch.manual_seed(3)
            (loss(m, _cut(batch, 64)) + loss(m, _cut(batch, 8))).backward()
        assert handle.rebuilds == 2
        for (name, p), q in zip(model.named_parameters(), plain.parameters(), strict=True):
            assert torch.equal(p.grad, q.grad), name
    finally:
        handle.remove()


def test_a_batch_outside_the_range_is_refused_or_runs_the_least_memory_plan(
        ranged: Any) -> None:
    model, batch, loss, prof = ranged
    chosen = plan_set(prof, "80%")
    remat.apply(model, chosen)
    try:
        with pytest.raises(UsageError, match=r"seq=4 is outside the plan set's range "
                           r"seq=8\.\.64:8, where no plan"):
            loss(model, _cut(batch, 4))
        model.eval()  # eval forwards run no plan: any shape
        with torch.no_grad():
            loss(model, _cut(batch, 4))
        model.train()
    finally:
        remat.remove(model)
    # a set whose shapes between the steps were not priced (Note [Shapes between the steps])
    unpriced = dataclasses.replace(chosen, between=0)
    remat.apply(model, unpriced)
    try:
        with pytest.raises(UsageError, match=r"seq=12 is outside the plan set's range seq=8\.\."
                           r".* \(between its ends, but not on its steps: seq in steps of 8"):
            loss(model, _cut(batch, 12))
    finally:
        remat.remove(model)
    handle = remat.apply(model, chosen, outside="conservative")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loss(model, _cut(batch, 4)).backward()
            loss(model, _cut(batch, 6)).backward()
        said = [w for w in caught if "outside the plan set's range" in str(w.message)]
        assert len(said) == 1  # once
        assert handle.running == chosen.plans[chosen.conservative]
    finally:
        handle.remove()
    with pytest.raises(UsageError, match="outside="):
        remat.apply(model, chosen, outside="ignore")


def test_remove_after_a_plan_set_leaves_no_hook_and_copies_keep_their_own(
        ranged: Any) -> None:
    model, batch, loss, prof = ranged
    hooks = (dict(model._forward_pre_hooks), dict(model._forward_hooks))
    chosen = plan_set(prof, "80%")
    remat.apply(model, chosen)
    twin = copy.deepcopy(model)
    remat.remove(model)
    assert (dict(model._forward_pre_hooks), dict(model._forward_hooks)) == hooks
    assert remat.applied(twin)
    loss(twin, _cut(batch, 64)).backward()  # the copy runs its own plans
    remat.remove(twin)


def test_the_range_is_read_off_real_batches_and_batches_are_resized_along_it() -> None:
    _, batch, _ = _model()
    batches = [_cut(batch, 24), _cut(batch, 64), _cut(batch, 40)]
    dims = infer_shapes(batches)
    assert str(dims) == "seq=24..64:8"
    axes = batch_axes(batch, dims)
    assert axes == {"seq": [(0, 1), (1, 1)]}
    longer = resize(_cut(batch, 16), axes, {"seq": 40})
    assert longer[0].shape == (2, 40) and torch.equal(longer[0][:, 16:32], longer[0][:, :16])
    with pytest.raises(UsageError, match="two or more"):
        infer_shapes([batch])


def test_the_command_line_profiles_a_range_and_plans_a_set_a_model_can_run(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from remat.cli import main

    tiny = ["--model", "gpt", "--set", "n_layer=4", "--set", "n_embd=32", "--set",
            "block_size=64", "--set", "vocab_size=64", "--batch-size", "2"]
    prof, chosen = tmp_path / "p.json", tmp_path / "set.json"
    assert main(["profile", *tiny, "--shapes", RANGE, "--repeats", "1", "--json",
                 str(prof)]) == 0
    said = capsys.readouterr()
    assert "equal the fit's to the byte" in said.out + said.err
    assert main(["plan", "--profile", str(prof), "--budget", "80%", "--json",
                 str(chosen)]) == 0
    said = capsys.readouterr()
    assert "predicted within the budget by the plan" in said.out + said.err
    loaded = PlanSet.load(chosen)
    model, batch, loss = _model()
    remat.apply(model, loaded)
    try:
        loss(model, _cut(batch, 56)).backward()
    finally:
        remat.remove(model)
    assert main(["verify", *tiny, "--plan", str(chosen), "--steps", "1"]) == 0
    said = capsys.readouterr()
    assert "every plan of the set verified at the largest shape of its bucket" in (
        said.out + said.err)
    assert main(["verify", *tiny, "--plan", str(chosen), "--steps", "1",
                 "--no-preserve-rng-state"]) == 1  # dropout masks differ: verify catches it
    assert "verify FAILED" in capsys.readouterr().out
    assert main(["plan", "--profile", str(prof), "--shapes", RANGE, "--budget", "80%"]) == 2
    assert "drop --shapes" in capsys.readouterr().err


def test_auto_over_a_range_measures_each_bucket_within_the_budget_with_equal_gradients(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from remat.cli import main

    tiny = ["--model", "gpt", "--set", "n_layer=3", "--set", "n_embd=32", "--set",
            "block_size=32", "--set", "vocab_size=64", "--batch-size", "2"]
    out = tmp_path / "auto.json"
    assert main(["auto", *tiny, "--shapes", "seq=8..32:8", "--budget", "80%",
                 "--profile-repeats", "1", "--json", str(out)]) == 0
    said = capsys.readouterr()
    assert "every measured step within the budget, gradients equal" in said.out + said.err
    report = json.loads(out.read_text())
    assert report["ok"] and report["rows"]
    budget = report["plan_set"]["budget_bytes"]
    for row in report["rows"]:
        assert row["measured_peak_bytes"] <= budget and row["grads_equal"]
    measured = {tuple(r["shape"]) for r in report["rows"]}
    assert (8,) in measured and (32,) in measured  # the range's ends are buckets' ends


def _next_token(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """A causal LM loss as scripts write it: the model sees all but the last token."""
    logits = model(ids[:, :-1])
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                             ids[:, 1:].reshape(-1))


def test_a_plan_set_follows_a_dimension_the_model_receives_one_shorter() -> None:
    model, (ids, _), _ = _model()
    shifted = torch.cat([ids, ids[:, :1]], dim=1)  # 65 tokens: the model sees up to 64
    prof = profile_shapes(model, shifted[:, :17], _next_token, "seq=9..65:8", repeats=1)
    assert prof.shapes is not None and prof.shapes.inputs == {"seq": (0, 1, -1)}
    chosen = plan_set(prof, "80%")
    assert PlanSet.from_dict(chosen.to_dict()).inputs == chosen.inputs
    handle = remat.apply(model, chosen)
    try:
        for seq in (9, 33, 65):
            step = measure_step(model, shifted[:, :seq], _next_token,
                                torch.optim.SGD(model.parameters(), lr=0.0))
            assert handle.running == chosen.plans[chosen.choose((seq,))], seq
            assert step.peak_bytes <= chosen.budget_bytes, seq
        with pytest.raises(UsageError, match=r"seq=5 is outside the plan set's range"):
            _next_token(model, shifted[:, :5])  # the model sees 4: the batch's 5
    finally:
        handle.remove()


def _drifting(rates: dict[tuple[int, ...], float]) -> Any:
    """An ``interleaved_steps`` that reports ``rates`` (seconds per shape), as if the
    machine had run each shape at that speed beside the others."""
    def steps(model: Any, batches: Any, loss_fn: Any, optimizer: Any = "adamw",
              **_: Any) -> dict[tuple[int, ...], float]:
        assert set(batches) <= set(rates)
        return {shape: rates[shape] for shape in batches}
    return steps


def test_timed_shapes_are_levelled_to_the_ratios_the_interleaved_steps_measured(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # the three timed profiles run tens of seconds apart; the fit must follow the ratios
    # of steps timed side by side (Note [Timed shapes levelled]), whatever each profile saw
    def curve(seq: int) -> float:
        return 1e-3 * (1 + 0.1 * seq + 0.01 * seq * seq)

    monkeypatch.setattr("remat.profiling.shaped.interleaved_steps",
                        _drifting({(s,): curve(s) for s in (8, 16, 24)}))
    model, batch, loss = _model()
    prof = profile_shapes(model, _cut(batch, 8), loss, "seq=8..24:8", repeats=1)
    fit = prof.shapes
    assert fit is not None and fit.at == (24,) and set(fit.time_points) == {(8,), (16,), (24,)}
    anchor = fit.time_value("step_s", (24,))
    assert anchor == pytest.approx(prof.step_s, rel=1e-9)  # the anchor keeps its own time
    for (seq,) in fit.time_points:
        assert fit.time_value("step_s", (seq,)) / anchor == pytest.approx(
            curve(seq) / curve(24), rel=1e-6)


def test_the_check_levels_the_held_out_profiles_against_the_anchor_timed_beside_them(
        ranged: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    model, batch, loss, prof = ranged
    at = prof.shapes.at
    monkeypatch.setattr("remat.profiling.shaped.interleaved_steps",
                        _drifting({at: 0.2, (40,): 0.05}))
    report = check_fit(model, _cut(batch, 16), loss, prof, (40,), repeats=1)
    # levelled: the held-out step is the anchor's profiled step times the side-by-side
    # ratio, whatever the held-out profile itself timed
    assert report.levelled_step_s == pytest.approx(prof.step_s * 0.05 / 0.2, rel=1e-9)
    assert report.step_s != pytest.approx(report.levelled_step_s, rel=1e-6)
    # the verdict's error is the worst over levelled figures, the raw one over the profile's
    assert report.time_error >= abs(report.fitted_step_s / report.levelled_step_s - 1) - 1e-12
    assert report.raw_time_error >= abs(report.fitted_step_s / report.step_s - 1) - 1e-12


def test_interleaved_steps_time_each_shape_and_leave_the_model_as_it_was() -> None:
    model, batch, loss = _model()
    before = copy.deepcopy(model.state_dict())
    rng = torch.get_rng_state()
    model.eval()
    got = interleaved_steps(model, {(8,): _cut(batch, 8), (32,): _cut(batch, 32)}, loss,
                            rounds=2)
    assert set(got) == {(8,), (32,)} and all(t > 0 for t in got.values())
    assert not model.training
    assert torch.equal(torch.get_rng_state(), rng)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


class _Strided(torch.nn.Module):
    """Raw signal in, a stride-5 convolution, then blocks: the frames are
    ``(samples - 10) // 5 + 1``, one polynomial in the samples only on multiples of 5."""

    def __init__(self) -> None:
        super().__init__()
        self.front = torch.nn.Conv1d(1, 16, 10, 5)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(),
                                torch.nn.Linear(64, 16)) for _ in range(3))

    def forward(self, wav: torch.Tensor) -> torch.Tensor:
        x = self.front(wav.unsqueeze(1)).transpose(1, 2)
        for block in self.blocks:
            x = x + block(x)
        return x.square().mean()


def test_shapes_between_the_steps_a_plan_set_cannot_price_are_refused_with_the_reason(
        tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = _Strided()
    prof = profile_shapes(model, torch.randn(2, 20), None, "seq=20..60:20", repeats=1)
    chosen = plan_set(prof, "100%")
    assert chosen.between == 0
    assert "not whole numbers" in chosen.between_refused and "seq=21" in chosen.between_refused
    assert any("between the steps: outside" in line for line in chosen.describe())
    path = tmp_path / "set.json"
    chosen.save(path)
    assert PlanSet.load(path).between_refused == chosen.between_refused
    handle = remat.apply(model, chosen)
    try:
        with pytest.raises(UsageError, match="between the steps are outside: at seq=21"):
            model(torch.randn(2, 23)).backward()
    finally:
        handle.remove()
