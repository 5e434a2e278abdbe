"""Fake-tensor profiles (docs/fake.md): the profiler run under FakeTensorMode counts what the
real step holds, byte for byte, without allocating the model; plans made from it apply to
the real model."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest
import torch

import remat
from remat.cli import main
from remat.core.errors import UsageError
from remat.core.planner import to_problem
from remat.core.solve import simulate
from remat.measure import measure_step
from remat.models import load_model
from remat.profiling.fake import fake_mode_of

pytestmark = pytest.mark.usefixtures("one_thread")

# Every byte figure a stage record holds (times are the fake run's own).
_BYTES = ("boundary_bytes", "output_bytes", "saved_bytes", "fwd_transient_bytes",
          "bwd_transient_bytes", "nosave_transient_bytes", "grad_bytes", "output_kept_outside",
          "saves_input", "saves_output", "input_held_through", "output_held_through",
          "gets_previous_output", "selective_bwd_transient_bytes", "pending_grad_bytes",
          "link_saved_bytes", "link_backward_bytes", "input_kept_by_option", "break_before")

SMALL = {
    "gpt": {"n_layer": 3, "n_embd": 32, "n_head": 2, "block_size": 16, "vocab_size": 64,
            "batch_size": 2},
    # batch-norm statistics updated in place, stride-2 blocks of other shapes
    "convnet-bn": {"n_blocks": 4, "channels": 8, "image_size": 16, "batch_size": 4},
    # skip connections held across stages, concatenations between them
    "unet": {"channels": 8, "image_size": 16, "batch_size": 2},
}


def _profiles(name: str) -> tuple[remat.Profile, remat.Profile]:
    real = remat.profile(*load_model(name, **SMALL[name]), repeats=1)
    with remat.fake_mode():
        model, batch, loss_fn = load_model(name, **SMALL[name])
    fake_mode_of(model, batch)  # every tensor fake, of one mode
    return real, remat.profile(model, batch, loss_fn, fake=True)


@pytest.mark.parametrize("name", list(SMALL))
def test_a_fake_profile_counts_the_bytes_of_the_real_one(name: str) -> None:
    real, fake = _profiles(name)
    assert fake.fake and not real.fake
    assert fake.stage_names == real.stage_names
    for f, r in zip(fake.stages, real.stages, strict=True):
        for field in _BYTES:
            assert getattr(f, field) == getattr(r, field), (name, f.name, field)
    fixed, expected = fake.fixed.to_dict(), real.fixed.to_dict()
    if name == "unet":
        # the one kernel that differs: CPU mse_loss returns a view of its elementwise
        # losses (the loss holds the output's size through backward), the meta kernel a
        # fresh 4-byte scalar (docs/fake.md)
        output = 2 * 3 * 16 * 16 * 4 - 4
        assert expected["backward_residue"] - fixed["backward_residue"] == output
        assert expected["post_chain"] - fixed["post_chain"] == output
        for key in ("backward_residue", "post_chain", "post_chain_forward",
                    "post_chain_backward"):
            fixed.pop(key), expected.pop(key)
        assert real.measured_peak_bytes - fake.measured_peak_bytes in (0, output)
    else:
        assert fake.measured_peak_bytes == real.measured_peak_bytes
        assert fake.predicted_peak_bytes == real.predicted_peak_bytes
    assert fixed == expected
    # the file says it is fake; timing noise and rounds are not kept (not this machine's)
    data = json.loads(fake.to_json())
    assert data["fake"] is True and "timing_noise" not in data and "timed_rounds" not in data
    assert remat.Profile.from_json(fake.to_json()).fake


def test_a_plan_from_a_fake_profile_keeps_its_prediction_on_the_real_model() -> None:
    with remat.fake_mode():
        fake_model, fake_batch, loss_fn = load_model("gpt", **SMALL["gpt"])
    profile = remat.profile(fake_model, fake_batch, loss_fn, fake=True)
    least = remat.plan(profile, None, solver="min-peak").predicted_peak_bytes
    assert least is not None
    budget = (least + profile.measured_peak_bytes) // 2
    plan = remat.plan(profile, budget)
    assert plan.regions or any(not o.is_keep for o in plan.parsed_options)
    model, batch, loss_fn = load_model("gpt", **SMALL["gpt"])
    remat.apply(model, plan)  # made for this model: same stages, classes and shapes
    try:
        measured = measure_step(model, batch, loss_fn).peak_bytes
    finally:
        remat.remove(model)
    predicted = simulate(plan, to_problem(profile)).peak_bytes
    assert abs(measured / predicted - 1) <= 0.05 and measured <= budget
    # the same prediction a real profile makes for the plan (to the byte)
    real = remat.profile(*load_model("gpt", **SMALL["gpt"]), repeats=1)
    assert simulate(plan, to_problem(real)).peak_bytes == predicted


def test_fake_needs_a_model_built_under_fake_mode_and_no_compile() -> None:
    model, batch, loss_fn = load_model("gpt", **SMALL["gpt"])
    with pytest.raises(UsageError, match="is a real tensor; build them inside"):
        remat.profile(model, batch, loss_fn, fake=True)
    with remat.fake_mode():
        fake_model, fake_batch, fake_loss = load_model("gpt", **SMALL["gpt"])
    with pytest.raises(UsageError, match="do not go together"):
        remat.profile(fake_model, fake_batch, fake_loss, fake=True, compile=True)
    with pytest.raises(UsageError, match="fake="):
        remat.profile(model, batch, loss_fn, fake="yes")  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="batch tensor 0 is a real tensor"):
        remat.profile(fake_model, batch, fake_loss, fake=True)


def test_the_cli_profiles_a_fake_model(tmp_path: Any, capsys: Any) -> None:
    out = tmp_path / "fake.json"
    sets = [f"--set={k}={v}" for k, v in SMALL["gpt"].items()]
    assert main(["profile", "--fake", "--model", "gpt", *sets, "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["fake"] is True and data["model"].endswith("(fake)")
    assert "fake profile: bytes as the real step's" in capsys.readouterr().out
    plan_out = str(tmp_path / "p.json")
    assert main(["plan", "--profile", str(out), "--solver", "min-peak", "--json", plan_out]) == 0
    assert main(["profile", "--fake", "--compile", "--model", "gpt", *sets]) == 2
    capsys.readouterr()
    assert main(["plan", "--fake", "--model", "gpt", *sets, "--solver", "min-peak"]) == 0
    printed = capsys.readouterr().out
    assert "counted on fake tensors" in printed and "the plan is chosen by memory" in printed
    assert main(["plan", "--fake", "--profile", str(out), "--solver", "min-peak"]) == 2
    # one rank of a sharded job, on paper: its state sharded, so a lower peak
    peaks = {}
    for world in ([], ["--world", "fsdp=4"]):
        path = tmp_path / f"world{len(world)}.json"
        assert main(["plan", "--profile", str(out), "--solver", "none", *world,
                     "--json", str(path)]) == 0
        peaks[len(world)] = json.loads(path.read_text())["predicted_peak_bytes"]
    assert peaks[2] < peaks[0]
    assert main(["plan", "--profile", str(out), "--solver", "none", "--world", "fsdp=0"]) == 2


def test_a_long_chain_of_identical_stages_is_profiled_by_its_first_three_and_four(
    monkeypatch: Any,
) -> None:
    from remat.profiling import fake as fake_profiles

    options = {**SMALL["gpt"], "n_layer": 7}
    with remat.fake_mode():
        model, batch, loss_fn = load_model("gpt", **options)
    short = remat.profile(model, batch, loss_fn, fake=True)
    assert short.model.endswith("(4 of 7 identical stages profiled)")
    monkeypatch.setattr(fake_profiles, "MIN_EXPANDED_STAGES", 10**9)
    whole = remat.profile(model, batch, loss_fn, fake=True)
    assert "profiled" not in whole.model and whole.stage_names == short.stage_names
    for s, w in zip(short.stages, whole.stages, strict=True):
        for field in _BYTES:
            assert getattr(s, field) == getattr(w, field), (s.name, field)
    assert short.fixed == whole.fixed
    assert short.predicted_peak_bytes == whole.predicted_peak_bytes
    # the step without checkpointing is the cost model's there, as close as it is here
    assert abs(short.measured_peak_bytes - whole.measured_peak_bytes) <= 64
    assert len(model.blocks) == 7  # the chain is whole again


def test_a_chain_of_stages_that_differ_is_profiled_whole() -> None:
    with remat.fake_mode():
        model, batch, loss_fn = load_model("mlp-hetero")  # widths differ by stage
    profile = remat.profile(model, batch, loss_fn, fake=True)
    assert len(profile.stages) >= 6 and "profiled" not in profile.model


# ---------------------------------------------------------------------------------------
# Against Korthikanti et al. 2022: activation bytes per layer of a Megatron GPT layer


def _two_fp16_layers(make: Any, shape: tuple[int, ...]) -> tuple[torch.nn.Module, Any]:
    """Two layers from ``make()`` and an input of ``shape``, fake, in float16."""
    torch.set_default_dtype(torch.float16)
    try:
        with remat.fake_mode():
            return torch.nn.Sequential(make(), make()), torch.randn(*shape)
    finally:
        torch.set_default_dtype(torch.float32)


def _square_mean(m: torch.nn.Module, t: torch.Tensor) -> torch.Tensor:
    return m(t).float().square().mean()


class _MegatronLayer(torch.nn.Module):
    """Their layer: LayerNorm, QKV, softmax attention with dropout (the math kernel),
    projection and dropout, residual; LayerNorm, 4h GELU MLP, dropout, residual. (s, b, h)."""

    def __init__(self, h: int, a: int, p: float = 0.1) -> None:
        super().__init__()
        self.a, self.p = a, p
        self.ln1, self.ln2 = torch.nn.LayerNorm(h), torch.nn.LayerNorm(h)
        self.qkv, self.proj = torch.nn.Linear(h, 3 * h), torch.nn.Linear(h, h)
        self.fc1, self.fc2 = torch.nn.Linear(h, 4 * h), torch.nn.Linear(4 * h, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import torch.nn.functional as F

        s, b, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(s, b, 3, self.a, h // self.a).permute(2, 1, 3, 0, 4)
        scores = (q @ k.transpose(-1, -2)) / (h // self.a) ** 0.5
        probs = F.dropout(torch.softmax(scores, dim=-1), self.p, self.training)
        o = (probs @ v).permute(2, 0, 1, 3).reshape(s, b, h)
        x = x + F.dropout(self.proj(o), self.p, self.training)
        return x + F.dropout(self.fc2(F.gelu(self.fc1(self.ln2(x)))), self.p, self.training)


@pytest.mark.parametrize("s,b,h,a", [(512, 2, 1024, 16), (1024, 1, 2048, 16), (2048, 2, 1024, 8)])
def test_a_megatron_layer_saves_what_korthikanti_counts_plus_what_torch_adds(
    s: int, b: int, h: int, a: int
) -> None:
    model, x = _two_fp16_layers(lambda: _MegatronLayer(h, a), (s, b, h))
    profile = remat.profile(model, x, _square_mean, fake=True, options=["keep"])
    layer = profile.stages[1]
    counted = layer.saved_bytes["keep"] + layer.boundary_bytes  # the input is saved too
    paper = s * b * h * (34 + 5 * a * s / h)  # 16-bit, dropout masks of 1 byte
    # what torch on CPU adds (docs/fake.md): its dropout multiplies by a noise tensor in
    # the input's dtype and keeps it (2 bytes, not the 1-byte mask of CUDA's fused
    # native_dropout) for the attention probabilities (a*s*s*b elements) and the two
    # dropouts after the projection and the MLP (s*b*h each); each LayerNorm keeps its
    # mean and reciprocal deviation (s*b each, 16-bit)
    mask_extra = a * s * s * b + 2 * s * b * h
    stats = 2 * 2 * (s * b * 2)
    assert counted == paper + mask_extra + stats


class _FusedMegatronLayer(_MegatronLayer):
    """Their layer with attention as one fused call (dropout inside it), batch first as
    transformers lays it out: (b, s, h)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import torch.nn.functional as F

        b, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.a, h // self.a).permute(2, 0, 3, 1, 4)
        o = F.scaled_dot_product_attention(q, k, v, dropout_p=self.p, is_causal=True)
        x = x + F.dropout(self.proj(o.transpose(1, 2).reshape(b, s, h)), self.p, self.training)
        return x + F.dropout(self.fc2(F.gelu(self.fc1(self.ln2(x)))), self.p, self.training)


@pytest.mark.parametrize("s,b,h,a", [(512, 2, 1024, 16), (1024, 1, 2048, 16), (2048, 2, 1024, 8)])
def test_on_an_accelerator_a_fused_attention_layer_keeps_korthikantis_34_sbh(
    s: int, b: int, h: int, a: int
) -> None:
    model, x = _two_fp16_layers(lambda: _FusedMegatronLayer(h, a), (b, s, h))
    profile = remat.profile(model, x, _square_mean, fake=True, options=["keep"],
                            device="h100-sxm")
    assert profile.device == "h100-sxm"
    assert profile.kernels == {"0": {"flash": 1}, "1": {"flash": 1}}
    layer = profile.stages[1]
    counted = layer.saved_bytes["keep"] + layer.boundary_bytes
    paper = 34 * s * b * h  # the fused kernel keeps no S x S matrix; 1-byte dropout masks
    # what the kernel keeps that they do not count: its float32 log-sum-exp per head and
    # position; each LayerNorm's mean and reciprocal deviation (CPU's kernel, 16-bit here)
    lse = 4 * b * a * s
    stats = 2 * 2 * (s * b * 2)
    assert counted == paper + lse + stats
    assert abs(counted / paper - 1) < 0.05
    # on this machine's kernels the same layer keeps the probabilities (math kernel, as
    # CPU runs attention with dropout): far above
    cpu = remat.profile(model, x, _square_mean, fake=True, options=["keep"])
    assert cpu.stages[1].saved_bytes["keep"] > layer.saved_bytes["keep"] + a * s * s * b


def test_a_device_needs_a_fake_profile_and_a_known_name(tmp_path: Any, monkeypatch: Any
                                                         ) -> None:
    model, batch, loss_fn = load_model("gpt", n_layer=2)
    with pytest.raises(UsageError, match="needs fake=True"):
        remat.profile(model, batch, loss_fn, device="h100-sxm")
    with remat.fake_mode():
        fake_model, fake_batch, fake_loss = load_model("gpt", n_layer=2)
    monkeypatch.setenv("REMAT_DEVICES", str(tmp_path / "devices.json"))
    with pytest.raises(UsageError, match="unknown device 'tpu-v5'"):
        remat.profile(fake_model, fake_batch, fake_loss, fake=True, device="tpu-v5")
    # an entry in the user's table (remat calibrate writes one) is known from then on
    from remat.core.devices import BUILT_IN, save_device

    save_device(dataclasses.replace(BUILT_IN["h100-sxm"], name="tpu-v5", source="test"))
    found = remat.profile(fake_model, fake_batch, fake_loss, fake=True, device="tpu-v5",
                          options=["keep"])
    assert found.device == "tpu-v5" and found.kernels is not None


def test_the_largest_micro_batch_is_the_last_that_fits_for_each_strategy(tmp_path: Any,
                                                                         capsys: Any) -> None:
    """``remat plan --fake --largest-batch``: per strategy the largest micro-batch whose
    plan fits, checked against the plans one size up; remat's is at least the others'."""
    from remat.core.sizing import largest_batch
    from remat.core.transforms import at_batch_size

    sets = [f"--set={k}={v}" for k, v in SMALL["gpt"].items()]
    out = tmp_path / "fits.json"
    budget = 48 << 20
    assert main(["plan", "--fake", "--device", "h100-sxm", "--largest-batch", "--model", "gpt",
                 *sets, "--batch-size", "2", "--budget", str(budget), "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "largest micro-batch within 48 MiB" in printed and "profiled at micro-batches 2 and 4" \
        in printed
    fits = {f["strategy"]: f for f in json.loads(out.read_text())["fits"]}
    assert {"none", "per-stage", "optimal"} <= set(fits) <= {"none", "per-stage", "optimal",
                                                            "remat-fastest"}
    fastest = fits.pop("remat-fastest", None)
    if fastest is not None:  # a smaller micro-batch where remat's plan trains faster
        def rate(f: dict[str, Any]) -> float:
            return float(f["batch_size"]) / f["predicted_step_time_s"]

        assert fastest["batch_size"] < fits["optimal"]["batch_size"]
        assert rate(fastest) > rate(fits["optimal"])
    sizes = {k: f["batch_size"] for k, f in fits.items()}
    assert all(n is not None and n >= 1 for n in sizes.values())
    assert sizes["optimal"] >= max(sizes["none"], sizes["per-stage"]) > 0
    assert sizes["per-stage"] > sizes["none"]
    for f in fits.values():
        assert f["predicted_peak_bytes"] <= budget

    # the search agrees with a plan made one size up, which does not fit
    small = {k: v for k, v in SMALL["gpt"].items() if k != "batch_size"}
    with remat.fake_mode():
        m2, b2, l2 = load_model("gpt", **small, batch_size=2)
        m4, b4, l4 = load_model("gpt", **small, batch_size=4)
    from remat.profiling.profiler import fit_scaling

    first = remat.profile(m2, b2, l2, fake=True, device="h100-sxm")
    second = remat.profile(m4, b4, l4, fake=True, device="h100-sxm")
    scaled = dataclasses.replace(first, scaling=fit_scaling(first, second))
    # remat's most samples/s: never fewer than at its largest micro-batch
    from remat.core.sizing import fastest_batch

    fast = fastest_batch(scaled, budget, sizes["optimal"])
    largest_plan = largest_batch(scaled, budget, "optimal").plan
    assert fast.batch_size is not None and fast.plan is not None and largest_plan is not None
    assert fast.batch_size <= sizes["optimal"]
    assert (fast.batch_size / fast.plan.predicted_step_time_s
            >= sizes["optimal"] / largest_plan.predicted_step_time_s)
    for strategy, n in sizes.items():
        fit = largest_batch(scaled, budget, strategy)
        assert fit.batch_size == n
        above = to_problem(at_batch_size(scaled, n + 1))
        if strategy == "optimal":
            with pytest.raises(remat.CheckFailed):
                remat.plan(above, budget, "optimal")
        else:
            assert remat.plan(above, None, strategy).predicted_peak_bytes > budget

    # misuse: not fake, a fraction, no budget
    assert main(["plan", "--largest-batch", "--model", "gpt", *sets, "--budget", "1GiB"]) == 2
    assert main(["plan", "--fake", "--largest-batch", "--model", "gpt", *sets,
                 "--budget", "50%"]) == 2
    assert main(["plan", "--fake", "--largest-batch", "--model", "gpt", *sets]) == 2
    assert main(["profile", "--device", "h100-sxm", "--model", "gpt", *sets]) == 2
    assert main(["plan", "--dtype", "bfloat16", "--model", "gpt", *sets, "--budget", "1GiB"]) == 2
    err = capsys.readouterr().err
    assert "needs --fake" in err and "fraction" in err and "needs a budget in bytes" in err


def test_on_an_accelerator_the_optimizer_step_holds_a_parameter_sized_temporary() -> None:
    # torch's AdamW runs its multi-tensor (foreach) step where the parameters are on an
    # accelerator: the square roots of every second moment are made at once (measured on
    # an H200: the step's temporary equals the parameters, benchmarks/accelerator_check.md)
    # where the CPU's per-parameter loop holds about one parameter's worth at a time
    def fake(device: str | None, optimizer: str = "adamw") -> remat.Profile:
        with remat.fake_mode():
            model, batch, loss_fn = load_model("gpt", **SMALL["gpt"])
        return remat.profile(model, batch, loss_fn, optimizer=optimizer, fake=True,
                             device=device)

    here, accelerator = fake(None), fake("h100-sxm")
    params = accelerator.fixed.params_bytes
    assert accelerator.fixed.to_dict()["optimizer_step"] == params
    assert here.fixed.to_dict()["optimizer_step"] < params / 2
    # the fused kernel updates in place: no temporary, here or there
    assert fake("h100-sxm", "adamw-fused").fixed.to_dict()["optimizer_step"] == 0


def test_padded_batches_needs_a_fake_profile_for_an_accelerator() -> None:
    with remat.fake_mode():
        model, batch, loss_fn = load_model("gpt", **SMALL["gpt"])
    for device in (None, "cpu"):
        with pytest.raises(UsageError, match="padded_batches"):
            remat.profile(model, batch, loss_fn, fake=True, device=device, padded_batches=True)
    with pytest.raises(UsageError, match="padded_batches"):
        remat.profile(model, batch, loss_fn, fake=True, device="h100-sxm",
                      padded_batches="yes")  # type: ignore[arg-type]
