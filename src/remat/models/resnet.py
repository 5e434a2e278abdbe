"""A small ResNet-18-shaped CNN: stem, ``layer1..layer4`` of BasicBlocks, pooled head."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from remat.models._common import check_int, seeded


class BasicBlock(nn.Module):
    """relu(bn(conv(relu(bn(conv(x))))) + shortcut(x)); the residual add is inside the block."""

    def __init__(self, c_in: int, c_out: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.downsample: nn.Module | None = None
        if stride != 1 or c_in != c_out:
            self.downsample = nn.Sequential(
                nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False), nn.BatchNorm2d(c_out)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        identity = x if self.downsample is None else self.downsample(x)
        return F.relu(out + identity)


class ResNet(nn.Module):
    """torchvision's ResNet layout, shrunk: ``conv1``/``bn1`` stem, ``layer1..4``, ``fc``."""

    def __init__(
        self, *, in_channels: int, width: int, blocks_per_layer: int, num_classes: int
    ) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, width, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        c = width
        layers = []
        for i in range(4):
            c_out = width * 2**i
            stride = 1 if i == 0 else 2
            blocks = [BasicBlock(c, c_out, stride)]
            blocks += [BasicBlock(c_out, c_out) for _ in range(blocks_per_layer - 1)]
            layers.append(nn.Sequential(*blocks))
            c = c_out
        self.layer1, self.layer2, self.layer3, self.layer4 = layers
        self.fc = nn.Linear(c, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Map images (B, C, H, W) to logits (B, num_classes)."""
        x = F.relu(self.bn1(self.conv1(x)))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def resnet_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    """Cross entropy of the logits; ``batch`` is ``(images, labels)`` or a dict of them."""
    if isinstance(batch, dict):
        images, labels = batch["images"], batch["labels"]
    else:
        images, labels = batch
    return F.cross_entropy(model(images), labels)


def resnet(
    *,
    width: int = 8,
    blocks_per_layer: int = 2,
    image_size: int = 32,
    in_channels: int = 3,
    num_classes: int = 10,
    batch_size: int = 16,
    seed: int = 0,
) -> tuple[ResNet, tuple[torch.Tensor, torch.Tensor], Any]:
    """Build the ResNet, a random ``(images, labels)`` batch and the loss.

    ``layer1..layer4`` each hold ``blocks_per_layer`` blocks; layers 2-4 halve the
    resolution and double ``width`` in their first block (a 1x1 projection shortcut).
    """
    for name, value in (
        ("width", width),
        ("blocks_per_layer", blocks_per_layer),
        ("image_size", image_size),
        ("in_channels", in_channels),
        ("batch_size", batch_size),
    ):
        check_int(name, value)
    check_int("num_classes", num_classes, minimum=2)
    with seeded(seed):
        model = ResNet(
            in_channels=in_channels,
            width=width,
            blocks_per_layer=blocks_per_layer,
            num_classes=num_classes,
        )
        images = torch.randn(batch_size, in_channels, image_size, image_size)
        labels = torch.randint(0, num_classes, (batch_size,))
    return model, (images, labels), resnet_loss
