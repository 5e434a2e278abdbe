"""``hf:<model_type>`` with the head each family trains with (issue 49, item 2).

The head comes from transformers' own task mappings: image, video and audio
classification, CTC, speech seq2seq and contrastive image-text beside the language-model
heads; each gets a batch of its modality (pixel values, log-mel features, waveforms, text
and images) and transformers' own loss (CLIP's contrastive one with ``return_loss=True``).
A fast subset (vit, wav2vec2, clip, whisper) runs the whole cycle (stages, profile, plan,
verify, apply, measure) in the default suite; ``-m slow`` runs it over 30 and more types
of every modality (benchmarks/hf_heads.md is the table of every type tried).
"""

from __future__ import annotations

import os
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

import torch  # noqa: E402

import remat  # noqa: E402
from remat.core.errors import CheckFailed, UsageError  # noqa: E402
from remat.core.plan_format import Plan, Region  # noqa: E402
from remat.core.planner import to_problem  # noqa: E402
from remat.core.solve.from_profile import problem_from_profile  # noqa: E402
from remat.core.solve.simulator import simulate  # noqa: E402
from remat.core.solve.solvers import minimum_budget  # noqa: E402
from remat.measure import measure_step  # noqa: E402
from remat.models import load_model  # noqa: E402
from remat.models.hf import HEADS, hf_contrastive_loss, hf_loss, size_options  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = {"num_hidden_layers": 2, "hidden_size": 32, "num_attention_heads": 2, "batch_size": 2}


def tiny(model_type: str, **extra: Any) -> dict[str, Any]:
    """The tiny sizes of the family (only the size names it has), 32 frames or tokens."""
    has = set(size_options(model_type))
    found = {k: v for k, v in TINY.items() if k in has or k == "batch_size"}
    return {**found, **extra}


def cycle(model_type: str, **options: Any) -> tuple[list[str], Plan, int, int]:
    """Stages, profile, a plan under 75% of the peak (or the least budget where none fits;
    every stage a region of its own where that plan has none, so that verify checks
    rebuilds), verify one step, then the plan applied to a fresh copy and one step
    measured against its predicted peak."""
    spec = f"hf:{model_type}"
    model, batch, loss_fn = load_model(spec, **options)
    prof = remat.profile(model, batch, loss_fn, repeats=1)
    stages = [s.name for s in prof.stages]
    try:
        plan = remat.plan(prof, "75%")
    except CheckFailed:  # the parameters and their AdamW state take more than that
        plan = remat.plan(prof, minimum_budget(problem_from_profile(prof)))
    if not plan.regions:
        plan = Plan(
            stages=tuple(stages), regions=tuple(Region(i, i + 1) for i in range(len(stages)))
        )
    predicted = simulate(plan, to_problem(prof)).peak_bytes
    report = remat.verify(lambda: load_model(spec, **options), batch, plan, loss_fn, steps=1)
    failing = [(c.name, c.message) for c in report.checks if not c.passed]
    assert report.ok, (model_type, failing, report.blocking_hazards)
    fresh, batch, loss_fn = load_model(spec, **options)
    handle = remat.apply(fresh, plan)
    measured = measure_step(fresh, batch, loss_fn).peak_bytes
    handle.remove()
    return stages, plan, predicted, measured


# model_type -> (options, model class, its input names, the first stage found)
FAST = {
    "vit": (
        {"image_size": 32, "patch_size": 8},
        "ViTForImageClassification",
        {"pixel_values", "labels"},
        "vit.layers.0",
    ),
    "wav2vec2": (
        {"seq_len": 16},
        "Wav2Vec2ForCTC",
        {"input_values", "labels"},
        None,
    ),
    "clip": (
        {"seq_len": 16, "image_size": 32, "patch_size": 8},
        "CLIPModel",
        {"input_ids", "attention_mask", "pixel_values"},
        None,
    ),
    "whisper": (
        {"seq_len": 16},
        "WhisperForConditionalGeneration",
        {"input_features", "decoder_input_ids", "labels"},
        "model.encoder.layers.0",
    ),
}


@pytest.mark.parametrize("model_type", sorted(FAST))
def test_a_family_of_each_modality_runs_the_whole_cycle_with_its_head(model_type: str) -> None:
    options, cls, inputs, first = FAST[model_type]
    options = tiny(model_type, **options)
    model, batch, loss_fn = load_model(f"hf:{model_type}", **options)
    assert type(model).__name__ == cls and set(batch) == inputs
    assert loss_fn is (hf_contrastive_loss if model_type == "clip" else hf_loss)
    stages, _, predicted, measured = cycle(model_type, **options)
    assert len(stages) >= 2 and (first is None or stages[0] == first), stages
    assert abs(measured / predicted - 1) <= 0.05, (measured, predicted)


def test_the_head_follows_transformers_task_mappings() -> None:
    from remat.models.hf import _heads

    assert _heads("gpt2")[0] == "causal"  # the language-model families as before
    assert _heads("bert")[:2] == ["masked", "causal"]
    assert _heads("t5")[0] == "seq2seq"
    assert _heads("vit") == ["image-classification"]
    assert _heads("videomae") == ["video-classification"]
    assert _heads("wav2vec2") == ["ctc", "audio-classification"]
    assert _heads("audio-spectrogram-transformer") == ["audio-classification"]
    assert _heads("clip") == ["contrastive", "image-classification"]
    # whisper trains as speech seq2seq; its causal head is the text decoder alone
    assert _heads("whisper") == ["speech-seq2seq", "causal", "audio-classification"]
    # voxtral's one class is listed as seq2seq LM and speech seq2seq: it takes audio
    assert "seq2seq" not in _heads("voxtral") and "speech-seq2seq" in _heads("voxtral")


def test_each_modality_gets_a_batch_of_its_kind() -> None:
    # images: pixel values at the family's image size and channels, a class id each
    model, batch, _ = load_model("hf:vit", **tiny("vit", image_size=32, patch_size=8))
    assert batch["pixel_values"].shape == (2, 3, 32, 32)
    assert batch["labels"].shape == (2,) and batch["labels"].max() < model.config.num_labels
    # a family without an image size: the side given (224 by default)
    _, batch, _ = load_model("hf:resnet", batch_size=1, image_size=48)
    assert batch["pixel_values"].shape == (1, 3, 48, 48)
    # video: frames, at most 4
    _, batch, _ = load_model("hf:videomae", **tiny("videomae", image_size=32))
    assert batch["pixel_values"].shape == (2, 4, 3, 32, 32)
    # a raw waveform long enough for seq_len frames out of the feature encoder; a CTC
    # transcript a quarter as long, no blank (the pad id) in it
    model, batch, _ = load_model("hf:wav2vec2", **tiny("wav2vec2", seq_len=16))
    frames = model._get_feat_extract_output_lengths(batch["input_values"].shape[1])
    assert int(frames) == 16 and batch["labels"].shape == (2, 4)
    assert (batch["labels"] != model.config.pad_token_id).all()
    # whisper: log-mel features, twice max_source_positions (set to seq_len) frames
    model, batch, _ = load_model("hf:whisper", **tiny("whisper", seq_len=16))
    assert model.config.max_source_positions == 16
    assert batch["input_features"].shape == (2, model.config.num_mel_bins, 32)
    assert batch["decoder_input_ids"][:, 1:].equal(batch["labels"][:, :-1])
    # AST: a spectrogram (B, max_length, mel bins); whisper's audio classification head
    _, batch, _ = load_model("hf:audio-spectrogram-transformer", **tiny("vit", seq_len=32))
    assert batch["input_values"].shape == (2, 32, 128)
    model, batch, _ = load_model("hf:whisper", head="audio-classification", seq_len=16)
    assert type(model).__name__ == "WhisperForAudioClassification"
    assert set(batch) == {"input_features", "labels"}
    # text and images, both towers shrunk; the text as long as the text tower allows
    model, batch, loss_fn = load_model("hf:clip", batch_size=2, image_size=32, patch_size=8)
    cfg = model.config
    assert cfg.text_config.hidden_size == cfg.vision_config.hidden_size == 128
    assert cfg.text_config.num_hidden_layers == cfg.vision_config.num_hidden_layers == 4
    assert batch["input_ids"].shape == (2, 77) and batch["pixel_values"].shape == (2, 3, 32, 32)
    loss = loss_fn(model, batch)
    assert loss.dim() == 0 and loss.isfinite()
    # LayerDrop would skip whole stages at random: off unless given
    assert model.config.text_config.to_dict().get("layerdrop", 0.0) == 0.0
    assert load_model("hf:wav2vec2", seq_len=16)[0].config.layerdrop == 0.0
    assert load_model("hf:wav2vec2", seq_len=16, layerdrop=0.1)[0].config.layerdrop == 0.1


def test_the_loss_is_transformers_own() -> None:
    model, batch, loss_fn = load_model("hf:vit", **tiny("vit", image_size=32, patch_size=8))
    with torch.no_grad():
        model.eval()  # no dropout: the same forward twice
        logits = model(pixel_values=batch["pixel_values"]).logits
        expected = torch.nn.functional.cross_entropy(logits, batch["labels"])
        assert torch.allclose(loss_fn(model, batch), expected)
    # CLIP has no labels: the symmetric cross entropy of matching pairs, as return_loss
    # computes it
    model, batch, loss_fn = load_model("hf:clip", batch_size=3, image_size=32, patch_size=8)
    model.eval()
    with torch.no_grad():
        out = model(**batch)
        sims = out.logits_per_text
        target = torch.arange(3)
        expected = (
            torch.nn.functional.cross_entropy(sims, target)
            + torch.nn.functional.cross_entropy(sims.t(), target)
        ) / 2
        assert out.loss is None  # without return_loss there is none
        assert torch.allclose(loss_fn(model, batch), expected)


def test_head_names_another_head_the_family_has_or_lists_them() -> None:
    model = load_model("hf:wav2vec2", head="audio-classification", seq_len=16)[0]
    assert type(model).__name__ == "Wav2Vec2ForSequenceClassification"
    model, batch, _ = load_model("hf:bert", head="text-classification", **tiny("bert"))
    assert type(model).__name__ == "BertForSequenceClassification"
    assert batch["labels"].shape == (2,)
    with pytest.raises(UsageError, match=r"hf:vit has no ctc head; give head=image-classif"):
        load_model("hf:vit", head="ctc")
    with pytest.raises(UsageError, match=r"^option head='vision' is invalid; give causal, "):
        load_model("hf:vit", head="vision")
    assert "contrastive" in HEADS and "ctc" in HEADS


def test_a_family_with_none_of_the_heads_is_one_sentence() -> None:
    # a keypoint matcher has none of the heads remat builds
    with pytest.raises(UsageError, match=r"hf:superglue has none of the heads remat builds"):
        load_model("hf:superglue")


def test_the_language_model_families_are_unchanged() -> None:
    # the LM heads come first: these build as they did before the other heads
    for model_type, cls in (
        ("gpt2", "GPT2LMHeadModel"),
        ("bert", "BertForMaskedLM"),
        ("t5", "T5ForConditionalGeneration"),
    ):
        options = tiny(model_type, vocab_size=64, seq_len=16)
        assert type(load_model(f"hf:{model_type}", **options)[0]).__name__ == cls
    from remat.models.hf import _heads

    assert _heads("perceiver")[0] == "masked"  # it classifies images too


# 30 and more types across modalities: the whole cycle with tiny sizes (-m slow), as
# benchmarks/hf_heads.py --tiny runs them; CTC families verify without input gradients
# (Note [A model that refuses a batch that requires grad] in remat/verification/harness.py).
SLOW = {
    "text": ["gpt2", "llama", "bert", "roberta", "t5", "bart", "gpt_neox", "opt"],
    "vision": [
        "vit",
        "deit",
        "beit",
        "dinov2",
        "ijepa",
        "convnext",
        "resnet",
        "regnet",
        "levit",
        "mobilenet_v2",
        "mobilevit",
        "poolformer",
        "segformer",
        "focalnet",
    ],
    "video": ["videomae", "vivit", "timesformer"],
    "audio": ["whisper", "speech_to_text", "audio-spectrogram-transformer", "moonshine"],
    "multimodal": ["clip", "siglip", "chinese_clip"],
}
SLOW_CTC = ["wav2vec2", "hubert"]


def _slow_selected(config: pytest.Config) -> bool:
    expr = config.getoption("markexpr", "") or ""
    return "slow" in expr and "not slow" not in expr


@pytest.mark.slow
@pytest.mark.parametrize(
    "model_type",
    [
        *(t for types in SLOW.values() for t in types),
        *SLOW_CTC,
    ],
)
def test_many_types_of_every_modality_run_the_whole_cycle(
    model_type: str, request: pytest.FixtureRequest
) -> None:
    if not _slow_selected(request.config):
        pytest.skip("over 30 types: run with -m slow")
    extra: dict[str, Any] = {}
    if model_type in SLOW["text"]:
        extra = {"vocab_size": 64, "seq_len": 32}
    elif model_type in (*SLOW["audio"], *SLOW_CTC):
        extra = {"seq_len": 32}
    else:  # images, videos, image-text pairs
        extra = {"image_size": 64}
    stages, _, predicted, measured = cycle(model_type, **tiny(model_type, **extra))
    assert len(stages) >= 2, stages
    assert abs(measured / predicted - 1) <= 0.05, (measured, predicted)


def test_the_slow_test_spans_30_types_of_every_modality() -> None:
    assert sum(map(len, SLOW.values())) >= 30  # CTC families besides
    assert all(len(types) >= 3 for types in SLOW.values())
