"""Models that already checkpoint themselves (issue 13, item 7): remat never checkpoints twice.

Three ways a model arrives checkpointing, one decision each (see remat.runtime.existing):
transformers' ``gradient_checkpointing_enable`` and torch's ``checkpoint_wrapper`` are taken
off while profiling (and put back exactly) and make ``remat.apply`` refuse with the fix;
``torch.utils.checkpoint`` called in a block's forward makes profiling refuse. After every
refusal the model is exactly as before.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.utils.checkpoint
from torch import nn
from torch.utils.checkpoint import checkpoint as imported_checkpoint

import remat
from remat import plans
from remat.core.errors import UsageError
from remat.runtime.existing import find, recomputed_stages
from remat.runtime.install import applied

D = 16


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(D, 4 * D)
        self.fc2 = nn.Linear(4 * D, D)
        self.norm = nn.BatchNorm1d(D)  # running statistics: buffers a step changes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x))))


class CheckpointingBlock(Block):
    """A block whose forward checkpoints itself, written three ways."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        inner = super().forward
        if self.how == "reentrant":
            out = torch.utils.checkpoint.checkpoint(inner, x, use_reentrant=True)
        elif self.how == "non-reentrant":
            out = torch.utils.checkpoint.checkpoint(inner, x, use_reentrant=False)
        else:  # imported under another name before any test ran
            out = imported_checkpoint(inner, x, use_reentrant=False)
        assert isinstance(out, torch.Tensor)
        return out


class Net(nn.Module):
    def __init__(self, blocks: list[nn.Module]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.head = nn.Linear(D, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def loss_fn(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return model(batch).pow(2).mean()


def _batch() -> torch.Tensor:
    return torch.randn(32, D, generator=torch.Generator().manual_seed(1))


STAGES = [f"blocks.{i}" for i in range(4)]


def _state(model: nn.Module) -> dict[str, Any]:
    """Everything remat could leave behind: values, grads, instance attributes, hooks."""
    modules = dict(model.named_modules())
    return {
        "tensors": {k: v.clone() for k, v in model.state_dict(keep_vars=False).items()},
        "grads": {
            k: None if p.grad is None else p.grad.clone() for k, p in model.named_parameters()
        },
        "attributes": {
            path: {
                k: v
                for k, v in vars(m).items()
                if not k.startswith("_") or k in ("_gradient_checkpointing_func",)
            }
            for path, m in modules.items()
        },
        "forwards": {path: m.__dict__.get("forward") for path, m in modules.items()},
        "hooks": {
            path: (len(m._forward_hooks), len(m._forward_pre_hooks), len(m._backward_hooks))
            for path, m in modules.items()
        },
        "rng": torch.random.get_rng_state(),
    }


def _same(before: dict[str, Any], after: dict[str, Any]) -> None:
    assert before["tensors"].keys() == after["tensors"].keys()
    for key, value in before["tensors"].items():
        assert torch.equal(value, after["tensors"][key]), key
    for key, grad in before["grads"].items():
        other = after["grads"][key]
        assert (grad is None and other is None) or torch.equal(grad, other), key
    assert before["forwards"] == after["forwards"]
    assert before["hooks"] == after["hooks"]
    assert before["rng"].equal(after["rng"])
    for path, attributes in before["attributes"].items():
        now = after["attributes"][path]
        assert attributes.keys() == now.keys(), path
        for key, value in attributes.items():
            if not isinstance(value, torch.Tensor):
                assert now[key] is value or now[key] == value, (path, key)


# -- a forward that calls torch.utils.checkpoint: profiling refuses ------------------------


@pytest.mark.parametrize("how", ["reentrant", "non-reentrant", "imported"])
def test_a_checkpoint_call_in_a_forward_is_seen_however_it_is_written(how: str) -> None:
    blocks: list[nn.Module] = [Block(), CheckpointingBlock(how), Block(), Block()]
    model = Net(blocks)
    assert recomputed_stages(model, _batch(), loss_fn, STAGES) == ["blocks.1"]
    # the control: the same model without the call recomputes nothing
    assert recomputed_stages(Net([Block() for _ in range(4)]), _batch(), loss_fn, STAGES) == []


def test_profiling_refuses_a_checkpoint_call_and_leaves_the_model_exactly_as_before() -> None:
    torch.manual_seed(0)
    model = Net([CheckpointingBlock("non-reentrant") for _ in range(4)])
    model.eval()  # profiling trains; the mode must come back too
    loss_fn(model.train(), _batch()).backward()  # grads and running statistics to keep
    model.eval()
    before = _state(model)
    with pytest.raises(UsageError) as caught:
        remat.profile(model, _batch(), loss_fn, repeats=1, options=("keep",))
    message = str(caught.value)
    assert "stages 'blocks.0', 'blocks.1', 'blocks.2' and 1 more are recomputed" in message
    assert "remove that checkpoint call" in message and "\n" not in message
    assert not model.training
    _same(before, _state(model))
    assert not applied(model)
    with pytest.raises(UsageError, match="no remat plan is applied"):
        remat.remove(model)


# -- torch's checkpoint_wrapper: taken off for profiling, refused by apply -----------------


def _wrapped() -> nn.Module:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    torch.manual_seed(0)
    model = Net([Block() for _ in range(4)])
    for i, block in enumerate(list(model.blocks)):
        model.blocks[i] = checkpoint_wrapper(block)
    return model


def test_checkpoint_wrapper_is_profiled_as_the_module_it_wraps_and_put_back() -> None:
    model = _wrapped()
    assert find(model).wrappers == tuple(STAGES)
    before = _state(model)
    with pytest.warns(UserWarning, match=r"checkpoint_wrapper \(blocks.0, blocks.1, blocks.2"):
        prof = remat.profile(model, _batch(), loss_fn, repeats=1, options=("keep",))
    # the same stages (the wrappers' paths), each saving its insides (9x its input here):
    # the wrapper's checkpoint was really off (on, the profile reads 0 bytes for each)
    assert [s.name for s in prof.stages] == STAGES
    assert all(s.saved_bytes["keep"] > 2 * s.boundary_bytes for s in prof.stages)
    # put back: the wrappers checkpoint again (only the profiling step's weights moved)
    after = _state(model)
    assert after["forwards"] == before["forwards"] and after["hooks"] == before["hooks"]
    assert recomputed_stages(model, _batch(), loss_fn, STAGES) == STAGES


def test_apply_refuses_a_plan_over_checkpoint_wrapper_and_changes_nothing() -> None:
    model = _wrapped()
    before = _state(model)
    with pytest.raises(UsageError) as caught:
        remat.apply(model, plans.per_stage(model, stages=STAGES))
    message = str(caught.value)
    assert "module 'blocks.0' is wrapped in torch's checkpoint_wrapper" in message
    assert "checkpoint stage 'blocks.0' twice" in message and "\n" not in message
    _same(before, _state(model))
    assert not applied(model)
    with pytest.raises(UsageError, match="no remat plan is applied"):
        remat.remove(model)
    # a plan that checkpoints nothing there wraps nothing twice: allowed
    remat.apply(model, plans.none(model, stages=STAGES)).remove()


# -- transformers' gradient_checkpointing_enable -------------------------------------------

TINY = {
    "num_hidden_layers": 2,
    "hidden_size": 32,
    "num_attention_heads": 2,
    "vocab_size": 64,
    "seq_len": 32,
    "batch_size": 2,
    "dropout": 0.0,
}


@pytest.fixture
def hf_llama() -> tuple[nn.Module, Any, Any]:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    pytest.importorskip("transformers")
    from remat.benchmarking.runners import enable_hf_gc
    from remat.models import load_model

    model, batch, hf_loss = load_model("hf:llama", **TINY)
    enable_hf_gc(model)  # transformers' own gradient_checkpointing_enable, non-reentrant
    return model, batch, hf_loss


def test_apply_refuses_a_model_with_transformers_checkpointing_on(
    hf_llama: tuple[nn.Module, Any, Any],
) -> None:
    model, batch, hf_loss = hf_llama
    layers = ["model.layers.0", "model.layers.1"]
    assert set(layers) <= set(find(model).flagged)
    before = _state(model)
    with pytest.raises(UsageError) as caught:
        remat.apply(model, plans.per_stage(model, stages=layers))
    message = str(caught.value)
    assert "its own gradient checkpointing on" in message
    fix = next(
        name
        for name in ("activation_checkpointing_disable", "gradient_checkpointing_disable")
        if hasattr(model, name)  # transformers 5 renamed it
    )
    assert f"model.{fix}()" in message and "\n" not in message
    _same(before, _state(model))
    with pytest.raises(UsageError, match="no remat plan is applied"):
        remat.remove(model)
    # the fix the sentence gives works
    getattr(model, fix)()
    assert not find(model)
    remat.apply(model, plans.per_stage(model, stages=layers))
    hf_loss(model, batch).backward()
    remat.remove(model)


def test_profiling_takes_transformers_checkpointing_off_and_puts_it_back(
    hf_llama: tuple[nn.Module, Any, Any],
) -> None:
    model, batch, hf_loss = hf_llama
    layers = ["model.layers.0", "model.layers.1"]
    flagged = find(model).flagged
    functions = [m.__dict__.get("_gradient_checkpointing_func") for m in model.modules()]
    with pytest.warns(UserWarning, match="taken off while profiling and put back"):
        prof = remat.profile(model, batch, hf_loss, repeats=1, options=("keep",))
    # the layers saved their insides (with the flag on they would keep only their input)
    assert [s.name for s in prof.stages] == layers
    assert all(s.saved_bytes["keep"] > 2 * s.boundary_bytes for s in prof.stages)
    # put back exactly: the same modules flagged, the same checkpoint functions, and the
    # layers checkpoint again
    assert find(model).flagged == flagged
    assert [m.__dict__.get("_gradient_checkpointing_func") for m in model.modules()] == functions
    assert recomputed_stages(model, batch, hf_loss, layers) == layers
