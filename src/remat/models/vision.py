"""Small CNNs laid out as torchvision lays out MobileNetV2, EfficientNet and VGG.

Each has a ``features`` ``nn.Sequential`` that mixes layers of several kinds (a stem, the
blocks, a head conv; or, in VGG, bare convolutions, activations and pooling), then an
average pool and a ``classifier``. Stage discovery finds their chains inside those mixed
containers (docs/stages.md, rules 7 and 8). The classes and attribute names follow
torchvision's (``Conv2dNormActivation`` is :class:`ConvNormActivation` here), so the
module paths (``features.3.conv.1``) read the same.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from remat.core.errors import UsageError
from remat.models._common import check_int, check_prob, seeded
from remat.models.convnet_bn import convnet_loss

__all__ = ["efficientnet", "mobilenet", "vgg"]


class ConvNormActivation(nn.Sequential):
    """Conv, BatchNorm and (unless ``act`` is None) an in-place activation, as torchvision's
    ``Conv2dNormActivation``."""

    def __init__(self, c_in: int, c_out: int, kernel: int = 3, stride: int = 1,
                 groups: int = 1, act: type[nn.Module] | None = nn.ReLU6) -> None:
        layers: list[nn.Module] = [
            nn.Conv2d(c_in, c_out, kernel, stride, (kernel - 1) // 2, groups=groups,
                      bias=False),
            nn.BatchNorm2d(c_out),
        ]
        if act is not None:
            layers.append(act(inplace=True))
        super().__init__(*layers)


class InvertedResidual(nn.Module):
    """MobileNetV2's block: 1x1 expand, 3x3 depthwise, 1x1 project, residual when shapes match."""

    def __init__(self, c_in: int, c_out: int, stride: int, expand: int) -> None:
        super().__init__()
        hidden = c_in * expand
        self.use_res_connect = stride == 1 and c_in == c_out
        layers: list[nn.Module] = []
        if expand != 1:
            layers.append(ConvNormActivation(c_in, hidden, kernel=1))
        layers += [
            ConvNormActivation(hidden, hidden, stride=stride, groups=hidden),
            nn.Conv2d(hidden, c_out, 1, bias=False),
            nn.BatchNorm2d(c_out),
        ]
        self.conv = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv(x) if self.use_res_connect else self.conv(x)


class SqueezeExcitation(nn.Module):
    """x * sigmoid(fc2(silu(fc1(mean over space of x)))), as torchvision's."""

    def __init__(self, channels: int, squeezed: int) -> None:
        super().__init__()
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc1 = nn.Conv2d(channels, squeezed, 1)
        self.fc2 = nn.Conv2d(squeezed, channels, 1)
        self.activation = nn.SiLU()
        self.scale_activation = nn.Sigmoid()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = self.fc2(self.activation(self.fc1(self.avgpool(x))))
        return self.scale_activation(scale) * x


class MBConv(nn.Module):
    """EfficientNet's block: expand, depthwise, squeeze-excitation, project; residual when
    shapes match (no stochastic depth)."""

    def __init__(self, c_in: int, c_out: int, stride: int, expand: int, kernel: int) -> None:
        super().__init__()
        hidden = c_in * expand
        self.use_res_connect = stride == 1 and c_in == c_out
        layers: list[nn.Module] = []
        if expand != 1:
            layers.append(ConvNormActivation(c_in, hidden, kernel=1, act=nn.SiLU))
        layers += [
            ConvNormActivation(hidden, hidden, kernel=kernel, stride=stride, groups=hidden,
                               act=nn.SiLU),
            SqueezeExcitation(hidden, max(1, c_in // 4)),
            ConvNormActivation(hidden, c_out, kernel=1, act=None),
        ]
        self.block = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.block(x)
        return x + y if self.use_res_connect else y


class Classifier(nn.Module):
    """``features``, global average pool, ``classifier``: torchvision's layout."""

    def __init__(self, features: nn.Sequential, classifier: nn.Sequential,
                 pool: int = 1) -> None:
        super().__init__()
        self.features = features
        self.avgpool = nn.AdaptiveAvgPool2d(pool)
        self.classifier = classifier

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Map images (B, C, H, W) to logits (B, num_classes)."""
        return self.classifier(torch.flatten(self.avgpool(self.features(x)), 1))


def _scaled(channels: int, width: int) -> int:
    return max(1, channels * width // 8)


def _checked(options: dict[str, Any], image_size: int, smallest: int) -> None:
    for name, value in options.items():
        check_int(name, value)
    if image_size < smallest:
        raise UsageError(f"option image_size={image_size} is too small for the network's "
                         f"downsampling; give at least {smallest}")


def _batch(batch_size: int, image_size: int, num_classes: int) -> tuple[torch.Tensor,
                                                                         torch.Tensor]:
    images = torch.randn(batch_size, 3, image_size, image_size)
    return images, torch.randint(0, num_classes, (batch_size,))


# (expansion, channels at width 8, blocks, stride of the first): eight blocks in four stages
_MOBILENET = ((1, 8, 1, 1), (6, 12, 2, 2), (6, 16, 3, 2), (6, 24, 2, 1))


def mobilenet(
    *,
    width: int = 8,
    image_size: int = 32,
    num_classes: int = 10,
    dropout: float = 0.2,
    batch_size: int = 16,
    seed: int = 0,
) -> tuple[Classifier, tuple[torch.Tensor, torch.Tensor], Any]:
    """A MobileNetV2-shaped network: ``features`` holds a stem ``ConvNormActivation``, eight
    ``InvertedResidual`` blocks and a 1x1 head ``ConvNormActivation`` side by side.

    ``width`` scales every channel count (8 is the base: 8 to 24 channels, a 6x expansion
    inside the blocks); the image is halved three times.
    """
    _checked({"width": width, "image_size": image_size, "num_classes": num_classes,
              "batch_size": batch_size}, image_size, 8)
    check_int("num_classes", num_classes, minimum=2)
    check_prob("dropout", dropout)
    with seeded(seed):
        c = _scaled(8, width)
        layers: list[nn.Module] = [ConvNormActivation(3, c, stride=2)]
        for expand, channels, n, stride in _MOBILENET:
            for i in range(n):
                out = _scaled(channels, width)
                layers.append(InvertedResidual(c, out, stride if i == 0 else 1, expand))
                c = out
        head = _scaled(64, width)
        layers.append(ConvNormActivation(c, head, kernel=1))
        model = Classifier(nn.Sequential(*layers),
                           nn.Sequential(nn.Dropout(dropout), nn.Linear(head, num_classes)))
        batch = _batch(batch_size, image_size, num_classes)
    return model, batch, convnet_loss


# (expansion, channels at width 8, blocks, stride of the first, kernel): blocks of four
# widths in four stages, as EfficientNet-B0's first four
_EFFICIENTNET = ((1, 8, 1, 1, 3), (6, 12, 2, 2, 3), (6, 16, 2, 2, 5), (6, 24, 3, 2, 3))


def efficientnet(
    *,
    width: int = 8,
    image_size: int = 32,
    num_classes: int = 10,
    dropout: float = 0.2,
    batch_size: int = 16,
    seed: int = 0,
) -> tuple[Classifier, tuple[torch.Tensor, torch.Tensor], Any]:
    """An EfficientNet-shaped network: ``features`` holds a stem ``ConvNormActivation``, four
    ``nn.Sequential`` stages of ``MBConv`` blocks (1, 2, 2 and 3 blocks of growing width,
    with squeeze-excitation) and a 1x1 head ``ConvNormActivation``.

    ``width`` scales every channel count (8 is the base); the image is halved four times.
    """
    _checked({"width": width, "image_size": image_size, "num_classes": num_classes,
              "batch_size": batch_size}, image_size, 16)
    check_int("num_classes", num_classes, minimum=2)
    check_prob("dropout", dropout)
    with seeded(seed):
        c = _scaled(8, width)
        layers: list[nn.Module] = [ConvNormActivation(3, c, stride=2, act=nn.SiLU)]
        for expand, channels, n, stride, kernel in _EFFICIENTNET:
            stage: list[nn.Module] = []
            for i in range(n):
                out = _scaled(channels, width)
                stage.append(MBConv(c, out, stride if i == 0 else 1, expand, kernel))
                c = out
            layers.append(nn.Sequential(*stage))
        head = _scaled(64, width)
        layers.append(ConvNormActivation(c, head, kernel=1, act=nn.SiLU))
        model = Classifier(nn.Sequential(*layers),
                           nn.Sequential(nn.Dropout(dropout), nn.Linear(head, num_classes)))
        batch = _batch(batch_size, image_size, num_classes)
    return model, batch, convnet_loss


def _vgg_features(config: str, width: int, batch_norm: bool) -> tuple[nn.Sequential, int]:
    layers: list[nn.Module] = []
    c = 3
    for item in config.split(","):
        item = item.strip()
        if item == "M":
            layers.append(nn.MaxPool2d(2, 2))
            continue
        try:
            out = _scaled(int(item), width)
        except ValueError:
            raise UsageError(f"option config={config!r} is invalid; give channel counts and "
                             "M (a max pool) separated by commas, like 8,M,16,M") from None
        layers.append(nn.Conv2d(c, out, 3, padding=1))
        if batch_norm:
            layers.append(nn.BatchNorm2d(out))
        layers.append(nn.ReLU(inplace=True))
        c = out
    if c == 3:
        raise UsageError(f"option config={config!r} has no convolution; give at least one "
                         "channel count, like 8,M,16,M")
    return nn.Sequential(*layers), c


def vgg(
    *,
    config: str = "8,M,16,M,32,32,M,64,64,M",
    width: int = 8,
    batch_norm: bool = False,
    hidden: int = 64,
    image_size: int = 32,
    num_classes: int = 10,
    dropout: float = 0.5,
    batch_size: int = 16,
    seed: int = 0,
) -> tuple[Classifier, tuple[torch.Tensor, torch.Tensor], Any]:
    """A VGG-shaped network: ``features`` is one flat ``nn.Sequential`` of 3x3 convolutions,
    in-place ReLUs (BatchNorm after each conv with ``batch_norm=true``) and 2x2 max pools,
    no block modules at all; then a 2x2 average pool and a three-layer ``classifier``.

    ``config`` lists the convolutions' channels at width 8 and ``M`` for each pool
    (torchvision's VGG11 halved, by default).
    """
    _checked({"width": width, "hidden": hidden, "image_size": image_size,
              "num_classes": num_classes, "batch_size": batch_size}, image_size, 1)
    check_int("num_classes", num_classes, minimum=2)
    check_prob("dropout", dropout)
    if not isinstance(batch_norm, bool):
        raise UsageError(f"option batch_norm={batch_norm!r} is invalid; give true or false")
    pools = str(config).split(",").count("M")
    if image_size < 2 ** pools:
        raise UsageError(f"option image_size={image_size} is too small for {pools} max "
                         f"pools; give at least {2 ** pools}")
    with seeded(seed):
        features, c = _vgg_features(str(config), width, batch_norm)
        classifier = nn.Sequential(
            nn.Linear(c * 4, hidden), nn.ReLU(inplace=True), nn.Dropout(dropout),
            nn.Linear(hidden, hidden), nn.ReLU(inplace=True), nn.Dropout(dropout),
            nn.Linear(hidden, num_classes),
        )
        model = Classifier(features, classifier, pool=2)
        batch = _batch(batch_size, image_size, num_classes)
    return model, batch, convnet_loss

