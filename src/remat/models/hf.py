"""Hugging Face transformers models built from a config: ``hf:<model_type>``.

Any ``model_type`` transformers knows (``transformers.CONFIG_MAPPING``) works:
``hf:gpt2``, ``hf:llama``, ``hf:bert``, ``hf:t5``, ``hf:mixtral``, ``hf:mamba``, ... Nothing
is downloaded: each model is ``AutoModelFor<head>.from_config`` of a small config with
random (seeded) weights, ``HF_HUB_OFFLINE`` is set before transformers is imported, and
transformers itself is imported only when such a model is built (it is the optional
extra ``remat[hf]``).

The head is the one the family trains with: seq2seq LM for encoder-decoder families
(t5, bart: the batch has ``decoder_input_ids``), masked LM for encoder families (bert,
roberta: their causal head exists only as a decoder variant), causal LM otherwise;
``head=causal|seq2seq|masked`` picks another the family has. The loss is the one
transformers computes from ``labels``.

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

__all__ = ["FAMILIES", "GROUPS", "HEADS", "PREFIX", "hf_factory", "hf_loss", "hf_model"]

PREFIX = "hf:"
INSTALL_HINT = "pip install 'remat[hf]'"
ATTENTION = ("sdpa", "eager")
#: The heads ``head=`` can name, and the transformers auto class of each.
HEADS = {
    "causal": "AutoModelForCausalLM",
    "seq2seq": "AutoModelForSeq2SeqLM",
    "masked": "AutoModelForMaskedLM",
}
_HEAD_MAPPINGS = {
    "causal": "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
    "seq2seq": "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
    "masked": "MODEL_FOR_MASKED_LM_MAPPING_NAMES",
}


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
    """The heads the family has, the one it trains with first."""
    from transformers.models.auto import modeling_auto

    has = [
        head
        for head, mapping in _HEAD_MAPPINGS.items()
        if model_type in getattr(modeling_auto, mapping, {})
    ]
    order = ("causal", "seq2seq", "masked")
    if "seq2seq" in has:  # an encoder-decoder family's causal head is its decoder alone
        order = ("seq2seq", "causal", "masked")
    elif "masked" in has:  # an encoder family's causal head is a decoder variant
        order = ("masked", "causal", "seq2seq")
    return [head for head in order if head in has]


def _head(model_type: str, head: str | None) -> str:
    if head is not None and head not in HEADS:
        raise UsageError(f"option head={head!r} is invalid; give {', '.join(HEADS)} or leave it")
    heads = _heads(model_type)
    if not heads:
        raise UsageError(
            f"{PREFIX}{model_type} has no causal, seq2seq or masked language-model head in "
            "transformers; build it yourself and pass it as package.module:factory"
        )
    if head is None:
        return heads[0]
    if head not in heads:
        raise UsageError(
            f"{PREFIX}{model_type} has no {head} head; give head={' or head='.join(heads)}"
        )
    return head


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
    """A transformers language model of ``model_type`` from a small config, random weights.

    ``config`` overrides the config's fields (sizes by the family's or the generic
    names); ``dropout`` sets every dropout of the family; ``head`` picks the head
    (``causal``, ``seq2seq``, ``masked``; by default the one the family trains with).
    Returns the model in training mode, a batch (``input_ids``, ``attention_mask``,
    ``labels``, and ``decoder_input_ids`` for a seq2seq head; each (batch_size,
    seq_len)) and :func:`hf_loss`.
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
    if seq_len is None:
        seq_len = _default_seq_len(model_type, defaults)
    check_int("seq_len", seq_len)
    family = FAMILIES.get(model_type)
    overrides = dict(config)
    groups: dict[str, list[str]] = {}
    if family is not None:
        valid = _config_fields(config_class, defaults) | set(family.names) | set(_OWN)
        unknown = [k for k in config if k not in valid]
        if unknown:
            raise _unknown(model_type, unknown, valid)
        fields = _sizes(family, overrides, seq_len)
        drop = 0.1 if dropout is None else check_prob("dropout", dropout)
        fields.update(dict.fromkeys(family.dropouts, drop))
        attn_implementation = attn_implementation or "sdpa"
    else:
        groups = _groups(config_class, defaults)
        valid = _config_fields(config_class, defaults) | set(groups) | set(_OWN)
        unknown = [k for k in config if k not in valid]
        if unknown:
            raise _unknown(model_type, unknown, valid)
        fields = _generic_sizes(model_type, defaults, groups, overrides, seq_len)
        if dropout is not None:
            names = _dropouts(defaults)
            if not names:
                raise UsageError(
                    f"{PREFIX}{model_type} has no dropout field in its config; leave dropout unset"
                )
            fields.update(dict.fromkeys(names, check_prob("dropout", dropout)))
    fields.update(overrides)
    if family is not None and family.config_class == "GPT2Config":
        # GPT-2's token ids (50256) would lie outside a small vocabulary
        for name in ("bos_token_id", "eos_token_id"):
            fields.setdefault(name, check_int("vocab_size", fields["vocab_size"], minimum=2) - 1)
    elif family is None and _int(fields.get("vocab_size")):
        _token_ids(defaults, fields, fields["vocab_size"])
    fields["return_dict"] = True
    if family is not None or "use_cache" in defaults:
        fields["use_cache"] = False
    try:
        cfg = config_class(**fields)
    except Exception as err:  # transformers' validators raise several kinds
        layers = groups.get("num_hidden_layers", []) if family is None else []
        if not layers or any(k in config for k in (*layers, "num_hidden_layers")):
            raise UsageError(
                f"{config_class.__name__} rejected these options ({_reason(err)}); fix them"
            ) from err
        # Some configs list a per-layer setting sized for their default depth (gpt_neo's
        # attention_types): keep that depth rather than guess the list.
        for field in layers:
            fields[field] = defaults[field]
        try:
            cfg = config_class(**fields)
        except Exception:
            raise UsageError(
                f"{config_class.__name__} rejected these options ({_reason(err)}); fix them"
            ) from err
    if attn_implementation is not None:
        cfg._attn_implementation = attn_implementation
    vocab = check_int("vocab_size", getattr(cfg, "vocab_size", None), minimum=2)
    auto = getattr(transformers, HEADS[chosen_head])
    kwargs = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
    with seeded(seed):
        try:
            model = auto.from_config(cfg, **kwargs)
        except (TypeError, ValueError, ImportError) as err:
            raise UsageError(
                f"transformers cannot build {PREFIX}{model_type} with a {chosen_head} head from "
                f"these options ({_reason(err)}); change them or build the model yourself"
            ) from err
        batch = _batch(chosen_head, cfg, vocab, batch_size, seq_len)
    if chosen_head == "causal":
        model.loss_type = "ForCausalLM"  # what from_pretrained would set; saves a warning
    model.train()
    return model, batch, hf_loss


def _batch(
    head: str, cfg: Any, vocab: int, batch_size: int, seq_len: int
) -> dict[str, torch.Tensor]:
    """Random token ids for ``head``, drawn under the caller's seed."""
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
    labels = torch.randint(0, vocab, (batch_size, seq_len))
    start = 0
    for name in ("pad_token_id", "decoder_start_token_id"):  # the latter wins
        value = getattr(cfg, name, None)
        if isinstance(value, int) and 0 <= value < vocab:
            start = value
    decoder_ids = torch.cat([torch.full((batch_size, 1), start), labels[:, :-1]], dim=1)
    return {
        "input_ids": ids,  # (B, T): the encoder's input
        "attention_mask": torch.ones_like(ids),  # (B, T)
        "decoder_input_ids": decoder_ids,  # (B, T): the labels shifted right
        "labels": labels,  # (B, T)
    }


def hf_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    """The loss transformers computes from ``labels`` (cross entropy of the model's head)."""
    loss: torch.Tensor = model(**batch).loss
    return loss


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
