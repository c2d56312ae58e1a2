"""A ResNet-18 laid out as torchvision lays it out, written here for the tests, small enough
to train on the CPU (3x16x16 images, a configurable base width).

What it shares with torchvision's model (He et al. 2016, "Deep Residual Learning"): the
module names (``conv1``, ``bn1``, ``layer1``..``layer4`` of two ``BasicBlock`` each, a
``downsample`` branch where a block changes stride or width, ``fc``), BatchNorm after every
convolution, and the habit that matters to `engine.init_empty`: the constructor
initialises the weights itself, outside any ``reset_parameters()``: Kaiming-normal
convolutions (fan-out, ReLU gain), BatchNorm scale 1 and shift 0, and with
``zero_init_residual`` the last BatchNorm of each block at scale 0. The stem is the one
small-image ResNets use (a 3x3 convolution of stride 1, no max-pool), so that 16x16 inputs
still give layer4 a 2x2 map.
"""

from __future__ import annotations

import torch
from torch import nn


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with BatchNorm, added to the input (through `downsample` when
    the stride or width changes), then ReLU."""

    def __init__(self, inputs: int, width: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(inputs, width, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(width, width, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.downsample: nn.Module | None = None
        if stride != 1 or inputs != width:
            self.downsample = nn.Sequential(
                nn.Conv2d(inputs, width, 1, stride=stride, bias=False), nn.BatchNorm2d(width)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(N, inputs, H, W) -> (N, width, H / stride, W / stride)."""
        shortcut = x if self.downsample is None else self.downsample(x)
        y = self.relu(self.bn1(self.conv1(x)))
        return self.relu(self.bn2(self.conv2(y)) + shortcut)


class ResNet18(nn.Module):
    """Stem, four stages of two blocks (widths w, 2w, 4w, 8w; stages 2-4 halve the map),
    global average pooling and a linear classifier."""

    def __init__(self, num_classes: int = 10, width: int = 8, zero_init_residual: bool = False):
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        widths = [width, 2 * width, 4 * width, 8 * width]
        inputs = width
        for stage, stage_width in enumerate(widths, start=1):
            stride = 1 if stage == 1 else 2
            blocks = [BasicBlock(inputs, stage_width, stride), BasicBlock(stage_width, stage_width)]
            setattr(self, f"layer{stage}", nn.Sequential(*blocks))
            inputs = stage_width
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(widths[-1], num_classes)
        # Initialised here, as torchvision does, not in a reset_parameters().
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(module, nn.BatchNorm2d):
                nn.init.constant_(module.weight, 1)
                nn.init.constant_(module.bias, 0)
        if zero_init_residual:
            # Each residual branch starts as zero, so each block starts as the identity.
            for module in self.modules():
                if isinstance(module, BasicBlock):
                    nn.init.constant_(module.bn2.weight, 0)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """(N, 3, H, W) images -> (N, num_classes) logits."""
        x = self.relu(self.bn1(self.conv1(images)))
        for stage in (self.layer1, self.layer2, self.layer3, self.layer4):
            x = stage(x)
        return self.fc(torch.flatten(self.avgpool(x), 1))


def resnet18(num_classes: int = 10, width: int = 8, zero_init_residual: bool = False) -> ResNet18:
    """A ResNet-18 of base width `width` (torchvision's is 64) for `num_classes` classes."""
    return ResNet18(num_classes, width, zero_init_residual)
