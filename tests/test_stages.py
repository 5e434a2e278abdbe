"""Stage discovery: the chain of repeated blocks over the whole model, in call order."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from torch import nn

from conftest import TanhBlock
from remat.core.errors import UsageError
from remat.models import load_model
from remat.runtime.stages import Chain, discover_chain, discover_stages, resolve_stages


class TwoStacks(nn.Module):
    """A long stack that the forward never calls and a shorter one that it calls backwards."""

    def __init__(self) -> None:
        super().__init__()
        self.unused = nn.ModuleList(TanhBlock(4) for _ in range(6))
        self.layers = nn.ModuleList(TanhBlock(4) for _ in range(3))
        self.head = nn.Sequential(nn.Linear(4, 4), nn.ReLU())  # mixed classes: not a chain

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in reversed(self.layers):
            x = layer(x)
        return self.head(x).sum()


def test_without_a_batch_the_largest_same_class_container_wins() -> None:
    assert discover_stages(TwoStacks()) == [f"unused.{i}" for i in range(6)]


def test_with_a_batch_only_called_containers_count_in_call_order() -> None:
    model = TwoStacks()
    assert discover_stages(model, torch.randn(2, 4)) == ["layers.2", "layers.1", "layers.0"]


def test_loss_fn_runs_the_forward_and_training_mode_is_kept() -> None:
    model = TwoStacks().train()
    stages = discover_stages(model, {"x": torch.randn(2, 4)}, lambda m, b: m(b["x"]))
    assert stages == ["layers.2", "layers.1", "layers.0"]
    assert model.training


def test_sequential_root_and_no_container() -> None:
    seq = nn.Sequential(*(TanhBlock(3) for _ in range(4)))
    assert discover_stages(seq) == ["0", "1", "2", "3"]
    with pytest.raises(UsageError, match="no repeated-block container"):
        discover_stages(nn.Linear(2, 2))


def test_resolve_checks_paths_and_suggests_a_fix() -> None:
    model = TwoStacks()
    assert resolve_stages(model, ["layers.0", "layers.1"]) == ["layers.0", "layers.1"]
    with pytest.raises(UsageError, match=r"did you mean 'layers\.1'"):
        resolve_stages(model, ["layers.0", "layer.1"])
    with pytest.raises(UsageError, match="named twice"):
        resolve_stages(model, ["layers.0", "layers.0"])
    with pytest.raises(UsageError, match="names no module"):
        resolve_stages(model, [])


# --- the whole model's chain ----------------------------------------------------------

SMALL = {
    "gpt": {"n_layer": 3, "n_embd": 16, "n_head": 2, "block_size": 8, "batch_size": 2},
    "mlp-hetero": {"n_blocks": 4, "d_model": 16, "expansion": 8, "batch_size": 4},
    "convnet-bn": {"n_blocks": 4, "channels": 4, "image_size": 8, "batch_size": 2},
    "resnet": {"width": 4, "image_size": 16, "batch_size": 2},
    "convnext": {"width": 4, "depths": "1,1,2,1", "image_size": 32, "batch_size": 2},
    "encdec": {
        "n_encoder_layers": 2,
        "n_decoder_layers": 3,
        "d_model": 16,
        "d_ff": 32,
        "vocab_size": 32,
        "src_len": 6,
        "tgt_len": 5,
        "batch_size": 2,
    },
    "unet": {"channels": 8, "levels": 2, "image_size": 8, "batch_size": 2},
}


def _chain(name: str) -> Chain:
    model, batch, loss_fn = load_model(name, **SMALL[name])
    return discover_chain(model, batch, loss_fn)


@pytest.mark.parametrize(("name", "n"), [("gpt", 3), ("mlp-hetero", 4), ("convnet-bn", 4)])
def test_one_container_models_keep_their_blocks(name: str, n: int) -> None:
    assert _chain(name).stages == tuple(f"blocks.{i}" for i in range(n))


def test_resnet_chains_the_blocks_of_all_four_layers() -> None:
    chain = _chain("resnet")
    assert chain.stages == tuple(f"layer{i}.{j}" for i in range(1, 5) for j in range(2))
    assert chain.share > 0.8


def test_convnext_splits_its_stages_into_downsample_and_blocks() -> None:
    chain = _chain("convnext")
    assert chain.stages == (
        "stages.0.blocks.0",  # stage 0's downsample is an Identity: it saves nothing
        "stages.1.downsample", "stages.1.blocks.0",
        "stages.2.downsample", "stages.2.blocks.0", "stages.2.blocks.1",
        "stages.3.downsample", "stages.3.blocks.0",
    )  # fmt: skip
    assert chain.share > 0.9


def test_encoder_decoder_chains_the_encoder_stack_then_the_decoder_stack() -> None:
    chain = _chain("encdec")
    assert chain.stages == (
        "encoder.block.0", "encoder.block.1",
        "decoder.block.0", "decoder.block.1", "decoder.block.2",
    )  # fmt: skip


def test_unet_chains_down_mid_and_up_resnets_with_their_resampling_convs() -> None:
    chain = _chain("unet")
    assert chain.stages == (
        "down_blocks.0.resnets.0", "down_blocks.0.resnets.1", "down_blocks.0.downsample",
        "down_blocks.1.resnets.0", "down_blocks.1.resnets.1",
        "mid_block.resnets.0", "mid_block.resnets.1",
        "up_blocks.0.resnets.0", "up_blocks.0.resnets.1", "up_blocks.0.upsample",
        "up_blocks.1.resnets.0", "up_blocks.1.resnets.1",
    )  # fmt: skip
    assert chain.share > 0.9
    assert len(chain.stage_bytes) == len(chain.stages) and min(chain.stage_bytes) > 0


def test_discovery_leaves_rng_buffers_and_training_flag_alone() -> None:
    model, batch, loss_fn = load_model("resnet", **SMALL["resnet"])
    buffers = {k: v.clone() for k, v in model.named_buffers()}
    rng = torch.get_rng_state()
    discover_chain(model, batch, loss_fn)
    assert torch.equal(rng, torch.get_rng_state())
    assert all(torch.equal(buffers[k], v) for k, v in model.named_buffers())
    assert model.training


class Expert(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.fc(x))


class MoELayer(nn.Module):
    """A wide MLP (most of the memory) and a container of small experts, half of them called."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.up = nn.Linear(d, 16 * d)
        self.down = nn.Linear(16 * d, d)
        self.experts = nn.ModuleList(Expert(d) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.down(torch.tanh(self.up(x)))
        for expert in self.experts[:2]:
            x = x + expert(x)
        return x


class MoE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(MoELayer(8) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x.sum()


def test_blocks_nested_in_a_block_replace_it_only_when_they_hold_most_of_its_memory() -> None:
    chain = discover_chain(MoE(), torch.randn(4, 8))
    assert chain.stages == ("layers.0", "layers.1", "layers.2")


class SplitMe(nn.Module):
    """Outer blocks whose inner repeated blocks hold nearly all of their memory."""

    def __init__(self) -> None:
        super().__init__()
        self.outer = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(8), nn.Sequential(*(TanhBlock(8) for _ in range(3))))
            for _ in range(2)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.outer:
            x = block(x)
        return x.sum()


def test_split_blocks_bring_their_other_saving_children_as_stages() -> None:
    chain = discover_chain(SplitMe(), torch.randn(4, 8))
    assert chain.stages == (
        "outer.0.0", "outer.0.1.0", "outer.0.1.1", "outer.0.1.2",
        "outer.1.0", "outer.1.1.0", "outer.1.1.1", "outer.1.1.2",
    )  # fmt: skip


class Shared(nn.Module):
    """One stack run twice (weights shared), another once."""

    def __init__(self) -> None:
        super().__init__()
        self.twice = nn.ModuleList(TanhBlock(4) for _ in range(4))
        self.once = nn.ModuleList(TanhBlock(4) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(2):
            for block in self.twice:
                x = block(x)
        for block in self.once:
            x = block(x)
        return x.sum()


def test_blocks_that_run_twice_are_a_stage_per_call() -> None:
    # rule 2: the shared stack's blocks hold 8 of the 10 block calls' memory, so each
    # call is a stage, in call order, and the blocks run once stay stages
    assert discover_stages(Shared(), torch.randn(2, 4)) == [
        *(f"twice.{b}#0" for b in range(4)), *(f"twice.{b}#1" for b in range(4)),
        "once.0", "once.1",
    ]


class OneBlock(nn.Module):
    """One block, and a layer (no block: no children) called before and after it."""

    def __init__(self) -> None:
        super().__init__()
        self.block = TanhBlock(4)
        self.proj = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.block(self.proj(x))).sum()


def test_no_blocks_called_once_is_a_usage_error() -> None:
    with pytest.raises(UsageError, match=r"found no repeated blocks in OneBlock.*stages="):
        discover_stages(OneBlock(), torch.randn(2, 4))


def _t5(transformers: Any) -> tuple[nn.Module, Any, Any]:
    config = transformers.T5Config(
        vocab_size=64, d_model=16, d_kv=8, d_ff=32, num_layers=2, num_decoder_layers=3,
        num_heads=2, use_cache=False, decoder_start_token_id=0, pad_token_id=0,
    )  # fmt: skip
    model = transformers.T5ForConditionalGeneration(config).train()
    batch = (torch.randint(0, 64, (2, 8)), torch.randint(0, 64, (2, 6)))
    return model, batch, lambda m, b: m(input_ids=b[0], labels=b[1]).loss


def test_transformers_t5_chains_encoder_then_decoder_blocks() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    transformers = pytest.importorskip("transformers")
    model, batch, loss_fn = _t5(transformers)
    stages = discover_stages(model, batch, loss_fn)
    assert stages == [f"encoder.block.{i}" for i in range(2)] + [
        f"decoder.block.{i}" for i in range(3)
    ]


@pytest.mark.parametrize("spec", ["hf:gpt2", "hf:llama"])
def test_transformers_decoders_keep_their_layers(spec: str) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    pytest.importorskip("transformers")
    options = {"num_hidden_layers": 2, "hidden_size": 16, "num_attention_heads": 2}
    model, batch, loss_fn = load_model(spec, **options, vocab_size=32, seq_len=8, batch_size=2)
    layers = "transformer.h" if spec == "hf:gpt2" else "model.layers"
    assert discover_stages(model, batch, loss_fn) == [f"{layers}.0", f"{layers}.1"]


def test_diffusers_unet_chains_down_mid_and_up_blocks() -> None:
    diffusers = pytest.importorskip("diffusers")
    model = diffusers.UNet2DModel(
        sample_size=8, in_channels=3, out_channels=3, layers_per_block=2,
        block_out_channels=(8, 16), down_block_types=("DownBlock2D", "AttnDownBlock2D"),
        up_block_types=("AttnUpBlock2D", "UpBlock2D"), norm_num_groups=4,
    ).train()  # fmt: skip
    batch = (torch.randn(2, 3, 8, 8), torch.tensor([3, 5]))

    def loss_fn(m: nn.Module, b: Any) -> torch.Tensor:
        return nn.functional.mse_loss(m(b[0], b[1]).sample, b[0])

    chain = discover_chain(model, batch, loss_fn)
    down = [s for s in chain.stages if s.startswith("down_blocks.")]
    up = [s for s in chain.stages if s.startswith("up_blocks.")]
    assert down[:3] == ["down_blocks.0.resnets.0", "down_blocks.0.resnets.1",
                        "down_blocks.0.downsamplers.0"]  # fmt: skip
    assert "down_blocks.1.attentions.1" in down
    # the mid block calls its attention between its two resnets: a stage, not glue
    assert [s for s in chain.stages if s.startswith("mid_block.")] == [
        "mid_block.resnets.0",
        "mid_block.attentions.0",
        "mid_block.resnets.1",
    ]
    assert "up_blocks.0.attentions.2" in up and up[-1] == "up_blocks.1.resnets.2"
    assert chain.stages.index(down[-1]) < chain.stages.index("mid_block.resnets.0")
    assert chain.share > 0.8


class MidBlock(nn.Module):
    """diffusers' mid-block shape: a block, an attention-like module, a block, with a norm
    before the first block and a projection after the last (neither between them)."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.norm_in = nn.LayerNorm(d)
        self.resnets = nn.ModuleList(TanhBlock(d) for _ in range(2))
        self.mixers = nn.ModuleList([nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(),
                                                   nn.Linear(2 * d, d))])
        self.proj_out = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.resnets[0](self.norm_in(x))
        x = x + self.mixers[0](x)
        return self.proj_out(self.resnets[1](x)).sum()


def test_a_module_called_between_two_blocks_by_their_parent_is_a_stage() -> None:
    chain = discover_chain(MidBlock(), torch.randn(4, 8))
    assert chain.stages == ("resnets.0", "mixers.0", "resnets.1")
    assert all(b > 0 for b in chain.stage_bytes)


class Caller(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x: torch.Tensor, helper: nn.Module) -> torch.Tensor:
        return helper(self.fc(x))


class Overlapping(nn.Module):
    """Each caller runs a helper block it does not own, so their calls overlap."""

    def __init__(self) -> None:
        super().__init__()
        self.callers = nn.ModuleList(Caller(4) for _ in range(2))
        self.helpers = nn.ModuleList(TanhBlock(4) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for caller, helper in zip(self.callers, self.helpers, strict=True):
            x = caller(x, helper)
        return x.sum()


def test_of_two_overlapping_stages_the_one_saving_more_stays() -> None:
    chain = discover_chain(Overlapping(), torch.randn(2, 4))
    assert chain.stages == ("helpers.0", "helpers.1")
