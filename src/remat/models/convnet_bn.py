"""A small ResNet-style CNN with BatchNorm in train mode (running stats are a side effect)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from remat.core.errors import UsageError
from remat.models._common import check_int, seeded


def _conv_bn(c_in: int, c_out: int, *, kernel: int, stride: int = 1) -> nn.Sequential:
    conv = nn.Conv2d(c_in, c_out, kernel, stride=stride, padding=kernel // 2, bias=False)
    return nn.Sequential(conv, nn.BatchNorm2d(c_out))


class ResBlock(nn.Module):
    """relu(conv-BN-ReLU-conv-BN(x) + skip(x)); skip is a 1x1 conv-BN when the shape changes."""

    def __init__(self, c_in: int, c_out: int, stride: int = 1) -> None:
        super().__init__()
        self.branch1 = _conv_bn(c_in, c_out, kernel=3, stride=stride)
        self.branch2 = _conv_bn(c_out, c_out, kernel=3)
        self.skip: nn.Module = (
            nn.Identity()
            if stride == 1 and c_in == c_out
            else _conv_bn(c_in, c_out, kernel=1, stride=stride)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.branch2(F.relu(self.branch1(x)))
        return F.relu(y + self.skip(x))


class ConvNetBN(nn.Module):
    """Stem conv-BN-ReLU, ``blocks`` of ``ResBlock``, global average pool, linear classifier."""

    def __init__(
        self, *, in_channels: int, channels: int, n_blocks: int, n_stages: int, num_classes: int
    ) -> None:
        super().__init__()
        self.stem = nn.Sequential(*_conv_bn(in_channels, channels, kernel=3), nn.ReLU())
        # Stage s >= 1 starts with a stride-2 block that doubles the channels.
        starts = {round(s * n_blocks / n_stages) for s in range(1, n_stages)}
        blocks: list[nn.Module] = []
        c = channels
        for i in range(n_blocks):
            if i in starts:
                blocks.append(ResBlock(c, 2 * c, stride=2))
                c *= 2
            else:
                blocks.append(ResBlock(c, c))
        self.blocks = nn.Sequential(*blocks)
        self.fc = nn.Linear(c, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Map images (B, C, H, W) to logits (B, num_classes)."""
        x = self.blocks(self.stem(x))  # (B, C', H', W')
        return self.fc(x.mean(dim=(2, 3)))


def convnet_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    """Cross entropy of the logits; ``batch`` is ``(images, labels)`` or a dict of them."""
    if isinstance(batch, dict):
        images, labels = batch["images"], batch["labels"]
    else:
        images, labels = batch
    return F.cross_entropy(model(images), labels)


def convnet_bn(
    *,
    n_blocks: int = 8,
    channels: int = 32,
    n_stages: int = 3,
    image_size: int = 32,
    in_channels: int = 3,
    num_classes: int = 10,
    batch_size: int = 32,
    seed: int = 0,
) -> tuple[ConvNetBN, tuple[torch.Tensor, torch.Tensor], Any]:
    """Build the network, a random ``(images, labels)`` batch and the loss.

    The ``n_blocks`` blocks form ``n_stages`` stages; each stage after the first halves the
    resolution and doubles ``channels``.
    """
    for name, value in (
        ("n_blocks", n_blocks),
        ("channels", channels),
        ("n_stages", n_stages),
        ("image_size", image_size),
        ("in_channels", in_channels),
        ("batch_size", batch_size),
    ):
        check_int(name, value)
    check_int("num_classes", num_classes, minimum=2)
    if n_stages > n_blocks:
        raise UsageError(
            f"n_stages={n_stages} exceeds n_blocks={n_blocks}; use at most one stage per block"
        )
    with seeded(seed):
        model = ConvNetBN(
            in_channels=in_channels,
            channels=channels,
            n_blocks=n_blocks,
            n_stages=n_stages,
            num_classes=num_classes,
        )
        images = torch.randn(batch_size, in_channels, image_size, image_size)
        labels = torch.randint(0, num_classes, (batch_size,))
    return model, (images, labels), convnet_loss
