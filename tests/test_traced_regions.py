"""remat.trace_regions: a plan's regions as checkpoint calls a whole-model compile traces."""

from __future__ import annotations

import copy
import re
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import remat
from remat import plans
from remat.core.errors import UsageError
from remat.core.plan_format import Plan, Region
from remat.models import load_model

SMALL_GPT = {"n_layer": 4, "n_embd": 32, "n_head": 2, "block_size": 16, "vocab_size": 64,
             "batch_size": 4}


def _gpt() -> tuple[nn.Module, Any, Any]:
    torch.manual_seed(0)
    return load_model("gpt", **SMALL_GPT)


def _grads(model: nn.Module, batch: Any, loss_fn: Any) -> list[torch.Tensor]:
    torch.manual_seed(1)  # the same dropout draws
    loss_fn(model, batch).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return grads


def _peak(model: nn.Module, batch: Any, loss_fn: Any) -> int:
    from remat.benchmarking.runners import Runner
    from remat.benchmarking.step_measures import by_profiler

    return by_profiler(Runner(model, batch, loss_fn, "sgd")).peak_bytes


def _untouched(model: nn.Module) -> bool:
    return not remat.applied(model) and not any("forward" in m.__dict__
                                                for m in model.modules())


def test_traced_regions_keep_gradients_and_lower_the_peak_eager() -> None:
    model, batch, loss_fn = _gpt()
    twin = copy.deepcopy(model)
    plan = plans.uniform_groups(twin, 2)  # [0,2) [2,4)
    handle = remat.trace_regions(twin, plan, batch, loss_fn)
    for got, want in zip(_grads(twin, batch, loss_fn), _grads(model, batch, loss_fn),
                         strict=True):
        torch.testing.assert_close(got, want)
    twin.eval()  # eval runs every stage as written
    with torch.no_grad():
        torch.testing.assert_close(loss_fn(twin, batch), loss_fn(model.eval(), batch))
    twin.train()
    model.train()
    assert _peak(twin, batch, loss_fn) < 0.8 * _peak(model, batch, loss_fn)
    handle.remove()
    assert _untouched(twin)
    with pytest.raises(UsageError, match="already removed"):
        handle.remove()


def test_traced_regions_compile_into_one_graph_with_eager_gradients() -> None:
    model, batch, loss_fn = _gpt()
    twin = copy.deepcopy(model)
    remat.trace_regions(twin, plans.uniform_groups(twin, 2), batch, loss_fn)
    plain = copy.deepcopy(model)
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    # aot_eager: Dynamo's one graph through AOTAutograd, as inductor gets it, without
    # inductor's compile time (benchmarks/compile_traced.py runs inductor)
    traced = _grads(twin, batch, torch.compile(loss_fn, backend="aot_eager"))
    # no graph break: the regions are inside the one graph
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["graph_break"])
    for got, want in zip(traced, _grads(plain, batch, loss_fn), strict=True):
        torch.testing.assert_close(got, want)


class _Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
                                    for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return x


class _WithNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8))
                                      for _ in range(3)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x)


def _loss(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return m(x).pow(2).mean()


def _plan(model: nn.Module, regions: list[tuple[int, int]], option: str = "keep") -> Plan:
    stages = tuple(f"blocks.{i}" for i in range(len(model.blocks)))  # type: ignore[arg-type]
    return Plan(stages=stages, regions=tuple(Region(a, b) for a, b in regions),
                options=(option,) * len(stages))


def test_one_stage_regions_take_a_loop_with_code_between_its_stages() -> None:
    # x = x + block(x): a region of one block has nothing between stages inside it
    torch.manual_seed(0)
    model, x = _Residual(), torch.randn(4, 8)
    twin = copy.deepcopy(model)
    remat.trace_regions(twin, _plan(twin, [(0, 1), (1, 2), (2, 3), (3, 4)]), x, _loss)
    with _Count() as traced:
        got = _grads(twin, x, _loss)
    with _Count() as plain:
        want = _grads(model, x, _loss)
    # each block's first Linear again in backward (the rebuild stops once it has the
    # GELU's input and output the block saved: torch's checkpoint early stop)
    assert (plain.addmm, traced.addmm) == (8, 12)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b)


class _Count(TorchDispatchMode):
    """How many ``addmm`` ops ran (a Linear's forward)."""

    addmm = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        if func is torch.ops.aten.addmm.default:
            self.addmm += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize(("model", "regions", "option", "message"), [
    (_Residual(), [(0, 2)], "keep", "input is not stage 'blocks.0'.s output"),
    (_WithNorm(), [(0, 2)], "keep", "holds BatchNorm1d, whose running statistics"),
    (_Residual(), [(0, 2)], "selective:save-nothing", "traced regions run keep only"),
    (_Residual(), [(0, 4), (0, 2)], "keep", "must not nest"),
])
def test_what_traced_regions_cannot_run_is_refused_and_the_model_untouched(
        model: nn.Module, regions: list[tuple[int, int]], option: str, message: str) -> None:
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(UsageError, match=message):
        remat.trace_regions(model, _plan(model, regions, option), torch.randn(2, 8), _loss)
    assert _untouched(model)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    with pytest.raises(UsageError, match="no remat plan is applied"):
        remat.remove(model)


def _encdec() -> tuple[nn.Module, Any, Any]:
    torch.manual_seed(0)
    return load_model("encdec", n_encoder_layers=3, n_decoder_layers=2, d_model=16, d_ff=32,
                      src_len=8, tgt_len=8, batch_size=2)


def test_an_encoder_stack_of_a_t5_shaped_model_takes_a_traced_region() -> None:
    model, batch, loss_fn = _encdec()
    twin = copy.deepcopy(model)
    stages = ("encoder.block.0", "encoder.block.1", "encoder.block.2")
    plan = Plan(stages=stages, regions=(Region(0, 3),), options=("keep",) * 3)
    remat.trace_regions(twin, plan, batch, loss_fn)
    for got, want in zip(_grads(twin, batch, loss_fn), _grads(model, batch, loss_fn),
                         strict=True):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize(("stages", "message"), [
    (("encoder.block.2", "decoder.block.0"), "not consecutive entries of one container"),
    (("decoder.block.0", "decoder.block.1"), "takes or returns more than one tensor"),
    (("encoder", "decoder"), "not an entry of an nn.ModuleList or nn.Sequential"),
])
def test_regions_a_traced_checkpoint_cannot_run_back_to_back_are_refused(
        stages: tuple[str, str], message: str) -> None:
    model, batch, loss_fn = _encdec()
    plan = Plan(stages=stages, regions=(Region(0, 2),), options=("keep", "keep"))
    with pytest.raises(UsageError, match=message):
        remat.trace_regions(model, plan, batch, loss_fn)
    assert _untouched(model)


def test_a_traced_model_takes_no_other_plan_until_removed() -> None:
    model, batch, loss_fn = _gpt()
    remat.trace_regions(model, plans.uniform_groups(model, 2), batch, loss_fn)
    with pytest.raises(UsageError, match="already applied"):
        remat.apply(model, plans.per_stage(model))
    remat.remove(model)
    assert _untouched(model)


def test_the_checking_forward_leaves_the_random_stream_and_names_a_failing_loss() -> None:
    from remat.core.errors import UserCodeError

    model, batch, loss_fn = _gpt()  # dropout 0.1: the checking forward draws
    torch.manual_seed(7)
    remat.trace_regions(model, plans.uniform_groups(model, 2), batch, loss_fn)
    after = torch.rand(3)
    torch.manual_seed(7)
    torch.testing.assert_close(after, torch.rand(3))
    remat.remove(model)

    def broken(m: nn.Module, b: Any) -> torch.Tensor:
        raise RuntimeError("bad batch")

    with pytest.raises(UserCodeError,
                       match=re.escape("loss_fn(model, batch) raised RuntimeError: bad batch")):
        remat.trace_regions(model, plans.uniform_groups(model, 2), batch, broken)
    assert _untouched(model)


def test_a_plan_made_for_another_model_is_refused() -> None:
    model, batch, loss_fn = _gpt()
    torch.manual_seed(0)
    wider, _, _ = load_model("gpt", **{**SMALL_GPT, "n_embd": 64})
    with pytest.raises(UsageError, match=re.escape("stage blocks.0 is")):
        remat.trace_regions(model, plans.uniform_groups(wider, 2), batch, loss_fn)
    assert _untouched(model)


def test_what_needs_remats_engine_says_so_on_traced_regions() -> None:
    from remat.runtime.install import applied_stages, installed_hook_ids, observe

    model, batch, loss_fn = _gpt()
    remat.trace_regions(model, plans.uniform_groups(model, 2), batch, loss_fn)
    assert installed_hook_ids(model) == frozenset()
    with pytest.raises(UsageError, match=re.escape("written by remat.trace_regions")):
        applied_stages(model)
    with pytest.raises(UsageError, match=re.escape("written by remat.trace_regions")), \
            observe(model, object()):  # type: ignore[arg-type]
        pass
    remat.remove(model)
    assert _untouched(model)
