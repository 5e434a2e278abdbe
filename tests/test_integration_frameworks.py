"""remat inside accelerate, Lightning and torchtitan (issue 48, item 4).

For each framework, on tiny models: every training step's measured peak (remat's
live-storage tracker, parameters, buffers, gradients, optimizer state and the batch
counted from the start) stays within the budget; the losses equal the framework's own run
without checkpointing from the same initial state, bit for bit; and the plan really runs
(regions planned and rebuilt in backward).
"""

from __future__ import annotations

import gc
import json
import os
import re
import sys
import types
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import remat
from remat.core.errors import UsageError
from remat.measure.tracker import LiveMemoryTracker, iter_tensors

pytestmark = pytest.mark.usefixtures("one_thread")

WIDTH, DEPTH, ROWS, STEPS = 32, 6, 256, 3
BUDGET = "50%"


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(),
                                 nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


class Net(nn.Module):
    """An input layer, a chain of blocks, a head: the blocks are the stages."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(WIDTH, WIDTH)
        self.blocks = nn.Sequential(*(Block(WIDTH) for _ in range(DEPTH)))
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.inp(x)))


def _net() -> Net:
    torch.manual_seed(0)
    return Net()


def _batches(n: int = STEPS, rows: int = ROWS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(rows, WIDTH, generator=g), torch.randn(rows, 1, generator=g))
            for _ in range(n)]


def _loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


@contextmanager
def _tracked(model: nn.Module, optimizer: torch.optim.Optimizer, batch: Any,
             peaks: list[int]) -> Iterator[None]:
    """Track one training step: parameters, buffers, gradients, optimizer state and the
    batch counted from the start; its peak appended to ``peaks``."""
    gc.collect()
    tracker = LiveMemoryTracker(device=torch.device("cpu"))
    tracker.register_existing(model)
    tracker.register_existing(optimizer)
    tracker.register_existing(list(iter_tensors(batch)))
    tracker.watch(model)
    tracker.watch(optimizer)
    with tracker:
        yield
    peaks.append(tracker.report().peak_bytes)


def _fits(peaks: list[int], done: Any) -> None:
    budget = done.plan.budget_bytes
    assert budget is not None and peaks
    assert max(peaks) <= budget, f"step peaks {peaks} over the budget {budget}"


@contextmanager
def _counting(model: nn.Module, calls: list[int]) -> Iterator[None]:
    """Count the forward calls of ``model``'s leaf modules into ``calls[0]``: a plan that
    checkpoints runs some of them again in backward (regions and selective options)."""
    def count(*_: Any) -> None:
        calls[0] += 1

    hooks = [m.register_forward_pre_hook(count) for m in model.modules()
             if not list(m.children())]
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()


def _runs(done: Any, model: nn.Module, calls: int, plain_calls: int) -> None:
    """The plan checkpoints, is applied, and recomputes in the training steps: more
    leaf-module calls than the run without it, and region rebuilds where it has regions
    (the planner picks regions or selective options by the measured times)."""
    assert done.plan.regions or any(not o.is_keep for o in done.plan.parsed_options), (
        "the plan checkpoints nothing: the budget is too loose to test")
    assert remat.applied(model)
    assert calls > plain_calls, (calls, plain_calls)
    if done.plan.regions:
        assert done.handle.rebuilds > 0


# -- accelerate --------------------------------------------------------------------------


def _accelerate_run(plan: bool, tmp_path: Path, budget: str = BUDGET,
                    ) -> tuple[list[float], list[int], Any, nn.Module, int]:
    """accelerate's own loop on one process: prepare, backward, step; with remat planned
    before prepare when ``plan``."""
    from accelerate import Accelerator

    from remat.integrations.accelerate_prepare import auto_checkpoint_before_prepare

    accelerator = Accelerator(cpu=True)
    model = _net()
    batches = _batches()
    done = None
    if plan:
        done = auto_checkpoint_before_prepare(accelerator, model, budget, batch=batches[0],
                                              loss_fn=_loss, cache=tmp_path)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = accelerator.prepare(model, opt)
    losses, peaks, calls = [], [], [0]
    for batch in batches:
        with _tracked(model, opt.optimizer, batch, peaks), _counting(model, calls):
            loss = _loss(model, batch)
            accelerator.backward(loss)
            opt.step()
            opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, peaks, done, model, calls[0]


def test_accelerate_steps_fit_the_budget_and_train_as_without_remat(tmp_path: Path) -> None:
    pytest.importorskip("accelerate")
    losses, peaks, done, model, calls = _accelerate_run(True, tmp_path)
    plain, plain_peaks, _, _, plain_calls = _accelerate_run(False, tmp_path)
    _runs(done, model, calls, plain_calls)
    _fits(peaks, done)
    assert losses == plain  # bit for bit: the same kernels on the same values
    assert max(plain_peaks) > done.plan.budget_bytes  # the budget needed the plan


def test_accelerate_refuses_a_prepared_model_and_the_plugins_own_checkpointing(
    tmp_path: Path,
) -> None:
    pytest.importorskip("accelerate")
    from accelerate import Accelerator

    from remat.integrations.accelerate_prepare import auto_checkpoint_before_prepare

    accelerator = Accelerator(cpu=True)
    model = accelerator.prepare(_net())
    with pytest.raises(UsageError, match=r"already given to accelerator\.prepare"):
        auto_checkpoint_before_prepare(accelerator, model, BUDGET, batch=_batches(1)[0],
                                       loss_fn=_loss, cache=tmp_path)
    assert not remat.applied(model)


WORLD = 2
#: half the batch per rank: the fixed bytes weigh more, so the budget is looser
RANK_BUDGET = "85%"


def _accelerate_rank(rank: int, store: str, out: str, fsdp: bool) -> None:
    """One rank of a 2-process accelerate job on gloo: remat planned before prepare, then
    the same loop without remat, each from the same initial weights; figures to out."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD),
                      LOCAL_WORLD_SIZE=str(WORLD))
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                            world_size=WORLD)
    from accelerate import Accelerator

    from remat.integrations.accelerate_prepare import auto_checkpoint_before_prepare

    result: dict[str, Any] = {}
    try:
        plugin = None
        if fsdp:
            from accelerate.utils import FullyShardedDataParallelPlugin
            plugin = FullyShardedDataParallelPlugin(fsdp_version=2)
        from accelerate.utils import DistributedDataParallelKwargs
        handlers = [DistributedDataParallelKwargs(gradient_as_bucket_view=True)]
        accelerator = Accelerator(cpu=True, fsdp_plugin=plugin, kwargs_handlers=handlers)
        result["distributed_type"] = str(accelerator.distributed_type)
        batches = [(x.chunk(WORLD)[rank], y.chunk(WORLD)[rank]) for x, y in _batches()]
        runs = {}
        for planned in (True, False):
            model = _net()
            done = None
            if planned:
                done = auto_checkpoint_before_prepare(
                    accelerator, model, RANK_BUDGET, batch=batches[0], loss_fn=_loss,
                    cache=Path(out) / "cache")
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
            wrapped, opt = accelerator.prepare(model, opt)
            losses, peaks, calls = [], [], [0]
            for batch in batches:
                with _tracked(model, opt.optimizer, batch, peaks), _counting(model, calls):
                    loss = _loss(wrapped, batch)
                    accelerator.backward(loss)
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                losses.append(loss.item())
            runs["remat" if planned else "plain"] = {"losses": losses, "peaks": peaks,
                                                      "calls": calls[0]}
            if done is not None:
                result.update(wrapper=type(wrapped).__name__, source=done.report.source,
                              plan=done.plan.to_dict(), budget=done.report.budget_bytes,
                              rebuilds=done.handle.rebuilds, applied=remat.applied(model),
                              reserve=done.report.reserve_bytes)
        result["runs"] = runs
    except Exception as err:  # the test reads it
        result["error"] = f"{type(err).__name__}: {err}"
    finally:
        (Path(out) / f"rank{rank}.json").write_text(json.dumps(result))
        dist.destroy_process_group()


@pytest.mark.distributed
def test_accelerate_ddp_trains_as_without_remat_within_the_budget_ddps_buckets_kept_free(
    tmp_path: Path,
) -> None:
    """Two gloo ranks; the FSDP2 plugin is asked for too, and accelerate on a CPU wraps
    with DDP all the same (docs/integrations/frameworks.md says why)."""
    pytest.importorskip("accelerate")
    from conftest import launch_ranks, read_ranks

    ranks = read_ranks(launch_ranks(_accelerate_rank, tmp_path, WORLD, True), WORLD)
    for r in ranks:
        assert "error" not in r, r["error"]
        assert r["distributed_type"] == "DistributedType.MULTI_CPU"
        assert r["wrapper"] == "DistributedDataParallel"
    assert [r["source"] for r in ranks] == ["profiled", "main process"]
    assert ranks[0]["plan"] == ranks[1]["plan"]
    grads = sum(p.numel() * p.element_size() for p in _net().parameters())
    for r in ranks:
        assert r["applied"]
        assert r["runs"]["remat"]["calls"] > r["runs"]["plain"]["calls"]
        assert r["rebuilds"] > 0 or not r["plan"]["regions"]
        assert r["runs"]["remat"]["losses"] == r["runs"]["plain"]["losses"]
        peaks, budget = r["runs"]["remat"]["peaks"], r["budget"]
        # the plan leaves one copy of the gradients free for DDP's buckets, which one
        # process's profile does not see (the step after DDP rebuilds them went over by
        # less than that copy without it)
        assert r["reserve"] == grads
        assert max(peaks) <= budget, (peaks, budget)
        assert max(r["runs"]["plain"]["peaks"]) > budget


# -- Lightning ---------------------------------------------------------------------------


def _lightning_module(through_forward: bool = False) -> Any:
    import lightning.pytorch as pl

    class Regression(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = _net()

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            loss = _loss(self if through_forward else self.net, batch)
            self.log("train_loss", loss)
            return loss

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    return Regression()


def _lightning_peaks() -> Any:
    import lightning.pytorch as pl

    class Peaks(pl.Callback):
        """The tracker from each training batch's start to its end."""

        def __init__(self) -> None:
            self.peaks: list[int] = []
            self.losses: list[float] = []
            self.calls = [0]
            self._counter: Any = None
            self._tracker: LiveMemoryTracker | None = None

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any,
                                 batch_idx: int) -> None:
            gc.collect()
            tracker = LiveMemoryTracker(device=torch.device("cpu"))
            tracker.register_existing(pl_module)
            tracker.register_existing(trainer.optimizers[0])
            tracker.register_existing(list(iter_tensors(batch)))
            tracker.watch(pl_module)
            tracker.watch(trainer.optimizers[0])
            tracker.__enter__()
            self._tracker = tracker
            self._counter = _counting(pl_module, self.calls)
            self._counter.__enter__()

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any,
                               batch: Any, batch_idx: int) -> None:
            assert self._tracker is not None
            self._counter.__exit__(None, None, None)
            self._tracker.__exit__(None, None, None)
            self.peaks.append(self._tracker.report().peak_bytes)
            self.losses.append(outputs["loss"].item())

    return Peaks()


def _lightning_run(callback: Any, through_forward: bool = False,
                   ) -> tuple[list[float], list[int], Any, int]:
    import lightning.pytorch as pl

    module = _lightning_module(through_forward)
    peaks = _lightning_peaks()
    trainer = pl.Trainer(accelerator="cpu", max_steps=STEPS, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False,
                         callbacks=[c for c in (callback, peaks) if c is not None])
    loader = torch.utils.data.DataLoader(_batches(), batch_size=None)
    trainer.fit(module, loader)
    return peaks.losses, peaks.peaks, module, peaks.calls[0]


@pytest.mark.parametrize("submodule", [None, "net"])
def test_lightning_steps_fit_the_budget_and_train_as_without_remat(
    submodule: str | None, tmp_path: Path,
) -> None:
    pytest.importorskip("lightning")
    from remat.integrations.lightning_callback import RematCallback

    callback = RematCallback(BUDGET, module=submodule, cache=tmp_path)
    # the whole module where training_step calls its forward, else the model it calls
    losses, peaks, module, calls = _lightning_run(callback, through_forward=submodule is None)
    plain, plain_peaks, _, plain_calls = _lightning_run(None,
                                                        through_forward=submodule is None)
    done = callback.done
    assert done is not None
    _runs(done, module if submodule is None else module.net, calls, plain_calls)
    _fits(peaks, done)
    assert losses == plain
    assert max(plain_peaks) > done.plan.budget_bytes


def test_lightning_names_the_submodule_when_training_step_skips_forward(
    tmp_path: Path,
) -> None:
    pytest.importorskip("lightning")
    from remat.integrations.lightning_callback import RematCallback

    callback = RematCallback(BUDGET, cache=tmp_path)  # training_step calls self.net
    with pytest.raises(UsageError, match=re.escape("pass RematCallback(module=...) the "
                                                   "submodule it calls ('net')")):
        _lightning_run(callback)
    assert callback.done is None


# -- torchtitan --------------------------------------------------------------------------

TT_VOCAB, TT_DIM, TT_HEADS, TT_LAYERS, TT_BATCH, TT_SEQ = 64, 32, 2, 4, 8, 64
TT_BUDGET = "40%"


def _torchtitan_llama3() -> Any:
    """torchtitan.models.llama3. torchtitan 0.3.0's models package imports triton at
    module level (minimal_async_ep/kernels.py) for GPU kernels no CPU step calls; where
    triton is not installed, a stand-in module serves that import and is taken out of
    ``sys.modules`` right after, so nothing else sees it."""
    pytest.importorskip("torchtitan")
    try:
        import triton  # noqa: F401
    except ImportError:
        class Anything(types.ModuleType):
            """Every attribute, call and decorator: itself (or the function decorated)."""

            def __getattr__(self, name: str) -> Any:
                if name.startswith("__"):
                    raise AttributeError(name)
                return self

            def __call__(self, *args: Any, **kwargs: Any) -> Any:
                if len(args) == 1 and callable(args[0]) and not kwargs:
                    return args[0]
                return self

        # torch.compile's modules import first, seeing that triton is absent (the
        # models package calls torch.compile at import time)
        import torch._inductor.compile_fx  # noqa: F401

        language = Anything("triton.language")
        stand_ins = {"triton": Anything("triton"), "triton.language": language}
        stand_ins["triton"].language = language
        sys.modules.update(stand_ins)
        try:
            import torchtitan.models.llama3 as llama3
        finally:
            for name in stand_ins:
                sys.modules.pop(name, None)
        return llama3
    import torchtitan.models.llama3 as llama3
    return llama3


def _titan_model(ac: Any) -> nn.Module:
    """A tiny llama3 as torchtitan's Trainer makes it: built on meta, checkpointing
    applied, then materialized on the CPU and initialized. Attention by torchtitan's
    ScaledDotProductAttention: its language-model backends cannot train on a CPU (flex
    attention has no CPU backward, varlen needs CUDA's flash attention)."""
    llama3 = _torchtitan_llama3()
    from torchtitan.models.common import (
        ComplexRoPE,
        Embedding,
        Linear,
        RMSNorm,
        compute_ffn_hidden_dim,
    )
    from torchtitan.models.common.attention import ScaledDotProductAttention

    layers = llama3._build_llama3_layers(
        n_layers=TT_LAYERS, dim=TT_DIM, n_heads=TT_HEADS,
        hidden_dim=compute_ffn_hidden_dim(TT_DIM, multiple_of=32),
        rope=ComplexRoPE.Config(dim=TT_DIM // TT_HEADS, max_seq_len=TT_SEQ, theta=500000,
                                scaling="llama"),
        attn_backend="flex")
    for layer in layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    config = llama3.Llama3Model.Config(
        dim=TT_DIM, vocab_size=TT_VOCAB, layers=layers,
        tok_embeddings=Embedding.Config(num_embeddings=TT_VOCAB, embedding_dim=TT_DIM,
                                        param_init=llama3._EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=TT_DIM, param_init=llama3._NORM_INIT),
        lm_head=Linear.Config(in_features=TT_DIM, out_features=TT_VOCAB,
                              param_init=llama3._output_linear_init(TT_DIM)))
    with torch.device("meta"):
        model = config.build()
    if ac is not None:
        ac.apply(model)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device("cpu"))
    model.train()
    return model


def _titan_run(ac: Any) -> tuple[list[float], list[int], nn.Module, int]:
    from remat.integrations.torchtitan_mode import token_loss

    model = _titan_model(ac)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(2)
    losses, peaks, calls = [], [], [0]
    for _ in range(STEPS):
        batch = (torch.randint(0, TT_VOCAB, (TT_BATCH, TT_SEQ), generator=g),
                 torch.randint(0, TT_VOCAB, (TT_BATCH, TT_SEQ), generator=g))
        with _tracked(model, opt, batch, peaks), _counting(model, calls):
            loss = token_loss(model, batch)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, peaks, model, calls[0]


def test_torchtitan_remat_mode_fits_the_budget_and_trains_as_without_checkpointing() -> None:
    from remat.integrations.torchtitan_mode import RematAC

    _torchtitan_llama3()
    ac = RematAC.Config(budget=TT_BUDGET, local_batch_size=TT_BATCH, seq_len=TT_SEQ).build()
    assert isinstance(ac, RematAC)
    losses, peaks, model, calls = _titan_run(ac)
    plain, plain_peaks, _, plain_calls = _titan_run(None)
    assert ac.plan is not None and ac.handle is not None
    assert ac.plan.stages == tuple(f"layers.{i}" for i in range(TT_LAYERS))
    _runs(types.SimpleNamespace(plan=ac.plan, handle=ac.handle), model, calls, plain_calls)
    _fits(peaks, types.SimpleNamespace(plan=ac.plan))
    assert losses == plain
    assert max(plain_peaks) > ac.plan.budget_bytes
