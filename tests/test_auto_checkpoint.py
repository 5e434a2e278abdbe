"""``remat.auto_checkpoint``: one call in the user's own training script (issue 48, item 3,
single-shape form): profile, plan, apply, the model's weights as they were, and the plan
kept on disk for the next launch (Note [The plan cache] in ``remat.in_script.plan_cache``)."""

from __future__ import annotations

import copy
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import remat
from remat.core.errors import CheckFailed, UsageError
from remat.core.plan_set import PlanSet
from remat.in_script import script_entry
from remat.measure.step import measure_step


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(),
                                 nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


def _model(width: int = 32, depth: int = 6) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*(Block(width) for _ in range(depth)))


def _loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return model(batch).pow(2).mean()


BATCH = torch.randn(256, 32)


def test_one_call_applies_a_plan_within_the_budget_and_leaves_the_weights(
    tmp_path: Path,
) -> None:
    model = _model()
    plain = copy.deepcopy(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    done = remat.auto_checkpoint(model, "60%", batch=BATCH, loss_fn=_loss, cache=tmp_path)
    assert done.active and remat.applied(model)
    assert done.report.source == "profiled"
    assert done.plan.regions or any(not o.is_keep for o in done.plan.parsed_options)
    assert "no plan cached" in (done.report.why or "")
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), f"{key} changed"
    # the user's own loop: the planned step fits the budget and trains as the plain model
    step = measure_step(model, BATCH, _loss, torch.optim.SGD(model.parameters(), lr=0.0))
    assert done.plan.budget_bytes is not None
    assert step.peak_bytes <= done.plan.budget_bytes
    for m in (model, plain):
        m.zero_grad(set_to_none=True)
        _loss(m, BATCH).backward()
    for (name, p), q in zip(model.named_parameters(), plain.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), name
    assert "regions" in str(done.report)
    done.remove()
    assert not remat.applied(model)


def test_a_second_launch_applies_the_cached_plan_without_profiling(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    first = remat.auto_checkpoint(_model(), "60%", batch=BATCH, loss_fn=_loss, cache=tmp_path)

    def no_profile(*args: object, **kwargs: object) -> None:
        raise AssertionError("a cached plan must apply without profiling")

    monkeypatch.setattr(script_entry, "profile", no_profile)
    model = _model()  # the next launch builds the model again
    began = time.perf_counter()
    again = remat.auto_checkpoint(model, "60%", batch=BATCH.clone(), loss_fn=_loss,
                                  cache=tmp_path)
    assert time.perf_counter() - began < 1.0
    assert again.report.source == "cache" and again.report.why is None
    assert again.plan == first.plan
    assert remat.applied(model)


@pytest.mark.parametrize("change, said", [
    ("batch", "the batch's shapes or dtypes changed"),
    ("model", "the model's parameters or buffers"),
])
def test_a_changed_batch_or_model_plans_again_and_says_why(
    change: str, said: str, tmp_path: Path,
) -> None:
    remat.auto_checkpoint(_model(), "60%", batch=BATCH, loss_fn=_loss, cache=tmp_path)
    model = _model(depth=7) if change == "model" else _model()
    batch = torch.randn(512, 32) if change == "batch" else BATCH
    again = remat.auto_checkpoint(model, "60%", batch=batch, loss_fn=_loss, cache=tmp_path)
    assert again.report.source == "profiled"
    assert said in (again.report.why or ""), again.report.why
    # the entry now holds the new plan: a third launch takes it from the cache
    model = _model(depth=7) if change == "model" else _model()
    third = remat.auto_checkpoint(model, "60%", batch=batch, loss_fn=_loss, cache=tmp_path)
    assert third.report.source == "cache"


def test_the_cache_can_be_switched_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REMAT_CACHE", "off")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    done = remat.auto_checkpoint(_model(), "60%", batch=BATCH, loss_fn=_loss)
    assert done.report.cache_path is None
    assert done.report.why == "the plan cache is off"
    assert not any(tmp_path.rglob("*.json"))
    monkeypatch.setenv("REMAT_CACHE", str(tmp_path / "here"))
    done.remove()
    done = remat.auto_checkpoint(_model(), "60%", batch=BATCH, loss_fn=_loss)
    assert done.report.cache_path is not None
    assert done.report.cache_path.parent == tmp_path / "here"


def test_an_unreadable_entry_is_planned_again(tmp_path: Path) -> None:
    done = remat.auto_checkpoint(_model(), "60%", batch=BATCH, loss_fn=_loss, cache=tmp_path)
    assert done.report.cache_path is not None
    done.report.cache_path.write_bytes(b"\xff{ not json")
    again = remat.auto_checkpoint(_model(), "60%", batch=BATCH, loss_fn=_loss, cache=tmp_path)
    assert again.report.source == "profiled"
    assert again.report.why == "the cached entry was unreadable"


def test_no_plan_fits_leaves_the_model_as_it_was(tmp_path: Path) -> None:
    model = _model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckFailed, match="no plan fits"):
        remat.auto_checkpoint(model, "64KiB", batch=BATCH, loss_fn=_loss, cache=tmp_path)
    assert not remat.applied(model)
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key
    assert not any(tmp_path.rglob("*.json"))


@pytest.mark.parametrize("kwargs, said", [
    (dict(budget=None), "not a budget"),
    (dict(budget=True), "not a budget"),
    (dict(budget="12 parsecs"), "budget"),
    (dict(optimizer="adam"), "unknown"),
    (dict(batch=None), "give batch="),
    (dict(stages="0,1"), "not a list of module paths"),
    (dict(cache=3), "not a folder"),
    (dict(reserve_bytes=-1), "reserve_bytes=-1 must be a whole number"),
])
def test_bad_input_is_a_usage_error_before_any_work(kwargs: dict, said: str) -> None:
    model = _model()
    args = {"budget": "60%", "batch": BATCH, "loss_fn": _loss, "cache": False, **kwargs}
    with pytest.raises(UsageError, match=said):
        remat.auto_checkpoint(model, args.pop("budget"), **args)
    assert not remat.applied(model)


def test_a_transformers_model_trains_on_its_own_loss(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    from remat.models import load_model

    model, batch, _ = load_model("hf:llama", num_hidden_layers=3, hidden_size=32,
                                 intermediate_size=64, num_attention_heads=2,
                                 num_key_value_heads=2, batch_size=2)
    done = remat.auto_checkpoint(model, "70%", batch=batch, cache=tmp_path)
    assert done.plan.regions or any(not o.is_keep for o in done.plan.parsed_options)
    loss = model(**batch).loss
    loss.backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


class _Tokens(nn.Module):
    """A tiny sequence model: the sequence axis varies, attention keeps s * s."""

    def __init__(self, width: int = 16, depth: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, width)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(width, 2, 4 * width, dropout=0.0, batch_first=True)
            for _ in range(depth))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return x


def _token_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return model(batch).pow(2).mean()


def test_batches_of_several_shapes_give_a_plan_set_cached_for_the_next_launch(
    tmp_path: Path,
) -> None:
    torch.manual_seed(0)
    model = _Tokens()
    batches = [torch.randint(0, 32, (4, s)) for s in (16, 64, 40)]
    done = remat.auto_checkpoint(model, "85%", batches=batches, loss_fn=_token_loss,
                                 cache=tmp_path, repeats=1)
    assert isinstance(done.plan, PlanSet) and str(done.plan.dims) == "seq=16..64:8"
    assert done.report.buckets and "seq=" in str(done.report)
    # the first line says it is a plan set, and where its regions and overhead are read
    first = str(done.report).splitlines()[0]
    assert f"plan set of {len(done.plan.plans)} plans" in first
    assert "at its largest shape (seq=64)" in first
    for seq in (16, 24, 64):  # every shape of the range within the budget
        step = measure_step(model, torch.randint(0, 32, (4, seq)), _token_loss,
                            torch.optim.SGD(model.parameters(), lr=0.0))
        assert step.peak_bytes <= done.plan.budget_bytes, seq
    with pytest.raises(remat.UsageError, match="outside the plan set's range"):
        _token_loss(model, torch.randint(0, 32, (4, 72)))
    done.remove()
    again = remat.auto_checkpoint(model, "85%", batches=batches, loss_fn=_token_loss,
                                  cache=tmp_path)
    assert again.report.source == "cache" and again.report.seconds < 1.0
    assert again.plan.to_dict() == done.plan.to_dict()
    again.remove()
    wider = remat.auto_checkpoint(model, "85%", shapes="seq=16..72:8", batch=batches[0],
                                  loss_fn=_token_loss, cache=tmp_path, repeats=1)
    assert wider.report.source == "profiled"
    assert "the range of batch shapes changed (seq=16..64:8 -> seq=16..72:8)" in (
        wider.report.why or "")
    wider.remove()


def test_on_cpu_the_allocator_keeps_freed_memory_before_the_profile_and_the_report_says_so(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[str] = []
    profile = script_entry.profile

    def recorded_malloc(mode: str) -> str:
        calls.append(f"malloc {mode}")
        return "glibc, freed memory kept (test)"

    def recorded_profile(*args: object, **kwargs: object) -> object:
        calls.append("profile")
        return profile(*args, **kwargs)

    monkeypatch.setattr(script_entry, "set_malloc", recorded_malloc)
    monkeypatch.setattr(script_entry, "profile", recorded_profile)
    done = remat.auto_checkpoint(_model(depth=3), "60%", batch=BATCH, loss_fn=_loss,
                                 cache=False, repeats=1)
    assert calls == ["malloc keep", "profile"]
    assert done.report.allocator == "glibc, freed memory kept (test)"
    assert "C allocator: glibc, freed memory kept (test)" in str(done.report)
    calls.clear()
    done.remove()
    done = remat.auto_checkpoint(_model(depth=3), "60%", batch=BATCH, loss_fn=_loss,
                                 cache=False, repeats=1, malloc="system")
    assert calls == ["malloc system", "profile"]


def test_an_unknown_allocator_mode_is_refused_before_anything_runs(tmp_path: Path) -> None:
    model = _model(depth=3)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(UsageError, match="malloc='fast' is not one of keep, system"):
        remat.auto_checkpoint(model, "60%", batch=BATCH, loss_fn=_loss, cache=tmp_path,
                              malloc="fast")
    assert not remat.applied(model) and not list(tmp_path.iterdir())
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key
