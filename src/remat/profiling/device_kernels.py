"""The target device's kernels in a fake profile, where they save other tensors than
this machine's CPU kernels (``remat.core.devices``).

On a CPU-only torch a fake CUDA tensor cannot be made, so a fake profile for an
accelerator runs on CPU fake tensors with two calls swapped for stand-ins that keep, for
backward, what the accelerator's kernel keeps:

* ``scaled_dot_product_attention`` runs as ``aten._scaled_dot_product_flash_attention_for_cpu``:
  it keeps the query, key, value, output and a float32 log-sum-exp of ``(b, heads, s)``,
  as CUDA's flash and memory-efficient kernels do (and GQA's key and value unexpanded),
  never the ``S x S`` probabilities that CPU's math path keeps with dropout in
  attention. Not counted: the kernels' 16-byte random-number state, and the
  memory-efficient kernel's log-sum-exp padded to a multiple of 32 positions (it runs
  where there is a mask: at most ``31 * b * heads * 4`` bytes per call).
* dropout runs as ``native_dropout``: a 1-byte mask, where CPU dropout keeps noise in the
  input's dtype.

transformers builds a causal mask for fake tensors (it cannot read whether a fake batch
has padding) where on the device, for a batch without padding, it passes ``is_causal``
and no mask, which runs the flash kernel: on an H200 (``benchmarks/accelerator_check.md``)
a Llama layer at batch 4, sequence 2048 kept 688.6 MiB with flash where the fake profile
with the mask kept 736.6 (the memory-efficient kernel keeps the mask). With
``masks_as_causal`` such a mask (boolean, ``(batch or 1, 1, s, s)`` for a square
attention, and shorter than the model's sliding window where it has one) runs as
``is_causal``, noted as ``flash (causal mask as is_causal)``, and transformers is asked
(its ``TRANSFORMERS_SDPA_FORCE_GQA`` switch, while the stand-ins run) to keep a grouped
key and value grouped, as it does on the device without a mask, where with a mask it
repeats them to every head (the H200's 48 MiB were those copies); where its version has
no such switch, the stand-in keeps one head of each group of the repeated ones
(``kv_groups``, from the model's config).

The profile records, per stage, which kernel each call was assumed to run
(``Profile.kernels``).
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils.module_tracker import ModuleTracker

from remat.core.devices import Device
from remat.profiling.op_costs import stage_of
from remat.runtime._torch_checkpoint import rebuilds_inside

__all__ = ["DeviceKernels"]

_FLASH_DTYPES = (torch.float16, torch.bfloat16)
_MAX_FLASH_HEAD_DIM = 256  # CUDA's flash kernel; larger heads run memory-efficient
_FORCE_GQA = "TRANSFORMERS_SDPA_FORCE_GQA"


def _sdpa_args(args: Sequence[Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale",
             "enable_gqa")
    found = dict(zip(names, args, strict=False))
    found.update(kwargs)
    return found


class _Active:
    """``mode`` pushed again as a torch-function mode (its module tracker stays entered)."""

    def __init__(self, mode: TorchFunctionMode) -> None:
        self.mode = mode

    def __enter__(self) -> None:
        TorchFunctionMode.__enter__(self.mode)

    def __exit__(self, *exc: Any) -> None:
        TorchFunctionMode.__exit__(self.mode, *exc)


class DeviceKernels(TorchFunctionMode):
    """Swaps attention and dropout for ``device``'s kernels; notes each attention call's
    kernel under the stage (of ``stages``) it ran in."""

    def __init__(self, device: Device, stages: Sequence[str], *, counting: bool = False,
                 masks_as_causal: bool = False, window: int | None = None,
                 kv_groups: int = 1) -> None:
        super().__init__()
        self.device = device
        self.stages = tuple(stages)
        self.masks_as_causal = masks_as_causal
        self.window = window
        self.kv_groups = kv_groups
        # only to count (one forward without grad): its hooks in a step with grad hold
        # tensors the profile would count
        self.modules = ModuleTracker() if counting else None
        # stage (or "outside the chain") -> kernel -> calls, counted while ``counting``
        self.calls: dict[str, Counter[str]] = {}

    def __enter__(self) -> DeviceKernels:
        if self.modules is not None:
            self.modules.__enter__()
        # transformers repeats a grouped key and value to every head where it passes a
        # mask (the device's fused kernels take a mask only so), and the repeated copies
        # are what attention saves; its own switch keeps them grouped, as the device's
        # run without a mask has them
        self._gqa = os.environ.get(_FORCE_GQA)
        if self.masks_as_causal:
            os.environ[_FORCE_GQA] = "1"
        # a torch-function mode is off inside its own handler, so inside backward(): the
        # rebuilds there must run the same kernels as the forward
        self._rebuilds = rebuilds_inside(lambda: _Active(self))
        self._rebuilds.__enter__()
        super().__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        self._rebuilds.__exit__(*exc)
        if self.masks_as_causal:
            if self._gqa is None:
                os.environ.pop(_FORCE_GQA, None)
            else:
                os.environ[_FORCE_GQA] = self._gqa
        if self.modules is not None:
            self.modules.__exit__(*exc)

    def per_stage(self) -> dict[str, dict[str, int]]:
        """Per stage that ran an attention call (and ``outside the chain``): kernel -> calls."""
        return {stage: dict(calls) for stage, calls in self.calls.items()}

    def _note(self, kernel: str) -> None:
        if self.modules is None:
            return
        self.calls.setdefault(stage_of(self.modules, self.stages), Counter())[kernel] += 1

    def __torch_function__(self, func: Callable[..., Any], types: Any,
                           args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None
                           ) -> Any:
        kwargs = dict(kwargs or {})
        if func is F.scaled_dot_product_attention and self.device.fused_attention:
            return self._attention(_sdpa_args(args, kwargs))
        if func is F.scaled_dot_product_attention:
            self._note("this machine's CPU kernel")
        if func in (F.dropout, torch.dropout) and self.device.fused_dropout:
            x = args[0] if args else kwargs["input"]
            p = args[1] if len(args) > 1 else kwargs.get("p", 0.5)
            train = args[2] if len(args) > 2 else kwargs.get("training", kwargs.get("train",
                                                                                 True))
            if train and 0 < p < 1 and torch.is_grad_enabled() and x.requires_grad:
                return torch.native_dropout(x, p, True)[0]
        return func(*args, **kwargs)

    def _attention(self, a: dict[str, Any]) -> torch.Tensor:
        q, k, v = a["query"], a["key"], a["value"]
        mask, causal = a.get("attn_mask"), bool(a.get("is_causal", False))
        as_causal = self.masks_as_causal and not causal and self._causal_shaped(q, k, mask)
        if as_causal:
            mask, causal = None, True
            if self.kv_groups > 1 and k.shape[-3] == q.shape[-3]:
                # a transformers without the switch repeated the grouped heads: keep
                # one of each group, as the device's kernel does (the copies go)
                k = k[..., ::self.kv_groups, :, :].contiguous()
                v = v[..., ::self.kv_groups, :, :].contiguous()
        flash = (mask is None and q.dtype in _FLASH_DTYPES
                 and q.shape[-1] <= _MAX_FLASH_HEAD_DIM)
        kernel = "flash" if flash else "memory-efficient"
        self._note(f"{kernel} (causal mask as is_causal)" if as_causal else kernel)
        # Under fake tensors this op's meta kernel takes grouped key/value heads as they
        # are, as the fused CUDA kernels keep them (docs/fake.md).
        out = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, float(a.get("dropout_p", 0.0) or 0.0), causal,
            attn_mask=mask, scale=a.get("scale"),
        )[0]
        return out

    def _causal_shaped(self, q: torch.Tensor, k: torch.Tensor, mask: Any) -> bool:
        """Whether ``mask`` has the shape of transformers' causal mask for a batch
        without padding: boolean, one head, square, shorter than the sliding window."""
        if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or mask.dim() != 4:
            return False
        s = q.shape[-2]
        return (k.shape[-2] == s and tuple(mask.shape[1:]) == (1, s, s)
                and mask.shape[0] in (1, q.shape[0])
                and (self.window is None or s < self.window))
