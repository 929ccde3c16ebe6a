"""Models: a small fast CNN for CPU demos, CIFAR-style ResNets, and torchvision's zoo (tv:<name>)."""

from __future__ import annotations

import torch
from torch import nn

from .errors import UserError


def _conv_bn(cin: int, cout: int, stride: int = 1, kernel: int = 3) -> list[nn.Module]:
    return [nn.Conv2d(cin, cout, kernel, stride, kernel // 2, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True)]


def convnet(num_classes: int = 10) -> nn.Module:
    """Three conv-BN-ReLU stages with pooling: trains in seconds on a CPU, and has BatchNorm for SyncBN to matter."""
    return nn.Sequential(
        *_conv_bn(3, 16), nn.MaxPool2d(2),
        *_conv_bn(16, 32), nn.MaxPool2d(2),
        *_conv_bn(32, 64), nn.MaxPool2d(2),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, num_classes),
    )


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, cin: int, planes: int, stride: int):
        super().__init__()
        self.body = nn.Sequential(
            *_conv_bn(cin, planes, stride),
            nn.Conv2d(planes, planes, 3, 1, 1, bias=False), nn.BatchNorm2d(planes),
        )
        self.shortcut = _shortcut(cin, planes * self.expansion, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.body(x) + self.shortcut(x))


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, cin: int, planes: int, stride: int):
        super().__init__()
        self.body = nn.Sequential(
            *_conv_bn(cin, planes, 1, kernel=1),
            *_conv_bn(planes, planes, stride),
            nn.Conv2d(planes, planes * 4, 1, bias=False), nn.BatchNorm2d(planes * 4),
        )
        self.shortcut = _shortcut(cin, planes * self.expansion, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.body(x) + self.shortcut(x))


def _shortcut(cin: int, cout: int, stride: int) -> nn.Module:
    if stride == 1 and cin == cout:
        return nn.Identity()
    return nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))


class CifarResNet(nn.Module):
    """ResNet for 32x32 inputs: a 3x3 stem without max-pool, four stages at 32/16/8/4 pixels."""

    def __init__(self, block: type, layers: list[int], num_classes: int):
        super().__init__()
        self.stem = nn.Sequential(*_conv_bn(3, 64))
        stages, cin = [], 64
        for i, (planes, blocks) in enumerate(zip((64, 128, 256, 512), layers, strict=True)):
            for j in range(blocks):
                stages.append(block(cin, planes, 2 if (i > 0 and j == 0) else 1))
                cin = planes * block.expansion
        self.stages = nn.Sequential(*stages)
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.stages(self.stem(x)))


RESNETS = {
    "resnet18": (BasicBlock, [2, 2, 2, 2]),
    "resnet34": (BasicBlock, [3, 4, 6, 3]),
    "resnet50": (Bottleneck, [3, 4, 6, 3]),
}


def build(name: str, num_classes: int) -> nn.Module:
    if name == "convnet":
        return convnet(num_classes)
    if name in RESNETS:
        block, layers = RESNETS[name]
        return CifarResNet(block, layers, num_classes)
    if name.startswith("tv:"):
        try:
            import torchvision
        except ImportError:
            raise UserError(f"--model {name}: torchvision is not installed (pip install ddpk-trainer[vision])") from None
        zoo = name[3:]
        if zoo not in torchvision.models.list_models():
            raise UserError(f"--model {name}: torchvision has no model {zoo!r}")
        return torchvision.models.get_model(zoo, weights=None, num_classes=num_classes)
    raise UserError(f"--model: unknown model {name!r}")
