"""A checkpoint frame holds its call's arguments from before the chain to its backward.

hf:llama with a padded attention mask: transformers passes every layer a 4-D bool mask
and the position ids, which the model lets go of at its forward's return under keep; a
selective frame on layer 0 keeps them to layer 0's backward, where the peak at the top of
the backward was measured 16,896 bytes over the prediction before the simulator counted
them (Note [Arguments a checkpoint frame holds] in remat.core.solve.simulator).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import remat  # noqa: E402
from remat.core.plan_format import Plan, Region  # noqa: E402
from remat.core.planner import to_problem  # noqa: E402
from remat.core.solve.simulator import simulate  # noqa: E402
from remat.measure.step import measure_step  # noqa: E402
from remat.models import load_model  # noqa: E402

SAVE_MATMULS = "selective:save-matmuls"


@pytest.fixture(scope="module", params=["padded", "unpadded"])
def llama(request):
    torch.manual_seed(0)
    model, batch, loss_fn = load_model("hf:llama", seq_len=64, batch_size=4)
    batch = dict(batch)
    if request.param == "padded":
        mask = batch["attention_mask"].clone()
        mask[0, 40:] = 0
        mask[1, 50:] = 0
        labels = batch["labels"].clone()
        labels[mask == 0] = -100
        batch["attention_mask"], batch["labels"] = mask, labels
    profile = remat.profile(model, batch, loss_fn, repeats=1, options=("keep", SAVE_MATMULS))
    return request.param, model, batch, loss_fn, profile


def _measured(model, batch, loss_fn, plan):
    handle = remat.apply(model, plan)
    try:
        step = measure_step(model, batch, loss_fn, torch.optim.AdamW(model.parameters(), lr=0))
    finally:
        handle.remove()
    return step.peak_bytes


def test_selective_first_stage_frame_holds_args_to_its_backward(llama):
    kind, model, batch, loss_fn, profile = llama
    n = len(profile.stages)
    plans = [
        Plan(profile.stage_names, options=(SAVE_MATMULS,) + ("keep",) * (n - 1)),
        Plan(profile.stage_names, options=("keep",) * n),
        Plan(profile.stage_names, regions=(Region(0, 2),)),
    ]
    problem = to_problem(profile)
    for plan in plans:
        predicted = simulate(plan, problem).peak_bytes
        assert _measured(model, batch, loss_fn, plan) == predicted, (kind, plan)
    # the mask (4 x 1 x 64 x 64 bools) and the position ids (1 x 64 int64)
    assert profile.fixed.args_at_return_bytes == (16_384 + 512 if kind == "padded" else 512)
