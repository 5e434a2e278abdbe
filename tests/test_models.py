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

from remat.core.errors import UsageError
from remat.models import BUILTINS, DEFAULT_MODEL, load_model, parse_set_options
from remat.models.convnet_bn import ResBlock
from remat.models.gpt import Block
from remat.models.mlp_hetero import DEFAULT_PATTERN, HeteroBlock

# The built-ins with one ``blocks`` container; the shaped models have their own section.
NAMES = ["gpt", "mlp-hetero", "convnet-bn"]
SHAPED = ["resnet", "convnext", "encdec", "unet"]
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
    assert set(BUILTINS) == {"gpt", "mlp-hetero", "convnet-bn", *SHAPED, "mobilenet",
                             "efficientnet", "vgg"}
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
    with pytest.raises(UsageError, match="unknown block kind 'x'; use one of 'w', 'n'"):
        HeteroBlock("x", 8, expansion=2, depth=1)


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


# --- resnet, convnext, encdec, unet: the shapes users bring --------------------------------

SHAPED_SMALL: dict[str, dict[str, Any]] = {
    "resnet": {"width": 4, "image_size": 16, "batch_size": 2},
    "convnext": {"width": 4, "depths": "1,1,2,1", "image_size": 32, "batch_size": 2},
    "encdec": {
        "n_encoder_layers": 2,
        "n_decoder_layers": 2,
        "d_model": 16,
        "d_ff": 32,
        "vocab_size": 32,
        "src_len": 6,
        "tgt_len": 5,
        "batch_size": 2,
    },
    "unet": {"channels": 8, "levels": 2, "image_size": 8, "batch_size": 2},
}
SHAPED_KEYS = {
    "resnet": ("images", "labels"),
    "convnext": ("images", "labels"),
    "encdec": ("input_ids", "decoder_input_ids", "labels"),
    "unet": ("noisy", "timesteps", "noise"),
}


def _train_step(name: str, seed: int, rng: int) -> tuple[float, dict[str, torch.Tensor]]:
    """One SGD step at ``seed``, forward RNG seeded with ``rng``: the loss and new weights."""
    model, batch, loss_fn = _build(name, seed=seed, **SHAPED_SMALL[name])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(rng)
    loss = loss_fn(model, batch)
    loss.backward()
    for pname, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), pname
    opt.step()
    return loss.item(), {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("name", SHAPED)
def test_shaped_models_train_at_defaults(name: str) -> None:
    model, batch, loss_fn = _build(name)
    assert model.training
    loss = loss_fn(model, batch)
    assert loss.dim() == 0 and torch.isfinite(loss)
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("name", SHAPED)
def test_shaped_models_train_deterministically_under_their_seed(name: str) -> None:
    loss_a, state_a = _train_step(name, seed=1, rng=7)
    loss_b, state_b = _train_step(name, seed=1, rng=7)
    loss_c, state_c = _train_step(name, seed=2, rng=7)
    assert loss_a == loss_b
    assert all(torch.equal(state_a[k], state_b[k]) for k in state_a)
    assert loss_a != loss_c
    assert not all(torch.equal(state_a[k], state_c[k]) for k in state_a)


@pytest.mark.parametrize("name", SHAPED)
def test_shaped_models_leave_the_global_rng_alone(name: str) -> None:
    before = torch.get_rng_state()
    load_model(name, **SHAPED_SMALL[name])
    assert torch.equal(before, torch.get_rng_state())


@pytest.mark.parametrize("name", SHAPED)
def test_shaped_models_take_a_dict_batch(name: str) -> None:
    model, batch, loss_fn = _build(name, **SHAPED_SMALL[name])
    model.eval()
    as_dict = dict(zip(SHAPED_KEYS[name], batch, strict=True))
    assert torch.equal(loss_fn(model, batch), loss_fn(model, as_dict))


def test_resnet_has_four_layers_of_basic_blocks_downsampling_from_layer2() -> None:
    from remat.models.resnet import BasicBlock

    model, (images, _), _ = _build("resnet")
    assert images.shape == (16, 3, 32, 32)
    for i in range(1, 5):
        layer = getattr(model, f"layer{i}")
        assert isinstance(layer, nn.Sequential) and len(layer) == 2
        assert all(isinstance(b, BasicBlock) for b in layer)
        assert (layer[0].downsample is None) == (i == 1)
        assert layer[1].downsample is None
    assert model.fc.in_features == 8 * 8


def test_convnext_stages_downsample_then_run_their_blocks() -> None:
    from remat.models.convnext import ConvNeXtBlock

    model, _, _ = _build("convnext", depths="1,2,3,1")
    assert [len(stage.blocks) for stage in model.stages] == [1, 2, 3, 1]
    assert isinstance(model.stages[0].downsample, nn.Identity)
    assert all(isinstance(s.downsample, nn.Sequential) for s in model.stages[1:])
    assert all(isinstance(b, ConvNeXtBlock) for s in model.stages for b in s.blocks)
    with pytest.raises(UsageError, match="depths='1,2'"):
        load_model("convnext", depths="1,2")
    with pytest.raises(UsageError, match="image_size=48"):
        load_model("convnext", image_size=48)


def test_encdec_decoder_blocks_get_the_encoder_output() -> None:
    model, batch, loss_fn = _build("encdec", **SHAPED_SMALL["encdec"])
    assert isinstance(model.encoder.block, nn.ModuleList)
    assert isinstance(model.decoder.block, nn.ModuleList)
    seen: list[tuple[str, int]] = []
    for stack in ("encoder", "decoder"):
        for block in getattr(model, stack).block:
            block.register_forward_pre_hook(
                lambda _m, args, stack=stack: seen.append((stack, len(args)))
            )
    loss_fn(model, batch)
    assert seen == [("encoder", 1)] * 2 + [("decoder", 2)] * 2
    assert any(isinstance(m, nn.Dropout) and m.p > 0 for m in model.modules())


def test_unet_resnets_get_temb_by_keyword_and_up_blocks_concatenate_skips() -> None:
    from remat.models.unet import ResnetBlock

    model, batch, loss_fn = _build("unet", **SHAPED_SMALL["unet"])
    calls: list[tuple[int, tuple[str, ...]]] = []
    for m in model.modules():
        if isinstance(m, ResnetBlock):
            m.register_forward_pre_hook(
                lambda _m, args, kwargs: calls.append((len(args), tuple(kwargs))),
                with_kwargs=True,
            )
    loss_fn(model, batch)
    # 2 levels x 2 resnets down, 2 in the middle, 2 x 2 up.
    assert calls == [(1, ("temb",))] * 10
    up0 = model.up_blocks[0].resnets[0]
    assert up0.norm1.num_channels == 2 * up0.conv1.out_channels  # h and the skip, concatenated
    assert any(isinstance(m, nn.Dropout) and m.p > 0 for m in model.modules())
    with pytest.raises(UsageError, match="image_size=10"):
        load_model("unet", image_size=10)


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


def test_load_model_from_a_file_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "my_model.py").write_text(USER_MODULE)
    monkeypatch.chdir(tmp_path)  # a relative path, not importable as a module from here
    model, batch, loss_fn = load_model("my_model.py:build", width=3)
    assert isinstance(model, nn.Linear) and model.in_features == 3
    assert loss_fn(model, batch).dim() == 0
    again, _, _ = load_model(f"{tmp_path / 'my_model.py'}:build", width=3)
    assert type(again).__module__ == type(model).__module__  # one module per file


def test_a_model_file_that_is_missing_or_raises_says_so(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match=r"model file '.*nothing\.py' does not exist"):
        load_model(f"{tmp_path / 'nothing.py'}:build")
    broken = tmp_path / "broken.py"
    broken.write_text("raise RuntimeError('no GPU here')\n")
    with pytest.raises(RuntimeError, match="no GPU here"):  # the user's code: CLI exit 3
        load_model(f"{broken}:build")
    assert not any(name.endswith("_broken") for name in sys.modules)


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
    assert parse_set_options([]) == {}


@pytest.mark.parametrize("items", [["n=1", "n=2"], ["n=1", "n=1"], ["n-head=1", "n_head=2"]])
def test_parse_set_options_refuses_a_key_given_twice(items: list[str]) -> None:
    key = items[0].partition("=")[0].replace("-", "_")
    with pytest.raises(UsageError, match=f"--set names '{key}' twice"):
        parse_set_options(items)


@pytest.mark.parametrize("item", ["n_layer", "=4", "1x=2", "a b=1"])
def test_parse_set_options_rejects_malformed_items(item: str) -> None:
    with pytest.raises(UsageError, match=re.escape(repr(item))):
        parse_set_options([item])


def test_set_options_feed_load_model() -> None:
    model, _, _ = _build("gpt", **parse_set_options(["n_layer=1", "n_embd=16", "n_head=2"]))
    assert len(model.blocks) == 1
