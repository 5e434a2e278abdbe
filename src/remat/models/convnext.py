"""A small ConvNeXt (timm layout): patchify stem, four stages of downsample + blocks, head."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from remat.core.errors import UsageError
from remat.models._common import check_int, seeded


class LayerNorm2d(nn.LayerNorm):
    """LayerNorm over the channels of a (B, C, H, W) tensor."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.permute(0, 2, 3, 1)
        x = F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
        return x.permute(0, 3, 1, 2)


class ConvNeXtBlock(nn.Module):
    """x + gamma * mlp(norm(dwconv(x))); the residual add and layer scale are inside."""

    def __init__(self, dim: int, *, mlp_ratio: int, layer_scale: float) -> None:
        super().__init__()
        self.conv_dw = nn.Conv2d(dim, dim, 7, padding=3, groups=dim)
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, mlp_ratio * dim)
        self.fc2 = nn.Linear(mlp_ratio * dim, dim)
        self.gamma = nn.Parameter(torch.full((dim,), layer_scale))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv_dw(x).permute(0, 2, 3, 1)  # (B, H, W, C)
        y = self.fc2(F.gelu(self.fc1(self.norm(y))))
        return x + (self.gamma * y).permute(0, 3, 1, 2)


class ConvNeXtStage(nn.Module):
    """``downsample`` (norm + stride-2 conv, or Identity in the first stage), then ``blocks``."""

    def __init__(
        self, c_in: int, c_out: int, depth: int, *, first: bool, mlp_ratio: int, layer_scale: float
    ) -> None:
        super().__init__()
        self.downsample: nn.Module = (
            nn.Identity()
            if first
            else nn.Sequential(LayerNorm2d(c_in), nn.Conv2d(c_in, c_out, 2, stride=2))
        )
        self.blocks = nn.Sequential(
            *(
                ConvNeXtBlock(c_out, mlp_ratio=mlp_ratio, layer_scale=layer_scale)
                for _ in range(depth)
            )
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(self.downsample(x))


class ConvNeXt(nn.Module):
    """``stem`` (4x4 patchify conv + norm), ``stages`` (nn.Sequential of 4), pooled ``head``."""

    def __init__(
        self,
        *,
        in_channels: int,
        dims: list[int],
        depths: list[int],
        num_classes: int,
        mlp_ratio: int,
        layer_scale: float,
    ) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(in_channels, dims[0], 4, stride=4), LayerNorm2d(dims[0])
        )
        c = dims[0]
        stages = []
        for i, (dim, depth) in enumerate(zip(dims, depths, strict=True)):
            stages.append(
                ConvNeXtStage(
                    c, dim, depth, first=i == 0, mlp_ratio=mlp_ratio, layer_scale=layer_scale
                )
            )
            c = dim
        self.stages = nn.Sequential(*stages)
        self.norm = nn.LayerNorm(c)
        self.head = nn.Linear(c, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Map images (B, C, H, W) to logits (B, num_classes)."""
        x = self.stages(self.stem(x))
        return self.head(self.norm(x.mean(dim=(2, 3))))


def convnext_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    """Cross entropy of the logits; ``batch`` is ``(images, labels)`` or a dict of them."""
    if isinstance(batch, dict):
        images, labels = batch["images"], batch["labels"]
    else:
        images, labels = batch
    return F.cross_entropy(model(images), labels)


def _int_list(name: str, value: object, length: int) -> list[int]:
    items = str(value).split(",")
    try:
        numbers = [int(item) for item in items]
    except ValueError:
        numbers = []
    if len(numbers) != length or min(numbers) < 1:
        raise UsageError(
            f"option {name}={value!r} is invalid; give {length} whole numbers >= 1 "
            f"separated by commas, e.g. {name}=" + ",".join(["2"] * length)
        )
    return numbers


def convnext(
    *,
    depths: str = "2,2,4,2",
    width: int = 16,
    mlp_ratio: int = 4,
    layer_scale: float = 1e-1,
    image_size: int = 64,
    in_channels: int = 3,
    num_classes: int = 10,
    batch_size: int = 16,
    seed: int = 0,
) -> tuple[ConvNeXt, tuple[torch.Tensor, torch.Tensor], Any]:
    """Build the ConvNeXt, a random ``(images, labels)`` batch and the loss.

    ``depths`` gives the blocks of the four stages; stage i has ``width * 2**i`` channels
    and (after the first) starts with a norm + stride-2 conv that halves the resolution.
    """
    depth_list = _int_list("depths", depths, 4)
    for name, value in (
        ("width", width),
        ("mlp_ratio", mlp_ratio),
        ("image_size", image_size),
        ("in_channels", in_channels),
        ("batch_size", batch_size),
    ):
        check_int(name, value)
    check_int("num_classes", num_classes, minimum=2)
    if isinstance(layer_scale, bool) or not isinstance(layer_scale, (int, float)):
        raise UsageError(f"option layer_scale={layer_scale!r} is invalid; give a number")
    if image_size % 32:
        raise UsageError(
            f"image_size={image_size} is not a multiple of 32 (the stem and three "
            "downsamples divide it by 32); pick one that is"
        )
    with seeded(seed):
        model = ConvNeXt(
            in_channels=in_channels,
            dims=[width * 2**i for i in range(4)],
            depths=depth_list,
            num_classes=num_classes,
            mlp_ratio=mlp_ratio,
            layer_scale=float(layer_scale),
        )
        images = torch.randn(batch_size, in_channels, image_size, image_size)
        labels = torch.randint(0, num_classes, (batch_size,))
    return model, (images, labels), convnext_loss
