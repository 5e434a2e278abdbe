"""transformers models (``hf:gpt2``, ``hf:llama``, ..., any ``hf:<model_type>``) end to end.

Built from configs with random weights (nothing downloaded), tiny sizes: stage discovery,
multi-stage and nested regions inside the transformers decoder loop checked by the verify
harness with dropout on, predicted against measured peak, the ``hf-gc`` bench row, the
``output_hidden_states`` flag and the ``use_cache`` warning, and the option errors; other
families (bert, t5, gpt_neox, mixtral, mamba) built with their own head, trained a step
and their layers found.
"""

from __future__ import annotations

import os
import sys
import warnings

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

import remat  # noqa: E402
from remat.benchmarking import parse_strategies  # noqa: E402
from remat.benchmarking.runners import enable_hf_gc  # noqa: E402
from remat.cli import main  # noqa: E402
from remat.core.errors import UsageError  # noqa: E402
from remat.core.plan_format import Plan, Region  # noqa: E402
from remat.core.planner import to_problem  # noqa: E402
from remat.core.profile_format import Profile  # noqa: E402
from remat.core.solve.simulator import simulate  # noqa: E402
from remat.measure import measure_step  # noqa: E402
from remat.models import load_model  # noqa: E402
from remat.runtime.stages import discover_stages  # noqa: E402

# Small enough for two shared CPU cores; long enough a sequence that activations, not
# parameters, dominate the peak.
TINY = {
    "num_hidden_layers": 4,
    "hidden_size": 32,
    "num_attention_heads": 2,
    "vocab_size": 64,
    "seq_len": 64,
    "batch_size": 2,
}
FAMILIES = ("gpt2", "llama", "qwen2", "mistral")
LAYERS = {
    "gpt2": "transformer.h",
    "llama": "model.layers",
    "qwen2": "model.layers",
    "mistral": "model.layers",
}
# Two regions, the second with a nested one, and a selective stage inside a region.
NESTED = (
    (Region(0, 2), Region(2, 4), Region(2, 3)),
    ("keep", "keep", "keep", "selective:save-matmuls"),
)


def _plan(family: str) -> Plan:
    regions, options = NESTED
    return Plan(
        stages=tuple(f"{LAYERS[family]}.{i}" for i in range(4)), regions=regions, options=options
    )


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_builds_from_a_config_offline_with_dropout_and_no_cache(family: str) -> None:
    assert os.environ["HF_HUB_OFFLINE"] == "1"  # any download attempt would raise
    model, batch, loss_fn = load_model(f"hf:{family}", **TINY)
    cfg = model.config
    assert cfg.model_type == family
    assert cfg.num_hidden_layers == 4 and cfg.hidden_size == 32 and cfg.vocab_size == 64
    assert cfg.use_cache is False
    assert model.training
    dropouts = (
        ("resid_pdrop", "embd_pdrop", "attn_pdrop") if family == "gpt2" else ("attention_dropout",)
    )
    assert all(getattr(cfg, name) == 0.1 for name in dropouts)
    assert batch["input_ids"].shape == (2, 64)
    loss = loss_fn(model, batch)
    assert loss.dim() == 0 and loss.isfinite()
    # the same seed gives the same weights: every bench row starts from one state
    again, _, _ = load_model(f"hf:{family}", **TINY)
    first = next(iter(model.state_dict().values()))
    assert first.equal(next(iter(again.state_dict().values())))


def test_gpt2_takes_its_own_size_names_too() -> None:
    model, _, _ = load_model("hf:gpt2", n_layer=3, n_embd=48, n_head=3, vocab_size=64)
    assert (model.config.n_layer, model.config.n_embd, model.config.n_head) == (3, 48, 3)
    assert len(model.transformer.h) == 3


@pytest.mark.parametrize("family", ("gpt2", "llama"))
def test_stage_discovery_finds_the_decoder_layers(family: str) -> None:
    model, batch, loss_fn = load_model(f"hf:{family}", **TINY)
    assert discover_stages(model, batch, loss_fn) == [f"{LAYERS[family]}.{i}" for i in range(4)]


@pytest.mark.parametrize("family", ("gpt2", "llama", "qwen2"))
def test_two_regions_and_a_nested_one_inside_the_decoder_loop_train_identically(
    family: str,
) -> None:
    model, batch, loss_fn = load_model(f"hf:{family}", **TINY)
    report = remat.verify(model, batch, _plan(family), loss_fn, steps=1)
    failing = [(c.name, c.message) for c in report.checks if not c.passed]
    assert report.ok, (failing, report.blocking_hazards)
    assert report.value_check is not None and report.value_check.ok


def test_verify_sees_dropout_in_the_rebuilds() -> None:
    # The control: with the RNG state not replayed, the rebuilt dropout masks differ and
    # the same harness must fail, so the equality above is not for want of dropout.
    model, batch, loss_fn = load_model("hf:llama", **TINY)
    report = remat.verify(model, batch, _plan("llama"), loss_fn, steps=1, preserve_rng_state=False)
    assert not report.ok
    # Not for any reason: the forward agrees, the gradients do not, ...
    assert report.check("loss").status == "pass"
    assert report.check("parameter-gradients").status == "fail"
    # ... the first rebuilt value that differs is a dropout mask, ...
    d = report.first_divergence
    assert d is not None and (d.stage, d.quantity) == ("model.layers.0", "rebuilt-value")
    assert d.op is not None and "bernoulli" in d.op
    # ... and every rebuilt layer is named for drawing from torch's generator unreplayed.
    assert [(h.kind, h.stage) for h in report.blocking_hazards] == [
        ("randomness", f"model.layers.{i}") for i in range(4)
    ]
    assert all("RNG preservation is off" in h.details[0] for h in report.blocking_hazards)


@pytest.mark.parametrize("family", ("gpt2", "llama"))
def test_measured_peak_is_within_5pct_of_the_prediction(family: str) -> None:
    model, batch, loss_fn = load_model(f"hf:{family}", **TINY)
    prof = remat.profile(model, batch, loss_fn, repeats=1)
    problem = to_problem(prof)
    plan = _plan(family)
    predicted = simulate(plan, problem).peak_bytes
    fresh, batch, loss_fn = load_model(f"hf:{family}", **TINY)
    handle = remat.apply(fresh, plan)
    measured = measure_step(fresh, batch, loss_fn).peak_bytes
    handle.remove()
    assert prof.measured_peak_bytes is not None
    assert measured < 0.8 * prof.measured_peak_bytes  # the plan really saves memory
    assert abs(measured / predicted - 1) <= 0.05, (measured, predicted)
    assert abs(prof.measured_peak_bytes / prof.predicted_peak_bytes - 1) <= 0.05


def test_bench_has_an_hf_gc_row_measured_and_gradient_checked() -> None:
    report = remat.bench(
        "hf:llama",
        options={**TINY, "num_hidden_layers": 2},
        budgets="100%",
        strategies="hf-gc",
        repeats=1,
        warmup=0,
        verify_steps=1,
        profile_repeats=1,
        microbatch_budget=None,
        matched=False,
    )
    rows = {r.key: r for r in report.rows}
    gc, none = rows["hf-gc"], rows["none"]
    assert gc.status == "ok", gc.reason
    assert gc.grads_match and gc.verify_ok, gc.grads_detail
    assert gc.instrument == "tracker" and gc.step_time_s
    assert gc.measured_peak_bytes is not None and none.measured_peak_bytes is not None
    # transformers' checkpointing really ran, one region per layer: remat's per-stage
    # plan is its prediction
    assert gc.measured_peak_bytes < 0.8 * none.measured_peak_bytes
    assert gc.regions == ("[0, 1)", "[1, 2)")
    assert abs(gc.measured_peak_bytes / gc.predicted_peak_bytes - 1) <= 0.05


def test_hf_gc_joins_the_default_rows_of_transformers_models_only() -> None:
    from remat.benchmarking.strategies import with_default_rows

    default = remat.benchmarking.STRATEGIES
    assert "hf-gc" not in default
    assert parse_strategies("remat,hf-gc,none") == ("none", "hf-gc", "remat")
    hf_model, _, _ = load_model("hf:gpt2", **TINY)
    assert with_default_rows(default, hf_model) == ("none", "per-stage", "hf-gc", *default[2:])
    chosen = parse_strategies("none,remat")
    assert with_default_rows(chosen, hf_model) == chosen  # a list the user gave stays as is
    model, _, _ = load_model("mlp-hetero")
    assert with_default_rows(default, model) == default
    with pytest.raises(UsageError, match="applies only to transformers models"):
        enable_hf_gc(model)


def test_output_hidden_states_is_flagged_in_the_profile() -> None:
    def flags(**extra: object) -> tuple[list[bool], list[str]]:
        model, batch, loss_fn = load_model("hf:llama", **TINY, **extra)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            prof = remat.profile(model, batch, loss_fn, repeats=1, options=("keep",))
        return [s.output_kept_outside for s in prof.stages], [str(w.message) for w in caught]

    kept, said = flags(output_hidden_states=True)
    # every layer's output is in the returned hidden states (the last one is the chain's
    # own output, never inside a region)
    assert kept == [True, True, True, False]
    assert any("output_hidden_states=True" in s for s in said)
    kept, said = flags()
    assert kept == [False] * 4
    assert not any("outside the chain" in s for s in said)


def test_applying_regions_to_a_model_with_use_cache_on_warns() -> None:
    model, _, _ = load_model("hf:llama", **TINY)
    model.config.use_cache = True
    with pytest.warns(UserWarning, match="use_cache=True"):
        remat.apply(model, _plan("llama")).remove()
    model.config.use_cache = False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        remat.apply(model, _plan("llama")).remove()


def test_an_unknown_set_key_is_a_one_line_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["profile", "--model", "hf:llama", "--set", "num_layers=3"])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1
    assert "'num_layers'" in err and "num_hidden_layers" in err
    with pytest.raises(UsageError, match="hf:gpt2, hf:llama, hf:qwen2"):
        load_model("hf:gpt5")
    with pytest.raises(UsageError, match="use_cache"):
        load_model("hf:llama", use_cache=True)


def test_without_transformers_the_error_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)  # import now fails
    with pytest.raises(UsageError, match=r"pip install 'remat\[hf\]'"):
        load_model("hf:llama")


# -- any model_type (item 6 of issue 13) ---------------------------------------------------

# A tiny size for any family, by the generic names (each sets whatever the config calls it).
TINY_ANY = {
    "num_hidden_layers": 2,
    "hidden_size": 32,
    "num_attention_heads": 2,
    "vocab_size": 64,
    "seq_len": 32,
    "batch_size": 2,
}
# model_type -> (the model class, the layer stacks discovery may choose from)
OTHERS = {
    "bert": ("BertForMaskedLM", ("bert.encoder.layer",)),
    "t5": ("T5ForConditionalGeneration", ("encoder.block", "decoder.block")),
    "gpt_neox": ("GPTNeoXForCausalLM", ("gpt_neox.layers",)),
    "mixtral": ("MixtralForCausalLM", ("model.layers",)),
    "mamba": ("MambaForCausalLM", ("backbone.layers",)),
}


@pytest.mark.parametrize("model_type", sorted(OTHERS))
def test_any_family_builds_with_its_head_trains_and_its_layers_are_found(model_type: str) -> None:
    cls, stacks = OTHERS[model_type]
    options = dict(TINY_ANY)
    if model_type == "mamba":
        del options["num_attention_heads"]  # no attention: not an option of mamba
    model, batch, loss_fn = load_model(f"hf:{model_type}", **options)
    assert type(model).__name__ == cls
    assert model.config.model_type == model_type
    assert model.config.use_cache is False and model.training
    assert model.config.vocab_size == 64
    loss = loss_fn(model, batch)
    assert loss.dim() == 0 and loss.isfinite()
    loss.backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    stages = discover_stages(model, batch, loss_fn)
    # t5 has two stacks: discovery found one of them until it learned to chain containers
    # (issue 13, item 1); either way every stage is a block of one of them, and at least
    # one stack is found whole.
    found = {stack for stack in stacks if all(f"{stack}.{i}" in stages for i in range(2))}
    assert found, stages
    assert all(any(s.startswith(stack + ".") for stack in stacks) for s in stages), stages


def test_the_head_and_batch_follow_the_family() -> None:
    # masked LM: 15% of the positions (at least the first) replaced by the last id, and
    # only those predicted
    _, batch, _ = load_model("hf:bert", **TINY_ANY)
    masked = batch["labels"] != -100
    assert masked[:, 0].all() and (~masked).any()
    assert (batch["input_ids"][masked] == 63).all()
    assert (batch["input_ids"][~masked] < 63).all()
    # seq2seq: the decoder's input is the labels shifted right behind the start id
    model, batch, _ = load_model("hf:t5", **TINY_ANY)
    assert set(batch) == {"input_ids", "attention_mask", "decoder_input_ids", "labels"}
    assert batch["decoder_input_ids"][:, 1:].equal(batch["labels"][:, :-1])
    assert (batch["decoder_input_ids"][:, 0] == model.config.pad_token_id).all()
    # a head the family has, by name; one it lacks is a usage error naming the ones it has
    model = load_model("hf:bart", head="causal", **TINY_ANY)[0]
    assert type(model).__name__ == "BartForCausalLM"
    with pytest.raises(
        UsageError, match=r"hf:gpt2 has no seq2seq head; give head=causal or head=text-classific"
    ):
        load_model("hf:gpt2", head="seq2seq")
    with pytest.raises(UsageError, match="hf:superglue has none of the heads remat builds"):
        load_model("hf:superglue")  # vit and the other non-LM heads: tests/test_hf_heads.py


def test_generic_sizes_shrink_every_field_the_family_calls_them() -> None:
    # defaults: CPU-sized whatever the family calls its sizes
    t5 = load_model("hf:t5")[0].config
    assert (t5.d_model, t5.num_heads, t5.d_kv) == (128, 4, 32)
    assert (t5.num_layers, t5.num_decoder_layers, t5.d_ff, t5.vocab_size) == (4, 4, 512, 1000)
    mixtral = load_model("hf:mixtral")[0].config
    assert (mixtral.num_local_experts, mixtral.num_experts_per_tok) == (4, 2)
    assert mixtral.num_key_value_heads == 1  # the family's 4 query heads per key/value head
    assert mixtral.intermediate_size == 448  # the family's 3.5 x hidden
    mamba, batch, _ = load_model("hf:mamba")
    assert (mamba.config.hidden_size, mamba.config.intermediate_size) == (128, 256)
    assert mamba.config.num_hidden_layers == 4 and batch["input_ids"].shape == (4, 64)
    # a generic name sets every field of its group; a field's own name sets that one only
    cfg = load_model("hf:t5", num_hidden_layers=3, num_decoder_layers=2, d_ff=80)[0].config
    assert (cfg.num_layers, cfg.num_decoder_layers, cfg.d_ff) == (3, 2, 80)
    # dropout= sets every dropout of the family; a family without one says so
    bert = load_model("hf:bert", dropout=0.25, **TINY_ANY)[0].config
    assert bert.hidden_dropout_prob == bert.attention_probs_dropout_prob == 0.25
    with pytest.raises(UsageError, match="hf:mamba has no dropout field"):
        load_model("hf:mamba", dropout=0.1)


def test_unknown_model_types_and_fields_are_one_sentence_with_close_matches(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code = main(["profile", "--model", "hf:gptneox"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1
    assert "did you mean hf:gpt_neox" in err
    code = main(["profile", "--model", "hf:t5", "--set", "d_mdoel=64"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1
    assert "'d_mdoel'" in err and "did you mean d_model" in err
    with pytest.raises(UsageError, match="no option 'num_attention_heads'"):
        load_model("hf:mamba", num_attention_heads=2)  # mamba has no attention heads


def test_profile_runs_on_an_encoder_decoder_from_the_cli(tmp_path: os.PathLike[str]) -> None:
    out = os.path.join(tmp_path, "p.json")
    sets = ["num_hidden_layers=2", "hidden_size=32", "num_attention_heads=2", "vocab_size=64"]
    args = ["profile", "--model", "hf:t5", "--repeats", "1", "--json", out]
    args += [x for s in (*sets, "seq_len=32", "batch_size=2") for x in ("--set", s)]
    assert main(args) == 0
    prof = Profile.load(out)
    assert prof.measured_peak_bytes and len(prof.stages) >= 2


def test_head_sizes_keep_the_family_s_proportions() -> None:
    # heads x head size is 4/3 of the hidden size in gemma and 2x in mamba2 (its
    # expand); gptj rotates a quarter of each head; mamba2's groups must divide its heads
    gemma = load_model("hf:gemma")[0].config
    assert (gemma.hidden_size, gemma.num_attention_heads, gemma.head_dim) == (128, 4, 42)
    for model_type in ("mamba2", "gptj"):
        model, batch, loss_fn = load_model(f"hf:{model_type}", **TINY_ANY)
        assert loss_fn(model, batch).isfinite()
        cfg = model.config
        if model_type == "mamba2":
            assert cfg.num_heads * cfg.head_dim == cfg.expand * cfg.hidden_size == 64
            assert cfg.num_heads % cfg.n_groups == 0
        else:
            assert cfg.rotary_dim == 4  # a quarter of 32 / 2
