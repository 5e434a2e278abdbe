"""remat.runtime: apply / remove, regions of any shape, options, side effects, errors, memory."""

from __future__ import annotations

import copy
import math
import re
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import pytest
import torch
import torch.utils.checkpoint as tuc
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import Block, mean_square
from remat.core.errors import RematError, UsageError
from remat.core.plan_format import Plan, Region
from remat.measure import LiveMemoryTracker
from remat.runtime import _torch_checkpoint, apply, remove
from remat.runtime import engine as engine_mod
from remat.runtime.install import Handle, applied

# ---------------------------------------------------------------------------------------
# Test models


class Chain(nn.Module):
    """A loop over ``blocks``; ``order`` and ``between`` let tests break the chain."""

    def __init__(self, n: int = 8, d: int = 8, dropout: float = 0.1, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.blocks = nn.ModuleList(Block(d, dropout) for _ in range(n))
        self.order: list[int] | None = None
        self.between: Callable[[int, torch.Tensor], torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        order = range(len(self.blocks)) if self.order is None else self.order
        for i in order:
            x = self.blocks[i](x)
            if self.between is not None:
                x = self.between(i, x)
        return x


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class DecoderLayer(nn.Module):
    """A transformers-style decoder layer: keyword mask and rotary tuple, tuple output."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.o = nn.Linear(d, d)
        self.norm2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
        self.drop = nn.Dropout(0.1)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        output_attentions: bool = False,
        layer_scale: float = 1.0,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        assert position_embeddings is not None and attention_mask is not None
        cos, sin = position_embeddings
        B, T, D = hidden_states.shape
        q, k, v = self.qkv(self.norm1(hidden_states)).chunk(3, dim=-1)
        q, k, v = (t.view(B, T, self.heads, D // self.heads).transpose(1, 2) for t in (q, k, v))
        q = q * cos + rotate_half(q) * sin  # (B, H, T, hd)
        k = k * cos + rotate_half(k) * sin
        scores = q @ k.transpose(-1, -2) / math.sqrt(D // self.heads) + attention_mask
        probs = self.drop(scores.softmax(dim=-1))
        attn = (probs @ v).transpose(1, 2).reshape(B, T, D)
        h = hidden_states + self.o(attn) * layer_scale
        h = h + self.mlp(self.norm2(h))
        return h, (probs if output_attentions else None)


class Decoder(nn.Module):
    """Owns its loop like transformers' decoders: the layers never see the chain."""

    def __init__(self, n: int = 6, d: int = 16, heads: int = 2, vocab: int = 32) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(DecoderLayer(d, heads) for _ in range(n))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)
        self.hd = d // heads

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        T = input_ids.shape[1]
        hidden_states = self.embed(input_ids)
        mask = torch.full((T, T), float("-inf")).triu(1)
        pos = torch.arange(T, dtype=torch.float32)[:, None]
        freqs = pos / 10000 ** (torch.arange(0, self.hd, 2) / self.hd)
        emb = torch.cat((freqs, freqs), dim=-1)
        position_embeddings = (emb.cos(), emb.sin())
        for layer in self.layers:
            layer_outputs = layer(
                hidden_states,
                attention_mask=mask,
                position_embeddings=position_embeddings,
                output_attentions=False,
                layer_scale=0.5,
            )
            hidden_states = layer_outputs[0]
        return self.head(self.norm(hidden_states))


class BNBlock(nn.Module):
    """Linear + BatchNorm + a user step counter kept as a buffer."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.bn = nn.BatchNorm1d(d)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.register_buffer("table", torch.randn(256, d))  # big, never mutated

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x + torch.relu(self.bn(self.fc(x)))


class BNChain(Chain):
    def __init__(self, n: int = 4, d: int = 8) -> None:
        super().__init__(n, d)
        torch.manual_seed(1)
        self.blocks = nn.ModuleList(BNBlock(d) for _ in range(n))


class DictBlock(Block):
    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:  # type: ignore[override]
        out = super().forward(x)
        return {"hidden": out, "aux": out.sum()}


class DictChain(nn.Module):
    def __init__(self, n: int = 4, d: int = 8) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(DictBlock(d, 0.1) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        aux = x.new_zeros(())
        for block in self.blocks:
            out = block(x)
            x, aux = out["hidden"], aux + out["aux"]
        return x.sum() + aux


# ---------------------------------------------------------------------------------------
# Helpers


def stage_names(n: int, prefix: str = "blocks") -> tuple[str, ...]:
    return tuple(f"{prefix}.{i}" for i in range(n))


def make_plan(
    n: int,
    regions: Sequence[tuple[int, int]] = (),
    options: Sequence[str] | str = "keep",
    prefix: str = "blocks",
) -> Plan:
    opts = (options,) * n if isinstance(options, str) else tuple(options)
    return Plan(stage_names(n, prefix), tuple(Region(*r) for r in regions), opts)


def train_step(
    model: nn.Module, x: Any, loss_fn: Callable[[nn.Module, Any], torch.Tensor] = mean_square,
    seed: int = 0,
) -> dict[str, torch.Tensor]:
    """One forward and backward from a fixed RNG seed; returns and clears the grads."""
    torch.manual_seed(seed)
    loss_fn(model, x).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def assert_same_grads(
    got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], exact: bool = True
) -> None:
    assert got.keys() == want.keys()
    for name in want:
        tol = {"rtol": 0.0, "atol": 0.0} if exact else {}
        torch.testing.assert_close(got[name], want[name], **tol, msg=lambda m, n=name: f"{n}: {m}")


def grads_with_plan(model: nn.Module, plan: Plan, x: Any, loss_fn: Any = mean_square) -> Any:
    handle = apply(model, plan)
    try:
        return train_step(model, x, loss_fn)
    finally:
        handle.remove()


def snapshot(model: nn.Module) -> tuple[Any, ...]:
    """Module objects, instance forwards, hooks and state of every submodule."""
    return (
        [
            (
                name,
                id(m),
                "forward" in m.__dict__,
                len(m._forward_pre_hooks),
                len(m._forward_hooks),
                len(m._forward_hooks_always_called),
            )
            for name, m in model.named_modules()
        ],
        [id(p) for p in model.parameters()],
        {k: v.clone() for k, v in model.state_dict().items()},
    )


def assert_unchanged(model: nn.Module, before: tuple[Any, ...], x: torch.Tensor) -> None:
    after = snapshot(model)
    assert after[0] == before[0] and after[1] == before[1]
    assert after[2].keys() == before[2].keys()
    for k in before[2]:
        assert torch.equal(after[2][k], before[2][k]), k
    assert not applied(model)


def count_calls(modules: Sequence[nn.Module]) -> tuple[list[int], Callable[[], None]]:
    counts = [0] * len(modules)
    handles = [
        m.register_forward_pre_hook(lambda _m, _a, i=i: counts.__setitem__(i, counts[i] + 1))
        for i, m in enumerate(modules)
    ]
    return counts, lambda: [h.remove() for h in handles]  # type: ignore[func-returns-value]


NESTED_3 = [(0, 8), (0, 4), (4, 8), (0, 2), (2, 4), (5, 7)]  # depths up to 3
X8 = torch.randn(4, 8)


# ---------------------------------------------------------------------------------------
# The private generator wrapper


def test_checkpoint_frame_matches_torch_checkpoint_and_abort_pops_its_hooks() -> None:
    lin = nn.Linear(4, 4)
    x = torch.randn(3, 4, requires_grad=True)

    def fn(t: torch.Tensor) -> torch.Tensor:
        return torch.tanh(lin(t)).sin()

    tuc.checkpoint(fn, x, use_reentrant=False).sum().backward()
    want = [t.grad.clone() for t in (x, lin.weight)]
    x.grad = lin.weight.grad = None
    frame = _torch_checkpoint.CheckpointFrame.open(fn, x)
    y = fn(x)
    frame.close()
    y.sum().backward()
    assert all(torch.equal(a, b) for a, b in zip((x.grad, lin.weight.grad), want, strict=True))

    frame = _torch_checkpoint.CheckpointFrame.open(fn, x)
    frame.abort()
    a = torch.randn(3, requires_grad=True)
    (a.sin() * a).sum().backward()  # saved for real: no checkpoint hook left behind
    torch.testing.assert_close(a.grad, a.cos() * a + a.sin())


def test_missing_or_changed_private_generator_is_a_clear_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_torch_checkpoint, "_generator", None)
    monkeypatch.delattr(tuc, "_checkpoint_without_reentrant_generator")
    with pytest.raises(RematError, match=re.escape(f"torch {torch.__version__} has no")):
        _torch_checkpoint.check_available()
    model = Chain(4)
    before = snapshot(model)
    with pytest.raises(RematError, match="has no"):
        apply(model, make_plan(4, [(0, 2)]))
    assert_unchanged(model, before, X8)

    def changed(fn, something_new, *args):  # type: ignore[no-untyped-def]
        yield

    monkeypatch.setattr(tuc, "_checkpoint_without_reentrant_generator", changed, raising=False)
    with pytest.raises(RematError, match=r"changed the signature"):
        _torch_checkpoint.check_available()


# ---------------------------------------------------------------------------------------
# Gradients


PLANS = {
    "single-stage": [(i, i + 1) for i in range(8)],
    "multi-stage": [(0, 3), (3, 8)],
    "partial-cover": [(1, 4), (5, 7)],
    "nested-3-levels": NESTED_3,
}
OPTIONS = {
    "keep": "keep",
    "save-matmuls": "selective:save-matmuls",
    "save-attention": "selective:save-attention",
    "save-nothing": "selective:save-nothing",
    "custom-ops": "selective:mm,addmm,tanh",
    "offload": "offload",
    "mixed": ["keep", "selective:save-matmuls", "offload", "selective:save-nothing"] * 2,
}


@pytest.mark.parametrize("regions", PLANS.values(), ids=PLANS.keys())
@pytest.mark.parametrize("options", OPTIONS.values(), ids=OPTIONS.keys())
def test_gradients_are_bitwise_equal_with_dropout(regions: Any, options: Any) -> None:
    model = Chain(8, dropout=0.2)
    want = train_step(copy.deepcopy(model), X8)
    got = grads_with_plan(model, make_plan(8, regions, options), X8)
    assert_same_grads(got, want)


@pytest.mark.parametrize("options", OPTIONS.values(), ids=OPTIONS.keys())
def test_options_without_regions(options: Any) -> None:
    model = Chain(8, dropout=0.2)
    want = train_step(copy.deepcopy(model), X8)
    assert_same_grads(grads_with_plan(model, make_plan(8, [], options), X8), want)


def test_decoder_loop_with_keyword_mask_rotary_tuple_and_tuple_outputs() -> None:
    model = Decoder()
    ids = torch.randint(0, 32, (2, 10))

    def loss(m: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(m(batch).flatten(0, 1), batch.flatten())

    want = train_step(copy.deepcopy(model), ids, loss)
    for regions, options in [
        ([(0, 3), (3, 6)], "keep"),
        ([(0, 6), (0, 3), (3, 6), (0, 1), (4, 6)], "keep"),
        ([(0, 6), (1, 3)], ["selective:save-matmuls", "keep", "selective:bmm", "offload"] + [
            "keep"] * 2),
    ]:
        plan = make_plan(6, regions, options, prefix="layers")
        assert_same_grads(grads_with_plan(model, plan, ids, loss), want)


def test_dict_outputs_inside_a_multi_stage_region() -> None:
    model = DictChain()

    def loss(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return m(x)

    want = train_step(copy.deepcopy(model), X8, loss)
    assert_same_grads(grads_with_plan(model, make_plan(4, [(0, 4), (1, 3)]), X8, loss), want)


def test_code_between_stages_of_a_region_may_save_tensors() -> None:
    """An auxiliary loss between the stages runs once and saves for real."""

    class WithAux(Chain):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            aux = x.new_zeros(())
            for block in self.blocks:
                x = block(x)
                aux = aux + (x * x.detach().sin()).mean()  # mul saves its inputs
            return x + aux

    model = WithAux(6)
    want = train_step(copy.deepcopy(model), X8)
    got = grads_with_plan(model, make_plan(6, [(0, 6), (1, 4), (2, 3)]), X8)
    assert_same_grads(got, want)


def test_rng_state_after_backward_equals_state_after_forward() -> None:
    model = Chain(8, dropout=0.5)
    handle = apply(model, make_plan(8, NESTED_3, ["keep", "selective:save-matmuls"] * 4))
    torch.manual_seed(3)
    loss = mean_square(model, X8)
    after_forward = torch.get_rng_state()
    loss.backward()
    assert torch.equal(torch.get_rng_state(), after_forward)
    assert handle.rebuilds == len(NESTED_3)
    handle.remove()


def test_cpu_autocast_bfloat16_inside_regions() -> None:
    model = Chain(8, dropout=0.1)

    def loss(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return m(x).float().pow(2).mean()

    want = train_step(copy.deepcopy(model), X8, loss)
    plan = make_plan(8, NESTED_3, ["keep", "selective:save-matmuls"] * 4)
    assert_same_grads(grads_with_plan(model, plan, X8, loss), want)
    fp32 = train_step(copy.deepcopy(model), X8)
    assert not torch.equal(fp32["blocks.0.fc.weight"], want["blocks.0.fc.weight"])


def test_frozen_input_and_keyword_non_tensor_arguments() -> None:
    model = Decoder(n=4)
    ids = torch.randint(0, 32, (2, 7))
    model.embed.weight.requires_grad_(False)  # the first region's input needs no grad

    def loss(m: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        return m(batch).logsumexp(-1).mean()

    want = train_step(copy.deepcopy(model), ids, loss)
    got = grads_with_plan(model, make_plan(4, [(0, 4), (0, 2)], prefix="layers"), ids, loss)
    assert "embed.weight" not in got
    assert_same_grads(got, want)


def test_parameter_shared_inside_and_outside_a_region_gets_its_grad_once() -> None:
    class Shared(Chain):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(self.blocks[2].fc(x))  # blocks.2.fc also runs in region

    model = Shared(4, dropout=0.0)
    want = train_step(copy.deepcopy(model), X8)
    assert_same_grads(grads_with_plan(model, make_plan(4, [(0, 4), (1, 3)]), X8), want)


def test_builtin_gpt_gradients_equal() -> None:
    models = pytest.importorskip("remat.models")
    model, batch, loss_fn = models.load_model(
        "gpt", n_layer=4, n_embd=32, n_head=2, block_size=16, vocab_size=64, batch_size=2
    )
    assert isinstance(model.blocks, nn.ModuleList)
    want = train_step(copy.deepcopy(model), batch, loss_fn)
    plan = make_plan(4, [(0, 4), (0, 2), (2, 4), (3, 4)],
                     ["keep", "selective:save-matmuls", "selective:save-attention", "offload"])
    assert_same_grads(grads_with_plan(model, plan, batch, loss_fn), want)


# ---------------------------------------------------------------------------------------
# Rebuild counts, selective caching, offload


@pytest.mark.parametrize("early_stop", [True, False])
def test_each_stage_runs_as_often_as_the_plan_implies(early_stop: bool) -> None:
    regions = [(1, 7), (1, 4), (4, 7), (1, 2), (5, 6)]
    model = Chain(8)
    plan = make_plan(8, regions)
    handle = apply(model, plan)
    counts, unhook = count_calls(list(model.blocks))
    with tuc.set_checkpoint_early_stop(early_stop):
        train_step(model, X8)
    unhook()
    handle.remove()
    for i, count in enumerate(counts):
        d = plan.depth(i)
        if early_stop:
            assert 1 <= count <= d + 1, (i, count)
        else:
            assert count == d + 1, (i, count)
    assert counts[0] == counts[7] == 1  # keep, outside every region


class OpCounter(TorchDispatchMode):
    def __init__(self, names: set[str]) -> None:
        super().__init__()
        self.names = names
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func.overloadpacket.__name__ in self.names:
            self.count += 1
        return func(*args, **(kwargs or {}))


def backward_matmuls(model: nn.Module, plan: Plan, early_stop: bool = True) -> int:
    """How many addmm/mm ops backward runs (rebuilds included)."""
    handle = apply(model, plan)
    with tuc.set_checkpoint_early_stop(early_stop):
        loss = mean_square(model, X8)
    with OpCounter({"mm", "addmm"}) as counter:
        loss.backward()
    handle.remove()
    return counter.count


@pytest.mark.parametrize("early_stop", [True, False])
def test_selective_saves_matmuls_outside_and_inside_regions(early_stop: bool) -> None:
    model = Chain(4, dropout=0.0)
    for regions in ([], [(0, 4)]):
        keep = backward_matmuls(model, make_plan(4, regions), early_stop)
        saved = backward_matmuls(model, make_plan(4, regions, "selective:save-matmuls"), early_stop)
        rebuilt = backward_matmuls(
            model, make_plan(4, regions, "selective:save-nothing"), early_stop
        )
        assert saved == keep
        # Inside the region with early stop, torch ends the rebuild before the last stage
        # runs, so that stage has no cached matmul and is rebuilt whole.
        fallback = 1 if regions and early_stop else 0
        assert rebuilt - saved == 4 - fallback


def test_offload_on_cpu_is_a_noop_reported_in_notes() -> None:
    model = Chain(4)
    handle = apply(model, make_plan(4, [(0, 2)], ["offload", "keep", "offload", "keep"]))
    train_step(model, X8)
    assert handle.notes == tuple(
        f"offload of stage 'blocks.{i}' was a no-op: its input is on cpu, and offloading "
        "only pays for inputs on an accelerator"
        for i in (0, 2)
    )
    handle.remove()


def test_offload_machinery_with_cpu_standing_in_for_an_accelerator(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    packed: list[str] = []

    @contextmanager
    def fake_offload() -> Iterator[None]:
        packed.append("offload")
        with torch.autograd.graph.save_on_cpu(pin_memory=False):
            yield

    real_discard = engine_mod.discard_saved_tensors

    @contextmanager
    def spy_discard() -> Iterator[None]:
        packed.append("discard")
        with real_discard():
            yield

    monkeypatch.setattr(engine_mod, "wants_offload", lambda t: True)
    monkeypatch.setattr(engine_mod, "offload_saved_tensors", fake_offload)
    monkeypatch.setattr(engine_mod, "discard_saved_tensors", spy_discard)
    model = Chain(8, dropout=0.2)
    want = train_step(copy.deepcopy(model), X8)
    plan = make_plan(8, [(0, 4), (0, 2), (5, 8)], ["offload", "keep"] * 4)
    handle = apply(model, plan)
    with tuc.set_checkpoint_early_stop(False):
        assert_same_grads(train_step(model, X8), want)
    assert packed.count("offload") == 4  # offloaded in forward, inside regions or not
    # stages 0, 2 and 6 drop what they save in their innermost region's rebuild
    assert packed.count("discard") == 3 and handle.rebuilds == 3
    assert handle.notes == ()
    handle.remove()

    # A region whose stages all offload saves nothing itself, so it is never rebuilt.
    packed.clear()
    handle = apply(model, make_plan(8, [(0, 4), (0, 2)], "offload"))
    assert_same_grads(train_step(model, X8), want)
    assert packed.count("discard") == 0 and handle.rebuilds == 0
    handle.remove()


# ---------------------------------------------------------------------------------------
# Buffers mutated in forward


@pytest.mark.parametrize(
    "regions,options",
    [
        ([(0, 4), (0, 2), (2, 4), (3, 4)], "keep"),
        ([(0, 4)], "selective:save-matmuls"),
        ([], "selective:save-nothing"),
        ([(i, i + 1) for i in range(4)], "keep"),
    ],
)
def test_buffers_change_once_per_step(regions: Any, options: str) -> None:
    model = BNChain()
    ref = copy.deepcopy(model)
    x = torch.randn(6, 8)
    want = train_step(ref, x)
    got = grads_with_plan(model, make_plan(4, regions, options), x)
    assert_same_grads(got, want)
    for name, value in ref.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name
    assert all(int(b.calls) == 1 and int(b.bn.num_batches_tracked) == 1 for b in model.blocks)


def test_plain_torch_checkpoint_updates_buffers_twice() -> None:
    """Why remat restores buffers: torch.utils.checkpoint re-runs the in-place updates."""
    model, ref = BNChain(), BNChain()
    x = torch.randn(6, 8)
    ref(x).sum().backward()
    h = x
    for block in model.blocks:
        h = tuc.checkpoint(block, h, use_reentrant=False)
    h.sum().backward()
    assert all(int(b.bn.num_batches_tracked) == 2 and int(b.calls) == 2 for b in model.blocks)
    assert not torch.equal(model.blocks[0].bn.running_mean, ref.blocks[0].bn.running_mean)


# ---------------------------------------------------------------------------------------
# Exceptions and stale state


class Boom(RuntimeError):
    pass


def assert_clean(handle: Handle) -> None:
    engine = handle._installation.engine
    assert engine.stack == [] and engine.phase is engine_mod.Phase.IDLE
    assert engine.tape.count == 0 and engine.current is None
    a = torch.randn(3, requires_grad=True)
    (a.sin() * a).sum().backward()  # no saved-tensor hook of ours left pushed
    torch.testing.assert_close(a.grad, a.cos() * a + a.sin())


def test_exception_in_forward_inside_a_region_leaves_no_stale_state() -> None:
    model = Chain(8)
    want = train_step(copy.deepcopy(model), X8)
    handle = apply(model, make_plan(8, NESTED_3, ["keep", "selective:save-matmuls"] * 4))

    def fail(i: int, x: torch.Tensor) -> torch.Tensor:
        if i == 2:
            raise Boom("stage failed")
        return x

    model.between = fail
    with pytest.raises(Boom):
        train_step(model, X8)
    assert_clean(handle)
    model.between = None
    assert_same_grads(train_step(model, X8), want)
    handle.remove()


def test_exception_during_a_rebuild_leaves_no_stale_state() -> None:
    model = Chain(8)
    want = train_step(copy.deepcopy(model), X8)
    handle = apply(model, make_plan(8, NESTED_3))
    armed = [False]

    def maybe_fail(_m: nn.Module, _a: Any) -> None:
        if armed[0]:
            raise Boom("rebuild failed")

    hook = model.blocks[3].register_forward_pre_hook(maybe_fail)
    loss = mean_square(model, X8)
    armed[0] = True
    with pytest.raises(Boom):
        loss.backward()
    assert_clean(handle)
    armed[0] = False
    del loss
    assert_same_grads(train_step(model, X8), want)
    hook.remove()
    handle.remove()


def test_second_backward_without_retain_graph_raises_torchs_error() -> None:
    model = Chain(8)
    handle = apply(model, make_plan(8, NESTED_3))
    loss = mean_square(model, X8)
    loss.backward()
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        loss.backward()
    handle.remove()


# ---------------------------------------------------------------------------------------
# Run-time errors naming the stage


@pytest.mark.parametrize(
    "order,message",
    [
        ([0, 1, 3, 2], r"stage 'blocks.3' was called where stage 'blocks.2' was expected"),
        ([0, 1, 1, 2, 3], r"stage 'blocks.1' was called where stage 'blocks.2' was expected"),
        ([0, 1, 2, 3, 0], r"stage 'blocks.0' was called after the last stage 'blocks.3'"),
    ],
)
def test_stage_called_out_of_order_is_named(order: list[int], message: str) -> None:
    model = Chain(4)
    want = train_step(copy.deepcopy(model), X8)
    handle = apply(model, make_plan(4, [(1, 3)]))
    model.order = order
    with pytest.raises(UsageError, match=message):
        train_step(model, X8)
    assert_clean(handle)
    model.order = None
    assert_same_grads(train_step(model, X8), want)
    handle.remove()


def test_code_between_stages_of_one_region_is_replayed_in_its_rebuild() -> None:
    model = Chain(4)
    model.between = lambda i, x: torch.nn.functional.dropout(x * 2, 0.5) if i == 1 else x
    want = train_step(copy.deepcopy(model), X8)
    for regions in ([(0, 4)], [(0, 4), (1, 3)], [(0, 2), (2, 4)]):
        handle = apply(model, make_plan(4, regions))
        assert_same_grads(train_step(model, X8), want)
        assert handle.rebuilds == len(regions)
        handle.remove()


def test_code_between_stages_that_reads_tensor_values_is_named() -> None:
    model = Chain(4)
    model.between = lambda i, x: x * 2 if i == 1 and bool(x.sum() > 0) else x
    want = train_step(copy.deepcopy(model), X8)
    handle = apply(model, make_plan(4, [(0, 4)]))
    with pytest.raises(UsageError, match=r"after stage 'blocks.1' cannot be replayed .*__bool__"):
        train_step(model, X8)
    assert_clean(handle)
    handle.remove()
    # Between regions the model may do as it likes.
    assert_same_grads(grads_with_plan(model, make_plan(4, [(0, 2), (2, 4)]), X8), want)


def test_stage_input_made_before_its_region_is_named() -> None:
    model = Chain(4)
    kept: list[torch.Tensor] = []

    def between(i: int, x: torch.Tensor) -> torch.Tensor:
        kept.append(x)
        return kept[0] if i == 2 else x  # stage 3 gets stage 0's output

    model.between = between
    want = train_step(copy.deepcopy(model), X8)
    kept.clear()
    handle = apply(model, make_plan(4, [(2, 4)]))
    with pytest.raises(UsageError, match=r"'blocks.3' does not get a tensor made inside region"):
        train_step(model, X8)
    assert_clean(handle)
    handle.remove()
    kept.clear()
    # A region that made it can rebuild it.
    assert_same_grads(grads_with_plan(model, make_plan(4, [(0, 4)]), X8), want)


def test_region_left_open_and_non_tensor_boundary_are_named() -> None:
    model = Chain(4)
    handle = apply(model, make_plan(4, [(2, 4)]))
    model.order = [0, 1, 2]
    with pytest.raises(UsageError, match=r"region \[2, 4\) was still open .* 'blocks.3'"):
        train_step(model, X8)
    assert_clean(handle)
    model.order = None

    class KeywordChain(Chain):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.blocks:
                x = block(x=x)
            return x

    kw = KeywordChain(4)
    want = train_step(copy.deepcopy(kw), X8)
    handle2 = apply(kw, make_plan(4, [(0, 2), (2, 4), (3, 4)]))
    assert_same_grads(train_step(kw, X8), want)  # the hidden state arrives by keyword
    assert handle2.rebuilds == 3
    handle2.remove()
    handle.remove()


def test_eval_and_no_grad_run_the_original_forward(monkeypatch: pytest.MonkeyPatch) -> None:
    model = Chain(8)
    expected = model.eval()(X8)
    handle = apply(model, make_plan(8, NESTED_3, "selective:save-matmuls"))

    def no_frames(*_a: Any, **_k: Any) -> None:
        raise AssertionError("a checkpoint frame was opened")

    monkeypatch.setattr(engine_mod.CheckpointFrame, "open", no_frames)
    assert torch.equal(model(X8), expected)
    model.train()
    with torch.no_grad():
        model(X8)
    model.blocks[0](X8)  # a stage called outside the root's forward
    assert handle.rebuilds == 0
    handle.remove()


# ---------------------------------------------------------------------------------------
# apply / remove


def test_apply_remove_round_trip_is_exact() -> None:
    model = Chain(8, dropout=0.3)
    before = snapshot(model)
    torch.manual_seed(5)
    out_before = model(X8)
    handle = apply(model, make_plan(8, NESTED_3, "selective:save-matmuls"))
    assert handle.stages == tuple(model.blocks) and handle.plan.regions[0] == Region(0, 8)
    assert all("forward" in b.__dict__ for b in model.blocks)
    assert list(model.state_dict()) == list(before[2])
    train_step(model, X8)
    handle.remove()
    with pytest.raises(UsageError, match="already removed"):
        handle.remove()
    with pytest.raises(UsageError, match="no remat plan is applied"):
        remove(model)
    for p in model.parameters():  # train_step cleared the grads
        assert p.grad is None
    assert_unchanged(model, before, X8)
    torch.manual_seed(5)
    assert torch.equal(model(X8), out_before)


def test_apply_keeps_an_existing_instance_forward() -> None:
    model = Chain(4)
    block = model.blocks[1]
    custom = block.forward  # e.g. put there by another library

    def patched(x: torch.Tensor) -> torch.Tensor:
        return custom(x) + 1

    block.forward = patched
    want = train_step(model, X8)
    assert_same_grads(grads_with_plan(model, make_plan(4, [(0, 2)]), X8), want)
    assert block.__dict__["forward"] is patched


def test_applying_twice_is_an_error() -> None:
    model = Chain(4)
    handle = apply(model, make_plan(4, [(0, 2)]))
    with pytest.raises(UsageError, match="already applied"):
        apply(model, make_plan(4))
    sub = nn.Sequential(model)  # same stage modules through another root
    with pytest.raises(UsageError, match="already a stage of another applied plan"):
        apply(sub, make_plan(4, prefix="0.blocks"))
    handle.remove()


class Aliased(Chain):
    def __init__(self) -> None:
        super().__init__(4)
        self.alias = self.blocks[0]


@pytest.mark.parametrize(
    "build,plan,message",
    [
        (Chain, make_plan(4, prefix="block"), r"no submodule 'block.0'; did you mean 'blocks.0'"),
        (Chain, Plan(("blocks.0", "blocks.1", "blocks.9")), r"no submodule 'blocks.9'"),
        (Chain, Plan(("blocks.0", "blocks.0.fc")), r"'blocks.0.fc' lies inside stage 'blocks.0'"),
        (Aliased, Plan(("alias", "blocks.0")), r"'alias' and 'blocks.0' are the same module"),
        (Chain, make_plan(4, [(0, 2)], "selective:mm,nosuchop"), r"names op 'nosuchop'"),
        (Chain, make_plan(4, [(0, 2)], "selective:mm.nosuch"), r"has no overload 'nosuch'"),
    ],
)
def test_apply_errors_leave_the_model_unchanged(build: Any, plan: Plan, message: str) -> None:
    model = build()
    before = snapshot(model)
    with pytest.raises(UsageError, match=message):
        apply(model, plan)
    assert_unchanged(model, before, X8)
    assert applied(model) is False
    apply(model, make_plan(4, [(0, 2)])).remove()  # and it can still be applied


def test_apply_rejects_non_models_and_non_plans() -> None:
    with pytest.raises(UsageError, match=r"not a torch\.nn\.Module"):
        apply("model", make_plan(4))  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="not a remat Plan"):
        apply(Chain(4), {"stages": []})  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------
# Memory, measured by the project's live-storage tracker


def step_peak(model: nn.Module, x: torch.Tensor, regions: Sequence[tuple[int, int]] | None) -> Any:
    handle = None if regions is None else apply(model, make_plan(len(model.blocks), regions))
    with LiveMemoryTracker() as tracker:
        mean_square(model, x).backward()
    if handle is not None:
        handle.remove()
    model.zero_grad(set_to_none=True)
    return tracker.peak_bytes, tracker.live_bytes


def test_regions_lower_the_measured_peak_as_the_theory_says() -> None:
    model = Chain(16, d=16, dropout=0.0)
    x = torch.randn(2048, 16)  # activations dominate: 128 KiB per boundary
    none, live_none = step_peak(model, x, None)
    singles, live_singles = step_peak(model, x, [(i, i + 1) for i in range(16)])
    four_by_four, _ = step_peak(model, x, [(i, i + 4) for i in range(0, 16, 4)])
    assert four_by_four < singles < none
    assert live_singles == live_none  # nothing of a step stays alive afterwards
    flat = {k: step_peak(model, x, [(i, min(i + k, 16)) for i in range(0, 16, k)])[0]
            for k in range(1, 17)}
    nested = [(0, 8), (8, 16), (0, 4), (4, 8), (8, 12), (12, 16)]
    nested += [(i, i + 2) for i in range(0, 16, 2)]
    nested_peak, live_nested = step_peak(model, x, nested)
    assert nested_peak < min(flat.values())
    assert live_nested == live_none
