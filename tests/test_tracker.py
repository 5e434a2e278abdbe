"""LiveMemoryTracker and measure_step: exact byte counts worked out by hand from shapes."""

from __future__ import annotations

import copy
import gc
import json
import weakref
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from remat.core.errors import UsageError
from remat.measure import (
    Category,
    LiveMemoryTracker,
    Phase,
    StepMemory,
    measure_step,
)

F32 = 4  # bytes per float32 element

# The Linear chain used below: L bias-free Linear(D, D) layers on an input of B rows.
B, D = 8, 32
A = B * D * F32  # one activation h_i (B x D): 1024 bytes
G = D * D * F32  # one weight, and one weight's gradient (D x D): 4096 bytes
X = A  # the input batch has the activation's shape
LOSS = F32  # the scalar loss
SEED = F32  # the ones_like(loss) that loss.backward() seeds autograd with


def _chain(layers: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(D, D, bias=False) for _ in range(layers)])


def _input() -> torch.Tensor:
    return torch.randn(B, D, generator=torch.Generator().manual_seed(1))


def test_storage_object_is_preserved() -> None:
    # Note [Counting storages] relies on this torch behaviour: one Python storage object per
    # live storage, shared by views, dying exactly when the storage is freed.
    t = torch.zeros(16)
    view = t[4:]
    storage = t.untyped_storage()
    assert view.untyped_storage() is storage
    freed: list[int] = []
    ref = weakref.ref(storage, lambda _: freed.append(1))
    del storage
    gc.collect()
    assert ref() is t.untyped_storage() and not freed
    del t
    assert not freed  # the view still holds the storage
    del view
    assert freed == [1]


def test_linear_chain_forward_and_backward_exact() -> None:
    model, x = _chain(3), _input()
    params = 3 * G
    tracker = LiveMemoryTracker()
    assert tracker.register_existing(model) == params
    assert tracker.register_existing(x) == X
    tracker.watch(model)
    with tracker:
        with tracker.phase("forward"):
            loss = model(x).sum()
            # h1 = x W1^T, h2, h3 are A each; mm saves its input, so h1 and h2 are saved by
            # layers 2 and 3 (x is the batch); h3 died after sum, which saves nothing.
            after_forward = tracker.live_by_category
        with tracker.phase("backward"):
            loss.backward()
    report = tracker.report()

    assert after_forward.parameters_bytes == params
    assert after_forward.inputs_bytes == X
    assert after_forward.activations_bytes == 2 * A
    assert after_forward.temporaries_bytes == LOSS
    assert after_forward.gradients_bytes == 0
    # Forward peak: the sum's output is made while h3 is still alive.
    assert report.phase_peaks.forward_bytes == params + X + 3 * A + LOSS

    # Backward, node by node (the seed stays alive through the whole backward):
    #   layer 3: grad_h2 (A) and grad W3 (G); then h2 is released.
    #   layer 2: grad_h1 (A) and grad W2 (G); then h1 and grad_h2 are released.
    #   layer 1: grad W1 (G) only (x needs no grad): the peak.
    peak = params + X + 3 * G + A + LOSS + SEED
    assert peak == 26632
    assert report.peak_bytes == peak
    assert report.phase_peaks.backward_bytes == peak
    assert report.peak_phase is Phase.BACKWARD
    assert report.peak_module_path == "0"
    at_peak = report.peak_by_category
    assert at_peak.parameters_bytes == params
    assert at_peak.gradients_bytes == 3 * G  # grad W1 counts as a gradient at its own peak
    assert at_peak.inputs_bytes == X
    assert at_peak.temporaries_bytes == A + LOSS + SEED  # grad_h1, loss, seed
    assert at_peak.activations_bytes == 0
    assert at_peak.total_bytes == peak
    # After backward grad_h1 and the seed are gone; the loss is still referenced here.
    assert report.live_bytes == params + X + 3 * G + LOSS
    assert report.live_by_category.gradients_bytes == 3 * G


def test_view_costs_nothing() -> None:
    x = torch.randn(64, 16)
    stranger = torch.randn(100)  # never registered: neither it nor its views count
    tracker = LiveMemoryTracker()
    tracker.register_existing([x, x.t(), x[3:]])  # three tensors, one storage
    assert tracker.live_bytes == 64 * 16 * F32
    with tracker:
        views = [
            x.view(16, 64),
            x.t(),
            x[1:5, ::2],
            x.detach(),
            x.unsqueeze(0),
            x.expand(2, 64, 16),
        ]
        views.append(stranger.view(10, 10))
        assert tracker.live_bytes == 64 * 16 * F32
        fresh = x.contiguous().view(-1)  # x is already contiguous: still a view
        assert tracker.live_bytes == 64 * 16 * F32
        copy_ = x.t().contiguous()  # a real copy: one more storage of the same size
        assert tracker.live_bytes == 2 * 64 * 16 * F32
    assert tracker.peak_bytes == 2 * 64 * 16 * F32
    del views, fresh, copy_


def test_in_place_costs_nothing_and_out_growth_counts() -> None:
    x = torch.randn(1000)
    tracker = LiveMemoryTracker()
    tracker.register_existing(x)
    with tracker:
        x.mul_(2).add_(1)
        x[10:20].zero_()
        x.clamp_(min=0)
        torch.add(x, 1, out=x)
        assert tracker.live_bytes == 1000 * F32
        out = torch.empty(0)  # a zero-byte storage
        assert tracker.live_bytes == 1000 * F32
        torch.mul(x, 3, out=out)  # out= resizes the storage in place: 1000 floats more
        assert tracker.live_bytes == 2000 * F32
    assert tracker.peak_bytes == 2000 * F32
    del out


def test_freed_temporary_is_in_peak_not_in_live() -> None:
    tracker = LiveMemoryTracker(timeline=True)
    with tracker:
        kept = torch.ones(100)  # 400 bytes
        tmp = torch.ones(1000)  # 4000 bytes
        total = (tmp * 2).sum()  # tmp * 2 lives only during the sum: 4000 bytes more
        del tmp
        assert tracker.live_bytes == 400 + LOSS
    report = tracker.report()
    assert report.peak_bytes == 400 + 4000 + 4000 + 4
    assert report.live_bytes == 400 + 4
    assert report.timeline is not None
    names = [e.name for e in report.timeline]
    assert names.count("free") == 2
    assert report.timeline[-1].live_bytes == 404
    assert [e.index for e in report.timeline] == sorted(e.index for e in report.timeline)
    del kept, total


def test_tensor_literal_counts_and_meta_does_not() -> None:
    with LiveMemoryTracker() as tracker:
        t = torch.tensor([1.0, 2.0, 3.0])  # built outside the dispatcher, then lift_fresh
        m = torch.empty(1 << 20, device="meta")
        assert tracker.live_bytes == 3 * F32
    del t, m


def test_shared_parameters_count_once() -> None:
    model = nn.Sequential(nn.Linear(8, 8, bias=False), nn.Linear(8, 8, bias=False))
    model[1].weight = model[0].weight  # tied
    tracker = LiveMemoryTracker()
    assert tracker.register_existing(model) == 8 * 8 * F32
    assert tracker.live_by_category.parameters_bytes == 8 * 8 * F32


def test_checkpoint_drops_the_saved_bytes_of_its_inside() -> None:
    # Four layers; layers 2 and 3 (indices 1, 2) run as one non-reentrant checkpoint region.
    # Without it, h1, h2, h3 are saved (mm saves its input). With it, the region keeps only
    # its input h1 and the inside h2 is not kept: saved bytes drop by exactly one A.
    def run(ckpt: bool) -> tuple[int, int, LiveMemoryTracker, list[torch.Tensor]]:
        model, x = _chain(4), _input()
        tracker = LiveMemoryTracker()
        tracker.register_existing(model)
        tracker.register_existing(x)
        tracker.watch(model)
        with tracker:
            h = model[0](x)
            if ckpt:
                h = checkpoint(lambda t: model[2](model[1](t)), h, use_reentrant=False)
            else:
                h = model[2](model[1](h))
            loss = model[3](h).sum()
            del h
            live, saved = tracker.live_bytes, tracker.live_by_category.activations_bytes
            loss.backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        return live, saved, tracker, grads

    live_plain, saved_plain, plain, grads_plain = run(ckpt=False)
    live_ckpt, saved_ckpt, ckpt, grads_ckpt = run(ckpt=True)
    assert saved_plain == 3 * A
    assert saved_ckpt == 2 * A
    assert live_plain - live_ckpt == A
    assert live_ckpt == 4 * G + X + 2 * A + LOSS
    assert plain.phase_peaks.rebuild_bytes is None
    assert ckpt.phase_peaks.rebuild_bytes is not None
    assert len(grads_ckpt) == 4
    for g_plain, g_ckpt in zip(grads_plain, grads_ckpt, strict=True):
        assert torch.equal(g_plain, g_ckpt)


def test_inplace_on_saved_tensor_still_raises() -> None:
    x = torch.randn(5, requires_grad=True)
    with LiveMemoryTracker():
        y = x.exp()  # exp saves its output
        y.mul_(2)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            y.sum().backward()


def test_timeline_is_optional_and_bounded() -> None:
    with LiveMemoryTracker() as off:
        torch.ones(3) + 1
    assert off.timeline is None
    with LiveMemoryTracker(timeline=True, max_events=2) as bounded:
        for _ in range(5):
            torch.ones(3) + 1
    report = bounded.report()
    assert report.timeline is not None and len(report.timeline) == 2
    assert report.timeline_truncated


def test_bad_arguments_raise_usage_errors() -> None:
    tracker = LiveMemoryTracker()
    with pytest.raises(UsageError, match="category"):
        tracker.register_existing(torch.ones(1), "weights")
    with pytest.raises(UsageError, match="register_existing got a int"):
        tracker.register_existing(3)
    with pytest.raises(UsageError, match="phase"), tracker.phase("sideways"):
        pass
    with pytest.raises(UsageError, match="watch got"):
        tracker.watch(torch.ones(1))  # type: ignore[arg-type]
    with tracker, pytest.raises(UsageError, match="already active"), tracker:
        pass
    model = nn.Linear(2, 2)
    with pytest.raises(UsageError, match="optimizer 'lion'"):
        measure_step(model, torch.ones(1, 2), lambda m, b: m(b).sum(), "lion")
    with pytest.raises(UsageError, match="warmup_steps"):
        measure_step(model, torch.ones(1, 2), lambda m, b: m(b).sum(), warmup_steps=-1)
    with pytest.raises(UsageError, match="scalar loss"):
        measure_step(model, torch.ones(1, 2), lambda m, b: m(b))


def _no_hooks_left(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
    for module in model.modules():
        assert not module._forward_hooks and not module._forward_pre_hooks
    for p in model.parameters():
        assert not p._post_accumulate_grad_hooks
    if optimizer is not None:
        assert not optimizer._optimizer_step_pre_hooks
        assert not optimizer._optimizer_step_post_hooks
    assert torch._C._len_torch_dispatch_stack() == 0
    assert torch._C._len_torch_function_stack() == 0
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None


def test_measure_step_sgd_exact() -> None:
    model, x = _chain(3), _input()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    step = measure_step(model, x, lambda m, b: m(b).sum(), opt, timeline=True)
    params = momentum = 3 * G
    # The step starts with parameters, SGD's momentum buffers and the batch; CPU SGD updates
    # in place, so the peak is backward's (see the chain test) plus the momentum buffers.
    assert step.start_bytes == params + momentum + X
    assert step.peak_bytes == params + momentum + X + 3 * G + A + LOSS + SEED
    assert step.peak_by_category.optimizer_state_bytes == momentum
    assert step.peak_by_category.gradients_bytes == 3 * G
    assert step.peak_phase is Phase.BACKWARD
    assert step.phase_peaks.optimizer_bytes == params + momentum + X + 3 * G
    assert step.end_bytes == params + momentum + X + 3 * G  # loss freed, grads not yet zeroed
    assert step.cuda_allocated_peak_bytes is None and step.cuda_reserved_peak_bytes is None
    assert step.timeline is not None
    assert {e.phase for e in step.timeline} == {Phase.FORWARD, Phase.BACKWARD, Phase.OPTIMIZER}
    assert all(p.grad is None for p in model.parameters())
    _no_hooks_left(model, opt)
    json.dumps(step.to_dict())


def test_measure_step_adamw_counts_state_from_the_start() -> None:
    model, x = _chain(2), _input()
    step = measure_step(model, x, lambda m, b: m(b).sum(), "adamw")
    # AdamW keeps exp_avg and exp_avg_sq per parameter, plus a float32 step counter each.
    state = 2 * (2 * G) + 2 * F32
    assert step.start_bytes == 2 * G + state + X
    assert isinstance(step, StepMemory)
    assert step.peak_by_category.get(Category.OPTIMIZER_STATE) == state
    assert step.peak_by_category.total_bytes == step.peak_bytes


def _memtracker_peak(model: nn.Module, batch: Any, loss_fn: Any) -> int:
    from torch.distributed._tools.mem_tracker import MemTracker

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss_fn(model, batch).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    gc.collect()
    mt = MemTracker()
    mt.track_external(model, opt, batch)
    with mt:
        loss = loss_fn(model, batch)
        loss.backward()
        del loss
        opt.step()
    opt.zero_grad(set_to_none=True)
    return sum(snap["Total"] for snap in mt.get_tracker_snapshot("peak").values())


def _small_mlp() -> tuple[nn.Module, Any, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 10)
    )
    batch = (torch.randn(32, 64), torch.randint(0, 10, (32,)))

    def loss_fn(m: nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return nn.functional.cross_entropy(m(b[0]), b[1])

    return model, batch, loss_fn


@pytest.mark.parametrize("name", ["small-mlp", "gpt", "mlp-hetero", "convnet-bn"])
def test_cross_check_against_torch_memtracker(name: str) -> None:
    """Cross-check only: torch's MemTracker is an independent implementation of the same idea."""
    if name == "small-mlp":
        model, batch, loss_fn = _small_mlp()
    else:
        models = pytest.importorskip("remat.models")
        model, batch, loss_fn = models.load_model(name)
    twin = copy.deepcopy(model)
    ours = measure_step(model, batch, loss_fn, "adamw")
    theirs = _memtracker_peak(twin, batch, loss_fn)
    assert abs(ours.peak_bytes - theirs) <= 0.02 * theirs


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_allocator_peaks_bound_the_tracker() -> None:
    model, x = _chain(3), _input()
    model, x = model.cuda(), x.cuda()
    step = measure_step(model, x, lambda m, b: m(b).sum(), "sgd")
    assert step.cuda_allocated_peak_bytes is not None
    assert step.cuda_reserved_peak_bytes is not None
    # The allocator also counts what the tracker cannot see (cuBLAS workspaces, anything
    # allocated before and not registered); reserved adds cached blocks on top.
    assert step.cuda_reserved_peak_bytes >= step.cuda_allocated_peak_bytes >= step.peak_bytes
