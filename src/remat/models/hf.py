"""Hugging Face transformers models built from a config: ``hf:<model_type>``.

Any ``model_type`` transformers knows (``transformers.CONFIG_MAPPING``) works:
``hf:gpt2``, ``hf:llama``, ``hf:bert``, ``hf:t5``, ``hf:mixtral``, ``hf:mamba``, ... Nothing
is downloaded: each model is ``AutoModelFor<head>.from_config`` of a small config with
random (seeded) weights, ``HF_HUB_OFFLINE`` is set before transformers is imported, and
transformers itself is imported only when such a model is built (it is the optional
extra ``remat[hf]``).

The head is the one the family trains with, from transformers' own task mappings
(Note [The head a family trains with]): seq2seq LM for encoder-decoder families (t5, bart:
the batch has ``decoder_input_ids``), masked LM for encoder families (bert, roberta: their
causal head exists only as a decoder variant), causal LM for the other text families;
speech seq2seq (whisper), contrastive image-text (clip, siglip), CTC (wav2vec2), image,
video and audio classification for the others, each with a batch of its modality (Note
[Batches], Note [Signal sizes]); ``head=`` (a key of :data:`HEADS`) picks another the
family has. The loss is the one transformers computes from ``labels``, or with
``return_loss=True`` for a contrastive head (:func:`hf_contrastive_loss`).

Sizes are CPU-sized. The four decoders remat was first tuned on (gpt2, llama, qwen2,
mistral) keep their table below: 4 layers, hidden size 128, 4 heads, vocabulary 1000,
batch 4 of 256 tokens, dropout 0.1. Every other family is shrunk by what its config
calls each size (:data:`GROUPS`: layers 4, hidden size 128, heads 4, the feed-forward
size at the family's own ratio to the hidden size, at most 4 experts and 2 per token,
vocabulary 1000; the positions as the family has them) and runs batch 4 of 128 tokens
(64 for state-space families, whose reference scan on CPU is slow); its dropouts stay as
its config has them unless ``dropout=`` is given. ``use_cache`` is off (a key/value cache
is for generation; in training it only keeps tensors alive and a rebuild would append to
it again).
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from remat.core.errors import UsageError
from remat.models._common import check_int, check_prob, seeded

__all__ = [
    "FAMILIES",
    "GROUPS",
    "HEADS",
    "PREFIX",
    "hf_contrastive_loss",
    "hf_factory",
    "hf_loss",
    "hf_model",
    "size_options",
]

PREFIX = "hf:"
INSTALL_HINT = "pip install 'remat[hf]'"
ATTENTION = ("sdpa", "eager")


@dataclass(frozen=True)
class Head:
    """One head ``head=`` can name."""

    auto_class: str  # the transformers auto class that builds it
    mapping: str  # the task mapping in transformers.models.auto.modeling_auto


#: The heads ``head=`` can name: the transformers auto class of each and the task mapping
#: (in ``transformers.models.auto.modeling_auto``) that says which families have it. The
#: order is the preference among the heads a family has (:func:`_heads`).
HEADS: dict[str, Head] = {
    "causal": Head("AutoModelForCausalLM", "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES"),
    "seq2seq": Head("AutoModelForSeq2SeqLM", "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES"),
    "masked": Head("AutoModelForMaskedLM", "MODEL_FOR_MASKED_LM_MAPPING_NAMES"),
    "speech-seq2seq": Head("AutoModelForSpeechSeq2Seq", "MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES"),
    "contrastive": Head(
        "AutoModelForZeroShotImageClassification",
        "MODEL_FOR_ZERO_SHOT_IMAGE_CLASSIFICATION_MAPPING_NAMES",
    ),
    "ctc": Head("AutoModelForCTC", "MODEL_FOR_CTC_MAPPING_NAMES"),
    "image-classification": Head(
        "AutoModelForImageClassification", "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES"
    ),
    "video-classification": Head(
        "AutoModelForVideoClassification", "MODEL_FOR_VIDEO_CLASSIFICATION_MAPPING_NAMES"
    ),
    "audio-classification": Head(
        "AutoModelForAudioClassification", "MODEL_FOR_AUDIO_CLASSIFICATION_MAPPING_NAMES"
    ),
    "text-classification": Head(
        "AutoModelForSequenceClassification", "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES"
    ),
}
_LM_HEADS = ("causal", "seq2seq", "masked")
_TEXT_HEADS = (*_LM_HEADS, "text-classification")
_CLASS_HEADS = ("image-classification", "video-classification", "audio-classification")


@dataclass(frozen=True)
class Family:
    """How one decoder family names its sizes and dropouts."""

    config_class: str  # the transformers config class
    names: Mapping[str, str]  # generic size name -> the family's field
    dropouts: tuple[str, ...]


_LLAMA_LIKE = {
    "num_hidden_layers": "num_hidden_layers",
    "hidden_size": "hidden_size",
    "num_attention_heads": "num_attention_heads",
    "max_position_embeddings": "max_position_embeddings",
}
#: The four decoders with hand-tuned defaults (pinned by the tests); every other
#: model_type goes through :data:`GROUPS`.
FAMILIES: dict[str, Family] = {
    "gpt2": Family(
        "GPT2Config",
        {
            "num_hidden_layers": "n_layer",
            "hidden_size": "n_embd",
            "num_attention_heads": "n_head",
            "max_position_embeddings": "n_positions",
        },
        ("resid_pdrop", "embd_pdrop", "attn_pdrop"),
    ),
    "llama": Family("LlamaConfig", _LLAMA_LIKE, ("attention_dropout",)),
    "qwen2": Family("Qwen2Config", _LLAMA_LIKE, ("attention_dropout",)),
    "mistral": Family("MistralConfig", _LLAMA_LIKE, ("attention_dropout",)),
}

#: Each generic size name and the fields families call that size by (plus whatever the
#: config's own ``attribute_map`` maps the generic name to). ``--set`` with a generic name
#: sets every one of them the family has (t5: ``num_hidden_layers`` sets ``num_layers``
#: and ``num_decoder_layers``); a field's own name sets that field alone.
GROUPS: dict[str, tuple[str, ...]] = {
    "num_hidden_layers": (
        "num_hidden_layers",
        "n_layer",
        "n_layers",
        "num_layers",
        "num_decoder_layers",
        "num_encoder_layers",
        "encoder_layers",
        "decoder_layers",
    ),
    "hidden_size": ("hidden_size", "n_embd", "n_embed", "d_model", "dim", "embed_dim"),
    "num_attention_heads": (
        "num_attention_heads",
        "n_head",
        "n_heads",
        "num_heads",
        "encoder_attention_heads",
        "decoder_attention_heads",
    ),
    "intermediate_size": (
        "intermediate_size",
        "d_ff",
        "n_inner",
        "ffn_dim",
        "encoder_ffn_dim",
        "decoder_ffn_dim",
        "ffn_hidden_size",
        "moe_intermediate_size",
        "shared_expert_intermediate_size",
    ),
    "max_position_embeddings": ("max_position_embeddings", "n_positions"),
}
# Sizes derived from the generic ones (not options of their own).
_HEAD_DIM = ("head_dim", "d_kv", "kv_channels")
_KV_HEADS = (
    "num_key_value_heads",
    "num_kv_heads",
    "n_kv_heads",
    "multi_query_group_num",
    "n_groups",
)
_EXPERTS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
_EXPERTS_PER_TOKEN = ("num_experts_per_tok", "moe_topk")
_STATE_SPACE = ("state_size", "ssm_state_size", "d_state", "mamba_d_state")
_SMALL = {
    "num_hidden_layers": 4,
    "hidden_size": 128,
    "num_attention_heads": 4,
    "experts": 4,
    "experts_per_token": 2,
    "vocab_size": 1000,
    "image_size": 224,
    "num_frames": 4,
    "conv_dim": 128,
    "depth_per_stage": 2,
}

# Options of the factory itself, not config fields.
_OWN = ("batch_size", "seq_len", "seed", "attn_implementation", "dropout", "head")
# Config fields the factory sets itself: the model must train without a cache, and
# return its loss from the labels.
_FIXED = ("use_cache", "return_dict")


def _import_transformers() -> Any:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import transformers
    except ImportError as err:
        raise UsageError(
            f"hf: models need the transformers package ({err}); install it with {INSTALL_HINT}"
        ) from err
    return transformers


def _config_class(transformers: Any, model_type: str) -> Any:
    """The config class of ``model_type``; UsageError with close matches if unknown."""
    known = list(transformers.CONFIG_MAPPING.keys())
    if model_type not in known:
        close = difflib.get_close_matches(model_type, known, n=2)
        hint = f" (did you mean {' or '.join(PREFIX + c for c in close)}?)" if close else ""
        examples = ", ".join(PREFIX + name for name in (*FAMILIES, "bert", "t5"))
        raise UsageError(
            f"transformers has no model type {model_type!r}{hint}; give one it knows, "
            f"e.g. {examples}"
        )
    return transformers.CONFIG_MAPPING[model_type]


def _heads(model_type: str) -> list[str]:
    """The heads the family has, the one it trains with first (Note [The head a family
    trains with])."""
    from transformers.models.auto import modeling_auto

    classes = {
        head: getattr(modeling_auto, spec.mapping, {}).get(model_type)
        for head, spec in HEADS.items()
    }
    has = [head for head, cls in classes.items() if cls is not None]
    if "speech-seq2seq" in has and classes["seq2seq"] == classes["speech-seq2seq"]:
        has.remove("seq2seq")  # the same class listed twice: it takes speech, not text
    order = list(HEADS)
    if "speech-seq2seq" in has:  # its causal head is the text decoder alone (whisper)
        order = ["speech-seq2seq", *(h for h in order if h != "speech-seq2seq")]
    elif "seq2seq" in has:  # an encoder-decoder family's causal head is its decoder alone
        order = ["seq2seq", "causal", "masked", *order[3:]]
    elif "masked" in has:  # an encoder family's causal head is a decoder variant
        order = ["masked", "causal", "seq2seq", *order[3:]]
    return [head for head in order if head in has]


def _head(model_type: str, head: str | None) -> str:
    if head is not None and head not in HEADS:
        raise UsageError(f"option head={head!r} is invalid; give {', '.join(HEADS)} or leave it")
    heads = _heads(model_type)
    if not heads:
        raise UsageError(
            f"{PREFIX}{model_type} has none of the heads remat builds ({', '.join(HEADS)}) in "
            "transformers; build it yourself and pass it as package.module:factory"
        )
    if head is None:
        return heads[0]
    if head not in heads:
        raise UsageError(
            f"{PREFIX}{model_type} has no {head} head; give head={' or head='.join(heads)}"
        )
    return head


# Note [The head a family trains with]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# transformers lists, per task, the class each family has for it (the *_MAPPING_NAMES of
# modeling_auto). A family's default head is the first of HEADS it has, with the language
# model heads first so that every text family builds what it built before, except:
# - a family with a seq2seq LM head trains with it; its causal head is its decoder alone;
# - an encoder family (a masked LM head) trains with it; its causal head is a decoder
#   variant (BertLMHeadModel);
# - a family with a speech seq2seq head (whisper) trains with it; its causal head is the
#   text decoder alone (WhisperForCausalLM), and a class listed as both seq2seq LM and
#   speech seq2seq (voxtral, granite_speech) takes audio, so it is the speech head only.
# After the LM heads: contrastive image-text (CLIP, SigLIP: the base model, whose loss
# return_loss=True computes), CTC before audio classification (wav2vec2 is fine-tuned for
# speech recognition), image, video, audio, then text classification.


# Config fields that describe or label a model rather than shape it.
_BOOKKEEPING = frozenset(
    {
        "architectures",
        "id2label",
        "is_encoder_decoder",
        "label2id",
        "model_type",
        "problem_type",
        "transformers_version",
    }
)


def _defaults(config_class: Any) -> dict[str, Any]:
    try:
        defaults: dict[str, Any] = config_class().to_dict()
    except Exception as err:  # a composite config that needs arguments, etc.
        raise UsageError(
            f"{config_class.__name__} cannot be built with its defaults ({err}); build the "
            "model yourself and pass it as package.module:factory"
        ) from err
    return defaults


def _config_fields(config_class: Any, defaults: Mapping[str, Any] | None = None) -> set[str]:
    fields = set(_defaults(config_class) if defaults is None else defaults)
    fields.update(getattr(config_class, "attribute_map", {}))
    return {f for f in fields if not f.startswith("_")} - _BOOKKEEPING - set(_FIXED)


def _unknown(model_type: str, unknown: list[str], valid: set[str]) -> UsageError:
    close = difflib.get_close_matches(unknown[0], sorted(valid), n=2)
    hint = f" (did you mean {' or '.join(close)}?)" if close else ""
    keys = ", ".join(map(repr, unknown))
    return UsageError(
        f"{PREFIX}{model_type} has no option {keys}{hint}; its options are "
        f"{', '.join(_OWN)} and the config's fields {', '.join(sorted(valid - set(_OWN)))}"
    )


def _sizes(family: Family, config: dict[str, Any], seq_len: int) -> dict[str, Any]:
    """The small defaults, in the family's own field names, under the user's overrides."""
    own = {generic: config.pop(name, None) for generic, name in family.names.items()}
    for generic in list(own):
        given = config.pop(generic, None)
        if given is not None:
            own[generic] = given
    hidden = check_int("hidden_size", 128 if own["hidden_size"] is None else own["hidden_size"])
    heads_given = own["num_attention_heads"]
    heads = check_int("num_attention_heads", 4 if heads_given is None else heads_given)
    if hidden % heads:
        raise UsageError(
            f"hidden_size={hidden} is not divisible by num_attention_heads={heads}; "
            "pick sizes where it is"
        )
    layers = 4 if own["num_hidden_layers"] is None else own["num_hidden_layers"]
    positions = own["max_position_embeddings"] or max(128, seq_len)
    check_int("max_position_embeddings", positions)
    if seq_len > positions:
        raise UsageError(
            f"seq_len={seq_len} exceeds max_position_embeddings={positions}; lower seq_len "
            "or raise max_position_embeddings"
        )
    sizes = {
        family.names["num_hidden_layers"]: check_int("num_hidden_layers", layers),
        family.names["hidden_size"]: hidden,
        family.names["num_attention_heads"]: heads,
        family.names["max_position_embeddings"]: positions,
        "vocab_size": 1000,
    }
    if family.config_class != "GPT2Config":
        sizes["intermediate_size"] = 4 * hidden
        # grouped-query attention, as these families train: two query heads per key/value head
        sizes["num_key_value_heads"] = heads // 2 if heads % 2 == 0 else heads
    return sizes


def _int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _groups(config_class: Any, defaults: Mapping[str, Any]) -> dict[str, list[str]]:
    """Each generic size name and the family's integer fields for it (empty groups left out)."""
    aliases = getattr(config_class, "attribute_map", {})
    found = {}
    for generic, names in GROUPS.items():
        fields = [n for n in dict.fromkeys((*names, aliases.get(generic, ""))) if n]
        fields = [n for n in fields if _int(defaults.get(n))]
        if fields:
            found[generic] = fields
    return found


def _dropouts(defaults: Mapping[str, Any]) -> list[str]:
    return [
        name
        for name, value in defaults.items()
        if ("dropout" in name or "pdrop" in name)
        and isinstance(value, float)
        and not name.startswith("_")
    ]


def _even(value: float) -> int:
    """``value`` rounded to an even whole number of at least 2 (rotary halves)."""
    return max(2, 2 * round(value / 2))


def _first(defaults: Mapping[str, Any], names: tuple[str, ...]) -> list[str]:
    return [n for n in names if _int(defaults.get(n))]


def _generic_sizes(
    model_type: str,
    defaults: Mapping[str, Any],
    groups: Mapping[str, list[str]],
    config: dict[str, Any],
    seq_len: int,
) -> dict[str, Any]:
    """Small sizes for any family, in its own field names; ``config`` (the user's) on top."""
    chosen: dict[str, int] = {}
    for generic in groups:
        given = config.pop(generic, None)
        if given is not None:
            chosen[generic] = check_int(generic, given)
    hidden = chosen.get("hidden_size", _SMALL["hidden_size"])
    heads = chosen.get("num_attention_heads", _SMALL["num_attention_heads"])
    fields: dict[str, Any] = {}
    for field in groups.get("num_hidden_layers", ()):
        fields[field] = chosen.get("num_hidden_layers", _SMALL["num_hidden_layers"])
    for field in groups.get("hidden_size", ()):
        fields[field] = hidden
    for field in groups.get("num_attention_heads", ()):
        fields[field] = heads
    base_hidden = next((defaults[f] for f in groups.get("hidden_size", ())), None)
    for field in groups.get("intermediate_size", ()):
        if "intermediate_size" in chosen:
            fields[field] = chosen["intermediate_size"]
        elif base_hidden:  # the family's own ratio to the hidden size
            fields[field] = max(1, round(defaults[field] * hidden / base_hidden))
        else:
            fields[field] = 4 * hidden
    for field in groups.get("max_position_embeddings", ()):
        # kept as the family has it unless given (some offset positions by the pad id)
        fields[field] = chosen.get("max_position_embeddings", defaults[field])
    if "num_attention_heads" in groups:
        fields.update(_head_sizes(defaults, groups, config, hidden, heads, base_hidden))
    experts = None
    for field in _first(defaults, _EXPERTS):
        experts = fields[field] = min(defaults[field], _SMALL["experts"])
    for field in _first(defaults, _EXPERTS_PER_TOKEN):
        fields[field] = min(defaults[field], _SMALL["experts_per_token"], experts or 2)
    if _int(defaults.get("vocab_size")):
        fields["vocab_size"] = _SMALL["vocab_size"]
    positions = [f for f in groups.get("max_position_embeddings", ()) if f not in config]
    for field in positions:
        if seq_len > fields[field]:
            raise UsageError(
                f"seq_len={seq_len} exceeds {field}={fields[field]} of {PREFIX}{model_type}; "
                f"lower seq_len or raise {field}"
            )
    return fields


def _head_sizes(
    defaults: Mapping[str, Any],
    groups: Mapping[str, list[str]],
    config: Mapping[str, Any],
    hidden: int,
    heads: int,
    base_hidden: Any,
) -> dict[str, Any]:
    """The head size, rotated share and key/value heads of ``heads`` heads in ``hidden``,
    in the family's proportions (``base_hidden``: its default hidden size, if it has one)."""
    fields: dict[str, Any] = {}
    head_dims = _first(defaults, _HEAD_DIM)
    if "hidden_size" in groups and not any(f in config for f in head_dims) and hidden % heads:
        raise UsageError(
            f"hidden_size={hidden} is not divisible by num_attention_heads={heads}; "
            "pick sizes where it is"
        )
    base_heads = defaults[groups["num_attention_heads"][0]]
    head_dim = hidden / heads  # what one head gets now, and what it got by default
    base_head_dim = base_hidden / base_heads if base_hidden else head_dim
    for field in head_dims:
        if not base_hidden or base_heads * defaults[field] == base_hidden:
            fields[field] = max(1, hidden // heads)
        else:  # heads x head size is not the hidden size (mamba2: 2x, gemma: 4/3)
            fields[field] = _even(defaults[field] * base_heads / heads * hidden / base_hidden)
            head_dim, base_head_dim = fields[field], defaults[field]
    if _int(defaults.get("rotary_dim")):  # the rotated share of a head (gptj, codegen)
        fields["rotary_dim"] = min(
            _even(defaults["rotary_dim"] * head_dim / base_head_dim), max(2, int(head_dim))
        )
    for field in _first(defaults, _KV_HEADS):
        ratio = base_heads // defaults[field] if defaults[field] else 1
        keep = ratio >= 1 and base_heads % defaults[field] == 0 and heads % ratio == 0
        fields[field] = heads // ratio if keep else heads
    return fields


def _reason(err: BaseException) -> str:
    """The first line of the innermost cause of ``err``, for a one-line message."""
    while err.__cause__ is not None:
        err = err.__cause__
    lines = str(err).strip().splitlines()
    return (lines[0] if lines else type(err).__name__)[:300].rstrip(". ")


def _token_ids(defaults: Mapping[str, Any], fields: dict[str, Any], vocab: int) -> None:
    """Special token ids of the full vocabulary moved inside the small one (the last id)."""
    for name, value in defaults.items():
        if not name.endswith("_token_id") or name in fields:
            continue
        if _int(value) and value >= vocab:
            fields[name] = vocab - 1
        elif isinstance(value, list) and any(_int(v) and v >= vocab for v in value):
            fields[name] = [min(v, vocab - 1) if _int(v) else v for v in value]


def _default_seq_len(model_type: str, defaults: Mapping[str, Any]) -> int:
    if model_type in FAMILIES:
        return 256
    return 64 if any(name in defaults for name in _STATE_SPACE) else 128


@dataclass(frozen=True)
class _Sub:
    """A config nested in the family's (CLIP's ``text_config``, ``vision_config``)."""

    config_class: Any
    defaults: dict[str, Any]
    groups: dict[str, list[str]]


def _sub_configs(
    transformers: Any, config_class: Any, defaults: Mapping[str, Any]
) -> dict[str, _Sub]:
    subs = {}
    for name, declared in getattr(config_class, "sub_configs", {}).items():
        value = defaults.get(name)
        if not isinstance(value, dict):
            continue
        sub_class = transformers.CONFIG_MAPPING.get(value.get("model_type"), declared)
        subs[name] = _Sub(sub_class, value, _groups(sub_class, value))
    return subs


def _uses(head: str) -> str:
    """What the head's batch is made of: ``text``, ``pixels``, ``video``, ``audio`` or
    ``text+pixels``."""
    if head in _TEXT_HEADS:
        return "text"
    if head in ("image-classification",):
        return "pixels"
    if head == "video-classification":
        return "video"
    if head == "contrastive":
        return "text+pixels"
    return "audio"


def _stage_heads(
    defaults: Mapping[str, Any],
    groups: Mapping[str, list[str]],
    fields: Mapping[str, Any],
    given: Mapping[str, Any],
) -> dict[str, Any]:
    """Heads per stage (swin's ``num_heads``, a list) kept at the family's head size where
    the hidden size changed (swin: 3, 6, 12, 24 heads of 32 at width 96 -> 4, 8, 16, 32)."""
    hidden = groups.get("hidden_size", [])
    if not hidden or not _int(defaults[hidden[0]]):
        return {}
    scale = fields[hidden[0]] / defaults[hidden[0]]
    found = {}
    for name in GROUPS["num_attention_heads"]:
        heads = defaults.get(name)
        if name in given or not isinstance(heads, list) or not heads:
            continue
        if all(map(_int, heads)):
            found[name] = [max(1, round(h * scale)) for h in heads]
    return found


def _signal_sizes(
    head: str, defaults: Mapping[str, Any], given: Mapping[str, Any], seq_len: int
) -> dict[str, Any]:
    """Small sizes of the images, frames and audio a head takes, and no layer drop
    (Note [Signal sizes])."""
    fields: dict[str, Any] = {}
    uses = _uses(head)
    if uses != "text" and "image_size" not in given:
        side = defaults.get("image_size")  # at most 224 (efficientnet's is 600)
        if _int(side) and side > _SMALL["image_size"]:
            fields["image_size"] = _SMALL["image_size"]
    # wav2vec2-conformer's vocabulary is None: its tokenizer sets it
    text_head = head in ("ctc", "speech-seq2seq")
    if text_head and "vocab_size" in defaults and defaults["vocab_size"] is None:
        fields["vocab_size"] = given.get("vocab_size", _SMALL["vocab_size"])
    if uses == "video" and _int(defaults.get("num_frames")) and "num_frames" not in given:
        fields["num_frames"] = min(defaults["num_frames"], _SMALL["num_frames"])
    if uses == "audio" and _int(defaults.get("num_mel_bins")):
        # whisper's encoder takes exactly 2 x max_source_positions frames of features;
        # AST's spectrogram is max_length frames long
        for name in ("max_source_positions", "max_length"):
            if _int(defaults.get(name)) and name not in given:
                fields[name] = seq_len
                break
    conv = defaults.get("conv_dim")
    if (
        uses == "audio"
        and isinstance(conv, list)
        and all(map(_int, conv))
        and "conv_dim" not in given
    ):
        fields["conv_dim"] = [min(c, _SMALL["conv_dim"]) for c in conv]
    for name, value in defaults.items():
        if "layerdrop" in name and isinstance(value, float) and name not in given:
            fields[name] = 0.0
    return fields


# Note [Signal sizes]
# ~~~~~~~~~~~~~~~~~~~
# Images keep the family's image_size, at most 224 (224 x 224 where the config has
# none: image_size= sets the batch's side then): at 224 a ViT of hidden size 128 sees
# 197 patches, so its activations, not its parameters and their AdamW state, make most
# of the peak, as for text. Videos have 4 frames at most. For audio, seq_len is the
# length of the sequence the encoder layers see: whisper's max_source_positions and
# AST's max_length are set to it, and a waveform has as many samples as the
# convolutions need for seq_len frames (20 ms each at 16 kHz); those convolutions have
# at most 128 channels (wav2vec2's conv_dim, 512 by default, would make the feature
# encoder most of the step). The layers are shrunk as text families are (GROUPS),
# except in families built in stages of different widths (a ``depths`` list: swin,
# convnext, resnet): there the widths stay the family's (a hidden size of 128 would
# widen swin's first stage from 96, and its last to 1024) unless hidden_size= is given,
# and each stage has at most 2 blocks.
#
# LayerDrop (wav2vec2, hubert, whisper, ... layerdrop 0.1) is set to 0: it skips whole
# layers at random in training, so which stages run changes from step to step, and a
# plan's regions are chosen for the stages that ran when it was profiled. Set it with
# --set layerdrop=0.1 to train with it anyway.


def hf_model(
    model_type: str,
    *,
    batch_size: int = 4,
    seq_len: int | None = None,
    seed: int = 0,
    attn_implementation: str | None = None,
    dropout: float | None = None,
    head: str | None = None,
    **config: Any,
) -> tuple[nn.Module, dict[str, torch.Tensor], Callable[[nn.Module, Any], torch.Tensor]]:
    """A transformers model of ``model_type`` from a small config, random weights.

    ``config`` overrides the config's fields (sizes by the family's or the generic
    names); ``dropout`` sets every dropout of the family; ``head`` picks the head (a key
    of :data:`HEADS`; by default the one the family trains with). Returns the model in
    training mode, a batch for its head (token ids of shape (batch_size, seq_len) for
    text, pixel values, audio, or text and images; see :func:`_batch`) and the loss
    (:func:`hf_loss`, or :func:`hf_contrastive_loss` for a contrastive head).
    """
    check_int("batch_size", batch_size)
    if attn_implementation is not None and attn_implementation not in ATTENTION:
        raise UsageError(
            f"option attn_implementation={attn_implementation!r} is invalid; give "
            f"{' or '.join(ATTENTION)}"
        )
    transformers = _import_transformers()
    config_class = _config_class(transformers, model_type)
    chosen_head = _head(model_type, head)
    fixed = [k for k in config if k in _FIXED]
    if fixed:
        raise UsageError(
            f"option {fixed[0]} of {PREFIX}{model_type} is fixed (use_cache off, return_dict "
            "on) because training needs it so; build the model yourself to change it"
        )
    defaults = _defaults(config_class)
    subs = _sub_configs(transformers, config_class, defaults)
    asked = _Asked(
        model_type=model_type,
        config_class=config_class,
        defaults=defaults,
        subs=subs,
        head=chosen_head,
        seq_len=check_int("seq_len", _seq_len(model_type, defaults, subs, config)
                          if seq_len is None else seq_len),
        seq_len_given=seq_len is not None,
        dropout=dropout,
    )
    family = FAMILIES.get(model_type)
    overrides = dict(config)
    image_side = _image_side(asked, overrides)
    groups: dict[str, list[str]] = {}
    if family is not None:
        fields = _family_fields(asked, family, overrides)
        attn_implementation = attn_implementation or "sdpa"
    else:
        fields, groups = _generic_fields(asked, overrides)
    fields.update(overrides)
    _fixed_fields(asked, family, fields)
    cfg = _config(asked, fields, groups.get("num_hidden_layers", []), config)
    if attn_implementation is not None:
        cfg._attn_implementation = attn_implementation
    vocab = _vocab(asked, cfg)
    with seeded(seed):
        model = _model(transformers, asked, cfg, attn_implementation)
        batch = _batch(chosen_head, model, cfg, vocab, batch_size, asked.seq_len, image_side)
    if chosen_head == "causal":
        model.loss_type = "ForCausalLM"  # what from_pretrained would set; saves a warning
    model.train()
    return model, batch, hf_contrastive_loss if chosen_head == "contrastive" else hf_loss


@dataclass(frozen=True)
class _Asked:
    """What ``hf_model`` settled before sizing the config, passed to each of its steps: the
    family's config class, defaults and nested configs, the head, the sequence length."""

    model_type: str
    config_class: Any
    defaults: dict[str, Any]
    subs: dict[str, _Sub]
    head: str
    seq_len: int
    seq_len_given: bool
    dropout: float | None


def _seq_len(model_type: str, defaults: Mapping[str, Any], subs: Mapping[str, _Sub],
             config: Mapping[str, Any]) -> int:
    """The default sequence length: the family's, or a shorter text tower's (CLIP: 77
    positions)."""
    seq_len = _default_seq_len(model_type, defaults)
    for sub in subs.values():
        positions: Any = sub.defaults.get("max_position_embeddings")
        if _int(positions) and "max_position_embeddings" not in config:
            seq_len = min(seq_len, positions)
    return seq_len


def _image_side(asked: _Asked, overrides: dict[str, Any]) -> int | None:
    """The batch's image side where the config has no image_size (taken out of
    ``overrides``); a hiera-style (height, width) image_size made of one side."""
    uses = _uses(asked.head)
    defaults = asked.defaults
    if uses in ("pixels", "video") and "image_size" in overrides and "image_size" not in defaults:
        return check_int("image_size", overrides.pop("image_size"))  # the batch's only
    if isinstance(defaults.get("image_size"), (list, tuple)) and _int(
        overrides.get("image_size")
    ):
        overrides["image_size"] = [overrides["image_size"]] * 2  # hiera: (height, width)
    return None


def _family_fields(asked: _Asked, family: Family, overrides: dict[str, Any]
                   ) -> dict[str, Any]:
    """The config fields of a family with its own size names (:data:`FAMILIES`); the sizes
    are taken out of ``overrides``."""
    valid = _config_fields(asked.config_class, asked.defaults) | set(family.names) | set(_OWN)
    unknown = [k for k in overrides if k not in valid]
    if unknown:
        raise _unknown(asked.model_type, unknown, valid)
    fields = _sizes(family, overrides, asked.seq_len)
    drop = 0.1 if asked.dropout is None else check_prob("dropout", asked.dropout)
    fields.update(dict.fromkeys(family.dropouts, drop))
    return fields


def _generic_fields(asked: _Asked, overrides: dict[str, Any]
                    ) -> tuple[dict[str, Any], dict[str, list[str]]]:
    """The config fields of any other family, sized by the generic names (GROUPS), its
    nested configs too; and the groups of its own fields. The sizes of nested configs and
    their own fields are taken out of ``overrides``."""
    defaults, subs = asked.defaults, asked.subs
    groups = _groups(asked.config_class, defaults)
    sub_groups = {g for sub in subs.values() for g in sub.groups}
    top = _config_fields(asked.config_class, defaults) | set(groups) | set(_OWN)
    nested_fields = {n: _config_fields(sub.config_class, sub.defaults) for n, sub in subs.items()}
    valid = top | sub_groups | set().union(*nested_fields.values())
    unknown = [k for k in overrides if k not in valid]
    if unknown:
        raise _unknown(asked.model_type, unknown, valid)
    generic = {g: overrides[g] for g in GROUPS if g in overrides}
    for g in sub_groups - set(groups):
        overrides.pop(g, None)  # sizes of the nested configs only
    # a field of the nested configs only, by its own name: set in each that has it
    nested = {k: overrides.pop(k) for k in list(overrides) if k not in top}
    depths = defaults.get("depths")
    per_stage = isinstance(depths, list) and all(map(_int, depths))
    if per_stage:  # Note [Signal sizes]: depth is the depths list, widths the family's
        groups.pop("num_hidden_layers", None)
        if "hidden_size" not in overrides:
            groups.pop("hidden_size", None)
    fields = _generic_sizes(asked.model_type, defaults, groups, overrides, asked.seq_len)
    fields.update(_stage_heads(defaults, groups, fields, overrides))
    if per_stage and "depths" not in overrides:
        fields["depths"] = [min(d, _SMALL["depth_per_stage"]) for d in depths]
    fields.update(_signal_sizes(asked.head, defaults, overrides, asked.seq_len))
    for name, sub in subs.items():
        if name in overrides:
            continue  # the user's own nested config
        own = {k: v for k, v in nested.items() if k in nested_fields[name]}
        fields[name] = _nested_fields(asked, name, sub, own, generic)
    if asked.dropout is not None:
        names = _dropouts(defaults)
        if not names and not any(_dropouts(sub.defaults) for sub in subs.values()):
            raise UsageError(
                f"{PREFIX}{asked.model_type} has no dropout field in its config; leave "
                "dropout unset"
            )
        fields.update(dict.fromkeys(names, check_prob("dropout", asked.dropout)))
    return fields, groups


def _nested_fields(asked: _Asked, name: str, sub: _Sub, own: Mapping[str, Any],
                   generic: Mapping[str, Any]) -> dict[str, Any]:
    """The fields of the nested config ``name``: the generic sizes given, and ``own``, the
    fields given by their own names."""
    seq_len = asked.seq_len
    sub_fields = _generic_sizes(
        f"{asked.model_type}.{name}",
        sub.defaults,
        sub.groups,
        {**own, **generic},
        seq_len
        if asked.seq_len_given or "max_position_embeddings" not in sub.defaults
        else min(seq_len, sub.defaults["max_position_embeddings"]),
    )
    sub_fields.update(_signal_sizes(asked.head, sub.defaults, own, seq_len))
    sub_fields.update({k: v for k, v in own.items() if k not in GROUPS})
    if _int(sub_fields.get("vocab_size")):
        _token_ids(sub.defaults, sub_fields, sub_fields["vocab_size"])
    if asked.dropout is not None:
        sub_fields.update(dict.fromkeys(_dropouts(sub.defaults), asked.dropout))
    return sub_fields


def _fixed_fields(asked: _Asked, family: Family | None, fields: dict[str, Any]) -> None:
    """Token ids inside the vocabulary, return_dict on and use_cache off, in ``fields``."""
    if family is not None and family.config_class == "GPT2Config":
        # GPT-2's token ids (50256) would lie outside a small vocabulary
        for name in ("bos_token_id", "eos_token_id"):
            fields.setdefault(name, check_int("vocab_size", fields["vocab_size"], minimum=2) - 1)
    elif family is None and _int(fields.get("vocab_size")):
        _token_ids(asked.defaults, fields, fields["vocab_size"])
    fields["return_dict"] = True
    if family is not None or "use_cache" in asked.defaults:
        fields["use_cache"] = False


def _config(asked: _Asked, fields: dict[str, Any], layers: list[str],
            config: Mapping[str, Any]) -> Any:
    """The config of ``fields``; at the family's default depth where the config rejects
    another (``layers``: the depth's fields, for a family without its own size names) the
    user did not ask for."""
    config_class = asked.config_class
    try:
        return config_class(**fields)
    except Exception as err:  # transformers' validators raise several kinds
        if not layers or any(k in config for k in (*layers, "num_hidden_layers")):
            raise UsageError(
                f"{config_class.__name__} rejected these options ({_reason(err)}); fix them"
            ) from err
        # Some configs list a per-layer setting sized for their default depth (gpt_neo's
        # attention_types): keep that depth rather than guess the list.
        for field in layers:
            fields[field] = asked.defaults[field]
        try:
            return config_class(**fields)
        except Exception:
            raise UsageError(
                f"{config_class.__name__} rejected these options ({_reason(err)}); fix them"
            ) from err


def _vocab(asked: _Asked, cfg: Any) -> int | None:
    """The text vocabulary the batch's token ids are drawn from, for a head that has one."""
    uses = _uses(asked.head)
    if uses in ("text", "text+pixels") or asked.head in ("ctc", "speech-seq2seq"):
        text_cfg = cfg.get_text_config(decoder=True) if uses != "text" else cfg
        return check_int("vocab_size", getattr(text_cfg, "vocab_size", None), minimum=2)
    return None


def _model(transformers: Any, asked: _Asked, cfg: Any, attn_implementation: str | None
           ) -> Any:
    """The head's model of ``cfg``, by its auto class, its weights drawn from torch's RNG."""
    from transformers.models.auto import modeling_auto

    head = HEADS[asked.head]
    classes = getattr(modeling_auto, head.mapping)[asked.model_type]
    if isinstance(classes, (tuple, list)):  # deit, levit: the auto class asks which one
        cfg.architectures = [classes[0]]
    auto = getattr(transformers, head.auto_class)
    kwargs = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
    try:
        return auto.from_config(cfg, **kwargs)
    except (TypeError, ValueError, ImportError, KeyError, AttributeError) as err:
        raise UsageError(
            f"transformers cannot build {PREFIX}{asked.model_type} with a {asked.head} head "
            f"from these options ({_reason(err)}); change them or build the model yourself"
        ) from err


def _text(
    head: str, cfg: Any, vocab: int, batch_size: int, seq_len: int
) -> dict[str, torch.Tensor]:
    """Random token ids for a language-model ``head``, drawn under the caller's seed."""
    if head == "causal":
        ids = torch.randint(0, vocab, (batch_size, seq_len))
        return {
            "input_ids": ids,  # (B, T)
            "attention_mask": torch.ones_like(ids),  # (B, T): no padding
            "labels": ids.clone(),  # (B, T): the model shifts them by one itself
        }
    if head == "masked":
        # the last id stands for [MASK]; 15% of the positions (at least one) are masked
        # and only those are predicted, as in BERT's pre-training
        ids = torch.randint(0, vocab - 1, (batch_size, seq_len))
        masked = torch.rand(batch_size, seq_len) < 0.15
        masked[:, 0] = True
        return {
            "input_ids": ids.masked_fill(masked, vocab - 1),  # (B, T)
            "attention_mask": torch.ones_like(ids),  # (B, T)
            "labels": ids.masked_fill(~masked, -100),  # (B, T): -100 is not predicted
        }
    ids = torch.randint(0, vocab, (batch_size, seq_len))
    return {
        "input_ids": ids,  # (B, T): the encoder's input
        "attention_mask": torch.ones_like(ids),  # (B, T)
        **_decoder(cfg, vocab, batch_size, seq_len),
    }


def _decoder(cfg: Any, vocab: int, batch_size: int, seq_len: int) -> dict[str, torch.Tensor]:
    """A seq2seq decoder's labels and its input, the labels shifted right behind the
    pad / decoder-start id."""
    labels = torch.randint(0, vocab, (batch_size, seq_len))
    start = 0
    for name in ("pad_token_id", "decoder_start_token_id"):  # the latter wins
        value = getattr(cfg, name, None)
        if isinstance(value, int) and 0 <= value < vocab:
            start = value
    decoder_ids = torch.cat([torch.full((batch_size, 1), start), labels[:, :-1]], dim=1)
    return {
        "decoder_input_ids": decoder_ids,  # (B, T): the labels shifted right
        "labels": labels,  # (B, T)
    }


def _side(cfg: Any, image_side: int | None) -> tuple[int, int]:
    size = getattr(cfg, "image_size", None)
    if _int(size):
        return size, size
    if isinstance(size, (list, tuple)) and len(size) == 2 and all(map(_int, size)):
        return size[0], size[1]
    side = _SMALL["image_size"] if image_side is None else image_side
    return side, side


def _waveform_length(cfg: Any, frames: int) -> int:
    """Samples a waveform needs for ``frames`` frames out of the family's convolutions."""
    kernels, strides = getattr(cfg, "conv_kernel", None), getattr(cfg, "conv_stride", None)
    if not (isinstance(kernels, (list, tuple)) and isinstance(strides, (list, tuple))):
        return frames * 320  # 20 ms frames of 16 kHz audio
    length = frames
    for kernel, stride in zip(reversed(kernels), reversed(strides), strict=True):
        length = (length - 1) * stride + kernel
    return length


def _audio(model: nn.Module, cfg: Any, batch_size: int, seq_len: int) -> dict[str, torch.Tensor]:
    """The audio input ``model`` takes, seq_len frames long for its encoder layers."""
    name = getattr(model, "main_input_name", "input_values")
    mel = getattr(cfg, "num_mel_bins", None)
    if name == "input_features" and _int(mel) and _int(getattr(cfg, "max_source_positions", None)):
        # whisper: log-mel features (B, mel bins, 2 x max_source_positions)
        return {name: torch.randn(batch_size, mel, 2 * cfg.max_source_positions)}
    per_channel = getattr(cfg, "input_feat_per_channel", None)
    if name == "input_features" and _int(per_channel):
        # speech_to_text: (B, frames, features), subsampled by 2 per convolution
        convs = len(getattr(cfg, "conv_kernel_sizes", (5, 5)))
        features = per_channel * getattr(cfg, "input_channels", 1)
        return {name: torch.randn(batch_size, seq_len * 2**convs, features)}
    if name == "input_values" and _int(mel) and _int(getattr(cfg, "max_length", None)):
        # AST: a spectrogram (B, max_length, mel bins)
        return {name: torch.randn(batch_size, cfg.max_length, mel)}
    if name == "input_values":
        return {name: torch.randn(batch_size, _waveform_length(cfg, seq_len))}  # (B, samples)
    raise UsageError(
        f"remat does not know the audio input {name!r} of {type(model).__name__}; build the "
        "model and its batch yourself and pass them as package.module:factory"
    )


def _batch(
    head: str,
    model: nn.Module,
    cfg: Any,
    vocab: int | None,
    batch_size: int,
    seq_len: int,
    image_side: int | None = None,
) -> dict[str, torch.Tensor]:
    """A random batch for ``head``, drawn under the caller's seed (Note [Batches])."""
    if head in _LM_HEADS:
        assert vocab is not None
        return _text(head, cfg, vocab, batch_size, seq_len)
    classes = check_int("num_labels", getattr(cfg, "num_labels", 2))
    class_ids = torch.randint(0, classes, (batch_size,))
    if head == "text-classification":
        assert vocab is not None
        ids = torch.randint(0, vocab, (batch_size, seq_len))
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": class_ids}
    if head == "image-classification":
        channels = getattr(cfg, "num_channels", 3)
        pixels = torch.randn(batch_size, channels, *_side(cfg, image_side))
        return {"pixel_values": pixels, "labels": class_ids}  # (B, C, H, W), (B,)
    if head == "video-classification":
        frames = getattr(cfg, "num_frames", _SMALL["num_frames"])
        channels = getattr(cfg, "num_channels", 3)
        pixels = torch.randn(batch_size, frames, channels, *_side(cfg, image_side))
        return {"pixel_values": pixels, "labels": class_ids}  # (B, F, C, H, W), (B,)
    if head == "contrastive":
        assert vocab is not None
        vision = getattr(cfg, "vision_config", cfg)
        ids = torch.randint(0, vocab, (batch_size, seq_len))
        pixels = torch.randn(batch_size, getattr(vision, "num_channels", 3), *_side(vision, None))
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "pixel_values": pixels}
    audio = _audio(model, cfg, batch_size, seq_len)
    if head == "audio-classification":
        return {**audio, "labels": class_ids}
    assert vocab is not None
    if head == "ctc":
        # a transcript a quarter of the frames long, ids other than the blank (the pad id)
        blank = getattr(cfg, "pad_token_id", 0)
        labels = torch.randint(1, vocab, (batch_size, max(1, seq_len // 4)))
        if _int(blank) and blank > 0:
            labels = labels.masked_fill(labels == blank, 0)
        return {**audio, "labels": labels}
    return {**audio, **_decoder(cfg, vocab, batch_size, seq_len)}  # speech seq2seq


# Note [Batches]
# ~~~~~~~~~~~~~~
# One random batch per head, each of batch_size examples:
# - causal / masked / seq2seq LM: token ids (B, seq_len) as before;
# - text classification: token ids and a class id per example;
# - image classification: pixel_values (B, C, H, W) and class ids in [0, num_labels);
#   video: (B, frames, C, H, W);
# - audio classification / CTC / speech seq2seq: the input the model names
#   (main_input_name): whisper's log-mel input_features (B, mel bins, 2 x
#   max_source_positions), speech_to_text's (B, frames, features), AST's spectrogram
#   input_values (B, max_length, mel bins), else a raw waveform input_values (B,
#   samples); then class ids, a CTC transcript (B, seq_len / 4) of non-blank ids, or
#   decoder labels and their shifted input;
# - contrastive: token ids (B, seq_len) and pixel_values (B, C, H, W) of matching pairs;
#   the loss is the model's own with return_loss=True (hf_contrastive_loss).


def hf_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    """The loss transformers computes from ``labels`` (cross entropy of the model's head,
    CTC for a CTC head)."""
    loss: torch.Tensor = model(**batch).loss
    return loss


def hf_contrastive_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    """The contrastive loss of an image-text model, which has no labels: the batch's pairs
    match each other and no other (CLIP's symmetric cross entropy over the similarity
    matrix, SigLIP's pairwise sigmoid), as the model computes it with ``return_loss=True``."""
    loss: torch.Tensor = model(**batch, return_loss=True).loss
    return loss


def size_options(model_type: str) -> list[str]:
    """The generic size names (keys of :data:`GROUPS`) ``hf:<model_type>`` takes: those
    its config, or a config nested in it, has a field for."""
    transformers = _import_transformers()
    config_class = _config_class(transformers, model_type)
    if model_type in FAMILIES:
        return list(FAMILIES[model_type].names)
    defaults = _defaults(config_class)
    found = set(_groups(config_class, defaults))
    if isinstance(defaults.get("depths"), list):
        found.discard("num_hidden_layers")  # set by the depths list
    for sub in _sub_configs(transformers, config_class, defaults).values():
        found.update(sub.groups)
    return [name for name in GROUPS if name in found]


def hf_factory(spec: str) -> Callable[..., Any]:
    """The factory of an ``hf:<model_type>`` spec (UsageError for an unknown type)."""
    model_type = spec[len(PREFIX) :]
    _config_class(_import_transformers(), model_type)

    def factory(
        *,
        batch_size: int = 4,
        seq_len: int | None = None,
        seed: int = 0,
        attn_implementation: str | None = None,
        dropout: float | None = None,
        head: str | None = None,
        **config: Any,
    ) -> tuple[nn.Module, dict[str, torch.Tensor], Callable[[nn.Module, Any], torch.Tensor]]:
        return hf_model(
            model_type,
            batch_size=batch_size,
            seq_len=seq_len,
            seed=seed,
            attn_implementation=attn_implementation,
            dropout=dropout,
            head=head,
            **config,
        )

    factory.__name__ = factory.__qualname__ = f"hf_{model_type}"
    factory.__doc__ = f"``{spec}``: see :func:`remat.models.hf.hf_model`."
    return factory
