"""Tests for the built-in models and for load_model / parse_set_options."""

from __future__ import annotations

import functools
import re
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from remat.errors import UsageError
from remat.models import BUILTINS, DEFAULT_MODEL, load_model, parse_set_options
from remat.models.convnet_bn import ResBlock
from remat.models.gpt import Block
from remat.models.mlp_hetero import DEFAULT_PATTERN, HeteroBlock

NAMES = list(BUILTINS)
# Small options so every test stays fast; each still builds the real architecture.
SMALL: dict[str, dict[str, Any]] = {
    "gpt": {"n_layer": 2, "n_embd": 32, "n_head": 2, "block_size": 16, "batch_size": 2},
    "mlp-hetero": {"n_blocks": 4, "d_model": 32, "expansion": 16, "depth": 2, "batch_size": 4},
    "convnet-bn": {"n_blocks": 3, "channels": 4, "image_size": 8, "batch_size": 4},
}
BLOCK_CLASS = {"gpt": Block, "mlp-hetero": HeteroBlock, "convnet-bn": ResBlock}
DEFAULT_BLOCKS = {"gpt": 8, "mlp-hetero": 12, "convnet-bn": 8}


def _build(name: str, **options: Any) -> tuple[Any, Any, Any]:
    """load_model, typed loosely so tests can reach into model attributes."""
    return load_model(name, **options)


def _tensors(batch: Any) -> list[torch.Tensor]:
    if isinstance(batch, dict):
        return [batch[k] for k in sorted(batch)]
    return list(batch)


def _same_state(a: nn.Module, b: nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


# --- every built-in -------------------------------------------------------------------


def test_registry() -> None:
    assert set(BUILTINS) == {"gpt", "mlp-hetero", "convnet-bn"}
    assert DEFAULT_MODEL == "gpt"


@pytest.mark.parametrize("name", NAMES)
def test_builds_at_defaults_with_finite_scalar_loss(name: str) -> None:
    model, batch, loss_fn = _build(name)
    assert model.training
    assert len(model.blocks) == DEFAULT_BLOCKS[name]
    loss = loss_fn(model, batch)
    assert loss.dim() == 0 and torch.isfinite(loss)


@pytest.mark.parametrize("name", NAMES)
def test_backward_reaches_every_parameter(name: str) -> None:
    model, batch, loss_fn = _build(name, **SMALL[name])
    loss_fn(model, batch).backward()
    for pname, p in model.named_parameters():
        assert p.grad is not None, pname
        assert torch.isfinite(p.grad).all(), pname


@pytest.mark.parametrize("name", NAMES)
def test_seed_determines_parameters_and_batch(name: str) -> None:
    opts = SMALL[name]
    m1, b1, _ = _build(name, seed=3, **opts)
    m2, b2, _ = _build(name, seed=3, **opts)
    m3, b3, _ = _build(name, seed=4, **opts)
    assert _same_state(m1, m2)
    assert all(torch.equal(x, y) for x, y in zip(_tensors(b1), _tensors(b2), strict=True))
    assert not _same_state(m1, m3)
    assert not all(torch.equal(x, y) for x, y in zip(_tensors(b1), _tensors(b3), strict=True))


@pytest.mark.parametrize("name", NAMES)
def test_global_rng_is_left_alone(name: str) -> None:
    before = torch.get_rng_state()
    load_model(name, **SMALL[name])
    assert torch.equal(before, torch.get_rng_state())


@pytest.mark.parametrize("name", NAMES)
def test_blocks_are_one_container_of_one_class(name: str) -> None:
    model, _, _ = _build(name, **SMALL[name])
    assert isinstance(model.blocks, (nn.Sequential, nn.ModuleList))
    assert {type(b) for b in model.blocks} == {BLOCK_CLASS[name]}
    # No other container holds more modules of one class.
    for other in model.modules():
        if other is not model.blocks and isinstance(other, (nn.Sequential, nn.ModuleList)):
            assert len(other) < len(model.blocks) or len({type(m) for m in other}) > 1


@pytest.mark.parametrize("name", NAMES)
def test_loss_fn_accepts_a_dict_batch(name: str) -> None:
    model, batch, loss_fn = _build(name, **SMALL[name])
    keys = {"gpt": ("idx", "targets"), "mlp-hetero": ("x", "labels")}
    keys["convnet-bn"] = ("images", "labels")
    model.eval()
    as_dict = dict(zip(keys[name], batch, strict=True))
    assert torch.equal(loss_fn(model, batch), loss_fn(model, as_dict))


# --- gpt ------------------------------------------------------------------------------


def test_gpt_is_causal() -> None:
    model, (idx, _), _ = _build("gpt", **SMALL["gpt"])
    model.eval()
    t = idx.shape[1] // 2
    changed = idx.clone()
    changed[:, t:] = (changed[:, t:] + 1) % 512
    with torch.no_grad():
        a, b = model(idx), model(changed)
    assert a.shape == (*idx.shape, 512)
    torch.testing.assert_close(a[:, :t], b[:, :t], rtol=0, atol=1e-6)
    assert not torch.allclose(a[:, t:], b[:, t:])


def test_gpt_ties_lm_head_to_token_embedding() -> None:
    model, _, _ = _build("gpt", **SMALL["gpt"])
    assert model.lm_head.weight is model.wte.weight
    assert len([p for p in model.parameters() if p is model.wte.weight]) == 1


def test_gpt_batch_shapes_and_seq_len() -> None:
    _, (idx, targets), _ = _build("gpt", **SMALL["gpt"], seq_len=10)
    assert idx.shape == targets.shape == (2, 10)
    assert idx.dtype == targets.dtype == torch.int64
    assert torch.equal(idx[:, 1:], targets[:, :-1])  # targets are the next tokens


@pytest.mark.parametrize(
    ("options", "named"),
    [({"n_embd": 30, "n_head": 4}, "n_embd=30"), ({"seq_len": 200}, "seq_len=200")],
)
def test_gpt_rejects_inconsistent_sizes(options: dict[str, int], named: str) -> None:
    with pytest.raises(UsageError, match=named):
        load_model("gpt", **options)


# --- mlp-hetero -----------------------------------------------------------------------


class _FlopProxy(TorchDispatchMode):
    """Count 2*m*n*k for matmuls and the output numel of every other non-view op."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        aten = torch.ops.aten
        packet = func._overloadpacket
        if packet in (aten.mm, aten.bmm, aten.mv):
            self.count += 2 * out.numel() * args[0].shape[-1]
        elif packet in (aten.addmm, aten.baddbmm, aten.addmv):
            self.count += 2 * out.numel() * args[1].shape[-1]
        elif not func.is_view:
            outs = out if isinstance(out, (tuple, list)) else [out]
            self.count += sum(t.numel() for t in outs if isinstance(t, torch.Tensor))
        return out


def _saved_bytes(fn: Callable[[], torch.Tensor], exclude: set[int]) -> int:
    """Bytes of the distinct non-parameter storages autograd saves while running ``fn``."""
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in exclude:
            storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(storages.values())


def test_mlp_hetero_blocks_differ_widely_in_memory_and_compute() -> None:
    model, (x, _), _ = _build("mlp-hetero", batch_size=4)
    assert "".join(b.kind for b in model.blocks) == DEFAULT_PATTERN
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    h = model.proj_in(x).detach().requires_grad_()
    saved, flops = [], []
    for block in model.blocks:
        saved.append(_saved_bytes(functools.partial(block, h), params))
        with torch.no_grad(), _FlopProxy() as proxy:
            out = block(h)
        assert out.shape == h.shape  # the boundary is one (B, d_model) tensor
        flops.append(proxy.count)
        h = out.detach().requires_grad_()
    assert max(saved) >= 10 * min(saved)
    assert max(flops) >= 10 * min(flops)
    kinds = [b.kind for b in model.blocks]
    wide = [i for i, k in enumerate(kinds) if k == "w"]
    narrow = [i for i, k in enumerate(kinds) if k == "n"]
    # Wide blocks are the memory-heavy, compute-light ones.
    assert min(saved[i] for i in wide) >= 10 * max(saved[i] for i in narrow)
    assert min(flops[i] for i in narrow) >= 10 * max(flops[i] for i in wide)


def test_mlp_hetero_pattern_option() -> None:
    model, _, _ = _build("mlp-hetero", **{**SMALL["mlp-hetero"], "n_blocks": 5}, pattern="nw")
    assert [b.kind for b in model.blocks] == ["n", "w", "n", "w", "n"]
    with pytest.raises(UsageError, match="'wx'"):
        load_model("mlp-hetero", pattern="wx")


# --- convnet-bn -----------------------------------------------------------------------


def test_convnet_bn_updates_running_stats_once_per_forward() -> None:
    model, batch, loss_fn = _build("convnet-bn", **SMALL["convnet-bn"])
    bns = [m for m in model.modules() if isinstance(m, nn.BatchNorm2d)]
    assert bns
    means = [torch.as_tensor(bn.running_mean).clone() for bn in bns]
    loss_fn(model, batch)
    for bn, before in zip(bns, means, strict=True):
        assert not torch.equal(torch.as_tensor(bn.running_mean), before)
        assert torch.as_tensor(bn.num_batches_tracked).item() == 1


def test_convnet_bn_downsamples_with_projection_skips() -> None:
    model, (images, _), _ = _build("convnet-bn")
    assert images.shape == (32, 3, 32, 32)
    projected = [b for b in model.blocks if not isinstance(b.skip, nn.Identity)]
    assert len(projected) == 2  # two stage transitions at the default n_stages=3
    assert model.fc.in_features == 4 * 32


# --- load_model -----------------------------------------------------------------------

USER_PACKAGE = "remat_test_user_models"
USER_MODULE = textwrap.dedent(
    """
    import torch

    def build(*, width=4, seed=0):
        model = torch.nn.Linear(width, 1)
        return model, torch.ones(2, width), lambda m, b: m(b).sum()

    def two_items():
        return torch.nn.Linear(1, 1), None

    def not_a_tuple():
        return torch.nn.Linear(1, 1)

    def not_a_module():
        return "model", None, lambda m, b: 0

    def loss_not_callable():
        return torch.nn.Linear(1, 1), None, "loss"

    NOT_CALLABLE = 3
    """
)


@pytest.fixture
def user_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    pkg = tmp_path / USER_PACKAGE
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "factories.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield f"{USER_PACKAGE}.factories"
    for mod in [m for m in sys.modules if m.split(".")[0] == USER_PACKAGE]:
        del sys.modules[mod]


@pytest.mark.parametrize("name", NAMES)
def test_load_model_passes_options(name: str) -> None:
    model, _, loss_fn = load_model(name, **SMALL[name])
    assert isinstance(model, nn.Module) and callable(loss_fn)
    size_key = "n_layer" if name == "gpt" else "n_blocks"
    assert len(list(model.get_submodule("blocks").children())) == SMALL[name][size_key]


def test_load_model_from_module_spec(user_package: str) -> None:
    model, batch, loss_fn = load_model(f"{user_package}:build", width=3)
    assert isinstance(model, nn.Linear) and model.in_features == 3
    assert loss_fn(model, batch).dim() == 0


@pytest.mark.parametrize(
    ("spec", "options", "named"),
    [
        ("gtp", {}, "'gtp'"),
        ("gpt", {"n_layers": 4}, "'n_layers'"),
        ("gpt", {"n_layer": 0}, "n_layer=0"),
        ("gpt", {"dropout": 1.5}, "dropout=1.5"),
        ("convnet-bn", {"seed": "x"}, "seed='x'"),
        ("remat_no_such_module_xyz:build", {}, "'remat_no_such_module_xyz'"),
        (":build", {}, "':build'"),
        ("USER:", {}, "'USER:'"),
        ("USER:missing", {}, "'missing'"),
        ("USER:NOT_CALLABLE", {}, "NOT_CALLABLE"),
        ("USER:build", {"depth": 2}, "'depth'"),
        ("USER:two_items", {}, "2-tuple"),
        ("USER:not_a_tuple", {}, "Linear"),
        ("USER:not_a_module", {}, "not_a_module"),
        ("USER:loss_not_callable", {}, "loss_not_callable"),
    ],
)
def test_load_model_errors_are_usage_errors(
    user_package: str, spec: str, options: dict[str, Any], named: str
) -> None:
    spec = spec.replace("USER", user_package)
    named = named.replace("USER", user_package)
    with pytest.raises(UsageError) as info:
        load_model(spec, **options)
    message = str(info.value)
    assert named in message
    assert "\n" not in message


def test_unknown_model_lists_the_choices() -> None:
    with pytest.raises(UsageError, match="gpt, mlp-hetero, convnet-bn"):
        load_model("gtp")


# --- parse_set_options ----------------------------------------------------------------


def test_parse_set_options_types_values() -> None:
    items = ["n_layer=4", "dropout=0.0", "name=x", "flag=true", "off=False", "lr=1e-3"]
    items += ["neg=-2", "n-head=2", "empty=", "spec=a=b"]
    assert parse_set_options(items) == {
        "n_layer": 4,
        "dropout": 0.0,
        "name": "x",
        "flag": True,
        "off": False,
        "lr": 1e-3,
        "neg": -2,
        "n_head": 2,
        "empty": "",
        "spec": "a=b",
    }
    assert isinstance(parse_set_options(["n=4"])["n"], int)
    assert isinstance(parse_set_options(["d=0.0"])["d"], float)
    assert parse_set_options(["n=1", "n=2"]) == {"n": 2}
    assert parse_set_options([]) == {}


@pytest.mark.parametrize("item", ["n_layer", "=4", "1x=2", "a b=1"])
def test_parse_set_options_rejects_malformed_items(item: str) -> None:
    with pytest.raises(UsageError, match=re.escape(repr(item))):
        parse_set_options([item])


def test_set_options_feed_load_model() -> None:
    model, _, _ = _build("gpt", **parse_set_options(["n_layer=1", "n_embd=16", "n_head=2"]))
    assert len(model.blocks) == 1
