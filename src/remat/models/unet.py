"""A small diffusers-shaped UNet: down blocks, a mid block, up blocks with skip concatenation."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from remat.core.errors import UsageError
from remat.models._common import check_int, check_prob, seeded


class ResnetBlock(nn.Module):
    """norm-SiLU-conv, plus the projected time embedding, norm-SiLU-dropout-conv, residual add.

    Called as ``block(h, temb=t)``: the time embedding arrives by keyword, as in diffusers.
    """

    def __init__(self, c_in: int, c_out: int, temb_dim: int, groups: int, dropout: float) -> None:
        super().__init__()
        self.norm1 = nn.GroupNorm(groups, c_in)
        self.conv1 = nn.Conv2d(c_in, c_out, 3, padding=1)
        self.time_emb_proj = nn.Linear(temb_dim, c_out)
        self.norm2 = nn.GroupNorm(groups, c_out)
        self.dropout = nn.Dropout(dropout)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1)
        self.conv_shortcut: nn.Module | None = nn.Conv2d(c_in, c_out, 1) if c_in != c_out else None

    def forward(self, x: torch.Tensor, temb: torch.Tensor | None = None) -> torch.Tensor:
        h = self.conv1(F.silu(self.norm1(x)))
        if temb is not None:
            h = h + self.time_emb_proj(F.silu(temb))[:, :, None, None]
        h = self.conv2(self.dropout(F.silu(self.norm2(h))))
        skip = x if self.conv_shortcut is None else self.conv_shortcut(x)
        return skip + h


class DownBlock(nn.Module):
    """``resnets`` (an nn.ModuleList), then a stride-2 ``downsample`` conv unless last.

    Returns the downsampled tensor and the skip tensor (the resnets' output).
    """

    def __init__(
        self,
        c_in: int,
        c_out: int,
        n: int,
        temb_dim: int,
        groups: int,
        dropout: float,
        *,
        last: bool,
    ) -> None:
        super().__init__()
        self.resnets = nn.ModuleList(
            ResnetBlock(c_in if i == 0 else c_out, c_out, temb_dim, groups, dropout)
            for i in range(n)
        )
        self.downsample: nn.Module | None = (
            None if last else nn.Conv2d(c_out, c_out, 3, stride=2, padding=1)
        )

    def forward(self, h: torch.Tensor, temb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        for resnet in self.resnets:
            h = resnet(h, temb=temb)
        skip = h
        if self.downsample is not None:
            h = self.downsample(h)
        return h, skip


class MidBlock(nn.Module):
    """Two resnets at the lowest resolution."""

    def __init__(self, c: int, temb_dim: int, groups: int, dropout: float) -> None:
        super().__init__()
        self.resnets = nn.ModuleList(ResnetBlock(c, c, temb_dim, groups, dropout) for _ in range(2))

    def forward(self, h: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        for resnet in self.resnets:
            h = resnet(h, temb=temb)
        return h


class UpBlock(nn.Module):
    """Concatenate the matching down block's skip on channels, ``resnets``, then upsample."""

    def __init__(
        self,
        c_in: int,
        c_skip: int,
        c_out: int,
        n: int,
        temb_dim: int,
        groups: int,
        dropout: float,
        *,
        last: bool,
    ) -> None:
        super().__init__()
        self.resnets = nn.ModuleList(
            ResnetBlock((c_in + c_skip) if i == 0 else c_out, c_out, temb_dim, groups, dropout)
            for i in range(n)
        )
        self.upsample: nn.Module | None = None if last else nn.Conv2d(c_out, c_out, 3, padding=1)

    def forward(self, h: torch.Tensor, skip: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        h = torch.cat([h, skip], dim=1)
        for resnet in self.resnets:
            h = resnet(h, temb=temb)
        if self.upsample is not None:
            h = self.upsample(F.interpolate(h, scale_factor=2.0, mode="nearest"))
        return h


def timestep_embedding(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Sinusoidal embedding (B, dim) of integer timesteps (B,)."""
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32) / half)
    args = t.float()[:, None] * freqs[None, :]
    return torch.cat([torch.sin(args), torch.cos(args)], dim=1)


class UNet(nn.Module):
    """``time_embedding``, ``conv_in``, ``down_blocks``, ``mid_block``, ``up_blocks``, out."""

    def __init__(
        self,
        *,
        in_channels: int,
        channels: int,
        levels: int,
        layers_per_block: int,
        groups: int,
        dropout: float,
    ) -> None:
        super().__init__()
        temb_dim = 4 * channels
        self.temb_in = channels
        self.time_embedding = nn.Sequential(
            nn.Linear(channels, temb_dim), nn.SiLU(), nn.Linear(temb_dim, temb_dim)
        )
        self.conv_in = nn.Conv2d(in_channels, channels, 3, padding=1)
        widths = [channels * min(2**i, 4) for i in range(levels)]
        self.down_blocks = nn.ModuleList()
        c = channels
        for i, w in enumerate(widths):
            last = i == levels - 1
            self.down_blocks.append(
                DownBlock(c, w, layers_per_block, temb_dim, groups, dropout, last=last)
            )
            c = w
        self.mid_block = MidBlock(c, temb_dim, groups, dropout)
        self.up_blocks = nn.ModuleList()
        for i, w in enumerate(reversed(widths)):
            last = i == levels - 1
            self.up_blocks.append(
                UpBlock(c, w, w, layers_per_block, temb_dim, groups, dropout, last=last)
            )
            c = w
        self.conv_norm_out = nn.GroupNorm(groups, c)
        self.conv_out = nn.Conv2d(c, in_channels, 3, padding=1)

    def forward(self, x: torch.Tensor, timesteps: torch.Tensor) -> torch.Tensor:
        """Predict the noise (B, C, H, W) in ``x`` at integer ``timesteps`` (B,)."""
        temb = self.time_embedding(timestep_embedding(timesteps, self.temb_in))
        h = self.conv_in(x)
        skips = []
        for down in self.down_blocks:
            h, skip = down(h, temb)
            skips.append(skip)
        h = self.mid_block(h, temb)
        for up in self.up_blocks:
            h = up(h, skips.pop(), temb)
        return self.conv_out(F.silu(self.conv_norm_out(h)))


def unet_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    """MSE of the predicted noise; ``batch`` is ``(noisy, timesteps, noise)`` or a dict of them."""
    if isinstance(batch, dict):
        noisy, timesteps, noise = batch["noisy"], batch["timesteps"], batch["noise"]
    else:
        noisy, timesteps, noise = batch
    return F.mse_loss(model(noisy, timesteps), noise)


def unet(
    *,
    channels: int = 16,
    levels: int = 3,
    layers_per_block: int = 2,
    groups: int = 4,
    dropout: float = 0.1,
    image_size: int = 32,
    in_channels: int = 3,
    batch_size: int = 8,
    seed: int = 0,
) -> tuple[UNet, tuple[torch.Tensor, torch.Tensor, torch.Tensor], Any]:
    """Build the UNet, a random ``(noisy, timesteps, noise)`` batch and the loss.

    ``levels`` down blocks (each ``layers_per_block`` resnets, then a stride-2 conv except
    the last) with ``channels * min(2**i, 4)`` channels, a mid block of two resnets, and
    ``levels`` up blocks that concatenate the matching skip tensor before their resnets.
    """
    for name, value in (
        ("channels", channels),
        ("levels", levels),
        ("layers_per_block", layers_per_block),
        ("groups", groups),
        ("image_size", image_size),
        ("in_channels", in_channels),
        ("batch_size", batch_size),
    ):
        check_int(name, value)
    dropout = check_prob("dropout", dropout)
    if channels % groups or channels % 2:
        raise UsageError(
            f"channels={channels} is not an even multiple of groups={groups}; "
            "pick sizes where it is"
        )
    if image_size % 2 ** (levels - 1):
        raise UsageError(
            f"image_size={image_size} is not divisible by 2**(levels-1)={2 ** (levels - 1)}; "
            "pick a size that is"
        )
    with seeded(seed):
        model = UNet(
            in_channels=in_channels,
            channels=channels,
            levels=levels,
            layers_per_block=layers_per_block,
            groups=groups,
            dropout=dropout,
        )
        noise = torch.randn(batch_size, in_channels, image_size, image_size)
        images = torch.randn(batch_size, in_channels, image_size, image_size)
        timesteps = torch.randint(0, 1000, (batch_size,))
        noisy = images + noise
    return model, (noisy, timesteps, noise), unet_loss
