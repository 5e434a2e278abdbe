"""Hugging Face transformers decoders built from a config: ``hf:gpt2``, ``hf:llama``, ...

Nothing is downloaded: each model is ``AutoModelForCausalLM.from_config`` of a small
config with random (seeded) weights, ``HF_HUB_OFFLINE`` is set before transformers is
imported, and transformers itself is imported only when such a model is built (it is
the optional extra ``remat[hf]``).

Defaults are CPU-sized: 4 layers, hidden size 128, 4 heads, vocabulary 1000, batch 4 of
64 tokens, dropout on where the family has it (GPT-2: ``resid_pdrop``, ``embd_pdrop``,
``attn_pdrop`` 0.1; Llama, Qwen2, Mistral: ``attention_dropout`` 0.1), ``use_cache``
off (a key/value cache is for generation; in training it only keeps tensors alive and a
rebuild would append to it again) and ``attn_implementation="sdpa"`` (transformers'
default; ``--set attn_implementation=eager`` for the reference kernels). Options are the
config's own fields, by their own names or the generic ones (``num_hidden_layers``,
``hidden_size``, ``num_attention_heads``, ``max_position_embeddings``; GPT-2 also takes
``n_layer``, ``n_embd``, ``n_head``, ``n_positions``), plus ``batch_size``, ``seq_len``,
``seed``, ``attn_implementation`` and ``dropout`` (every dropout of the family at once).
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from remat.errors import UsageError
from remat.models._common import check_int, check_prob, seeded

__all__ = ["FAMILIES", "PREFIX", "hf_factory", "hf_loss", "hf_model"]

PREFIX = "hf:"
INSTALL_HINT = "pip install 'remat[hf]'"
ATTENTION = ("sdpa", "eager")


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

# Options of the factory itself, not config fields.
_OWN = ("batch_size", "seq_len", "seed", "attn_implementation", "dropout")
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


def _family(model_type: str) -> Family:
    family = FAMILIES.get(model_type)
    if family is None:
        choices = ", ".join(PREFIX + name for name in FAMILIES)
        raise UsageError(
            f"unknown transformers model {PREFIX}{model_type}; choose one of {choices}"
        )
    return family


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


def _config_fields(config_class: Any) -> set[str]:
    fields = set(config_class().to_dict())
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


def hf_model(
    model_type: str,
    *,
    batch_size: int = 4,
    seq_len: int = 256,
    seed: int = 0,
    attn_implementation: str = "sdpa",
    dropout: float | None = None,
    **config: Any,
) -> tuple[nn.Module, dict[str, torch.Tensor], Callable[[nn.Module, Any], torch.Tensor]]:
    """A transformers causal LM of ``model_type`` from a small config, random weights.

    ``config`` overrides the config's fields (sizes by the family's or the generic
    names); ``dropout`` sets every dropout of the family. Returns the model in training
    mode, a batch ``{"input_ids", "attention_mask", "labels"}`` of shape
    (batch_size, seq_len) each, and :func:`hf_loss`.
    """
    family = _family(model_type)
    check_int("batch_size", batch_size)
    check_int("seq_len", seq_len)
    if attn_implementation not in ATTENTION:
        raise UsageError(
            f"option attn_implementation={attn_implementation!r} is invalid; give "
            f"{' or '.join(ATTENTION)}"
        )
    transformers = _import_transformers()
    config_class = getattr(transformers, family.config_class)
    fixed = [k for k in config if k in _FIXED]
    if fixed:
        raise UsageError(
            f"option {fixed[0]} of {PREFIX}{model_type} is fixed (use_cache off, return_dict "
            "on) because training needs it so; build the model yourself to change it"
        )
    valid = _config_fields(config_class) | set(family.names) | set(_OWN)
    unknown = [k for k in config if k not in valid]
    if unknown:
        raise _unknown(model_type, unknown, valid)
    overrides = dict(config)
    fields = _sizes(family, overrides, seq_len)
    drop = 0.1 if dropout is None else check_prob("dropout", dropout)
    fields.update(dict.fromkeys(family.dropouts, drop))
    fields.update(overrides)
    if family.config_class == "GPT2Config":
        # GPT-2's token ids (50256) would lie outside a small vocabulary
        for name in ("bos_token_id", "eos_token_id"):
            fields.setdefault(name, check_int("vocab_size", fields["vocab_size"], minimum=2) - 1)
    fields.update(use_cache=False, return_dict=True)
    try:
        cfg = config_class(**fields)
    except (TypeError, ValueError) as err:
        raise UsageError(f"{family.config_class} rejected these options ({err}); fix them") from err
    cfg._attn_implementation = attn_implementation
    vocab = check_int("vocab_size", cfg.vocab_size, minimum=2)
    with seeded(seed):
        model = transformers.AutoModelForCausalLM.from_config(
            cfg, attn_implementation=attn_implementation
        )
        ids = torch.randint(0, vocab, (batch_size, seq_len))
    model.loss_type = "ForCausalLM"  # what from_pretrained would set; saves a warning
    model.train()
    batch = {
        "input_ids": ids,  # (B, T)
        "attention_mask": torch.ones_like(ids),  # (B, T): no padding
        "labels": ids.clone(),  # (B, T): the model shifts them by one itself
    }
    return model, batch, hf_loss


def hf_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    """The causal-LM loss transformers computes from ``labels`` (next-token cross entropy)."""
    loss: torch.Tensor = model(**batch).loss
    return loss


def hf_factory(spec: str) -> Callable[..., Any]:
    """The factory of an ``hf:<model_type>`` spec (UsageError for an unknown type)."""
    model_type = spec[len(PREFIX) :]
    _family(model_type)

    def factory(
        *,
        batch_size: int = 4,
        seq_len: int = 256,
        seed: int = 0,
        attn_implementation: str = "sdpa",
        dropout: float | None = None,
        **config: Any,
    ) -> tuple[nn.Module, dict[str, torch.Tensor], Callable[[nn.Module, Any], torch.Tensor]]:
        return hf_model(
            model_type,
            batch_size=batch_size,
            seq_len=seq_len,
            seed=seed,
            attn_implementation=attn_implementation,
            dropout=dropout,
            **config,
        )

    factory.__name__ = factory.__qualname__ = f"hf_{model_type}"
    factory.__doc__ = f"``{spec}``: see :func:`remat.models.hf.hf_model`."
    return factory
