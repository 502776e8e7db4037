"""The convolutional models the field's pFL benchmarks use, written so they run batched over clients.

* :class:`FedAvgCNN` — PFLlib's 4-layer CNN (``system/flcore/trainmodel/models.py``), the CNN of McMahan et al.
  (AISTATS 2017, "Communication-Efficient Learning of Deep Networks from Decentralized Data"): conv 5×5 32 → ReLU →
  max-pool 2 → conv 5×5 64 → ReLU → max-pool 2 → linear 512 → ReLU → linear. No padding, as PFLlib: the flattened
  size is 1024 on 28×28 inputs and 1600 on 32×32 (PFLlib's ``dim``); 582,026 parameters on 1×28×28 with 10 classes.
* :class:`FEMNISTCNN` — LEAF's FEMNIST model (Caldas et al. 2018, ``models/femnist/cnn.py``): conv 5×5 32 "same"
  → ReLU → max-pool 2 → conv 5×5 64 "same" → ReLU → max-pool 2 → dense 2048 → ReLU → dense 62.
* :class:`LeNet5` — LeCun et al. (1998) in its common modern form: conv 5×5 6 → ReLU → max-pool 2 → conv 5×5 16 →
  ReLU → max-pool 2 → 120 → 84 → classes (ReLU and max-pooling instead of the original scaled tanh and subsampling;
  28×28 inputs are padded by 2 so the feature map is the original 5×5).
* :class:`ResNet18` — He et al. (CVPR 2016) with torchvision's layer names and shapes (``conv1``, ``bn1``,
  ``layer1.0.conv1`` …, ``fc``), so torchvision weights load into it. ``norm="group"``: GroupNorm with 2 groups
  per layer (Hsieh et al., ICML 2020, "The Non-IID Data Quagmire of Decentralized Machine Learning", the usual
  federated choice: per-sample statistics, runs batched as is); ``norm="batch"``: BatchNorm with running
  statistics (kept per client or published by the loop, docs/reliability.md). ``stem="imagenet"`` is torchvision's
  7×7/2 convolution and max-pool (what PFLlib and FL-bench run, even on 32×32 images); ``stem="cifar"`` is the 3×3/1
  convolution without max-pool of He et al.'s CIFAR experiments.

Every layer is out of place (no ``inplace=True`` ReLU, no ``out += identity``), so ``torch.func.vmap`` over
per-client parameters runs each model batched, with numbers equal to a per-client loop
(tests/engine/test_vision_models.py).
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor, nn

__all__ = ["FEMNISTCNN", "FedAvgCNN", "LeNet5", "ResNet18"]


def _pooled_side(side: int, kernel: int, padding: int) -> int:
    """Side of a square map after a ``kernel`` convolution (stride 1, ``padding``) and a 2×2 max-pool."""
    return (side + 2 * padding - kernel + 1) // 2


class FedAvgCNN(nn.Module):
    """PFLlib's ``FedAvgCNN`` (see the module docstring); ``image_size`` 28 (MNIST-like) or 32 (CIFAR-like)."""

    def __init__(self, in_channels: int = 1, num_classes: int = 10, image_size: int = 28) -> None:
        super().__init__()
        side = _pooled_side(_pooled_side(image_size, 5, 0), 5, 0)
        if side < 1:
            raise ValueError(f"FedAvgCNN needs images of at least 16x16 pixels, got image_size={image_size}")
        self.conv1 = nn.Sequential(nn.Conv2d(in_channels, 32, 5), nn.ReLU(), nn.MaxPool2d(2))
        self.conv2 = nn.Sequential(nn.Conv2d(32, 64, 5), nn.ReLU(), nn.MaxPool2d(2))
        self.fc1 = nn.Sequential(nn.Linear(64 * side * side, 512), nn.ReLU())
        self.fc = nn.Linear(512, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(self.fc1(self.conv2(self.conv1(x)).flatten(1)))


class FEMNISTCNN(nn.Module):
    """LEAF's FEMNIST CNN (see the module docstring) on ``1×28×28`` images; 62 classes by default."""

    def __init__(self, num_classes: int = 62, in_channels: int = 1, image_size: int = 28) -> None:
        super().__init__()
        side = image_size // 4
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, 32, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
        )
        self.fc1 = nn.Sequential(nn.Linear(64 * side * side, 2048), nn.ReLU())
        self.fc = nn.Linear(2048, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(self.fc1(self.features(x).flatten(1)))


class LeNet5(nn.Module):
    """LeNet-5 (see the module docstring); ``image_size`` 28 (padded to 32 by the first convolution) or 32."""

    def __init__(self, in_channels: int = 1, num_classes: int = 10, image_size: int = 28) -> None:
        super().__init__()
        pad = 2 if image_size == 28 else 0
        side = _pooled_side(_pooled_side(image_size, 5, pad), 5, 0)
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, 6, 5, padding=pad), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(6, 16, 5), nn.ReLU(), nn.MaxPool2d(2),
        )
        self.classifier = nn.Sequential(
            nn.Linear(16 * side * side, 120), nn.ReLU(), nn.Linear(120, 84), nn.ReLU(), nn.Linear(84, num_classes),
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.classifier(self.features(x).flatten(1))


def _norm(kind: str, channels: int) -> nn.Module:
    return nn.GroupNorm(2, channels) if kind == "group" else nn.BatchNorm2d(channels)


class BasicBlock(nn.Module):
    """ResNet's basic block ``ReLU(F(x) + shortcut(x))``, ``F`` = conv 3×3 → norm → ReLU → conv 3×3 → norm."""

    def __init__(self, inplanes: int, planes: int, stride: int, norm: str) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 3, stride, 1, bias=False)
        self.bn1 = _norm(norm, planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = _norm(norm, planes)
        self.downsample: nn.Module | None = None
        if stride != 1 or inplanes != planes:
            self.downsample = nn.Sequential(nn.Conv2d(inplanes, planes, 1, stride, bias=False), _norm(norm, planes))

    def forward(self, x: Tensor) -> Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        shortcut = x if self.downsample is None else self.downsample(x)
        return torch.relu(out + shortcut)


class ResNet18(nn.Module):
    """ResNet-18 (see the module docstring): 11.2 M parameters; torchvision's names for every layer."""

    def __init__(
        self, num_classes: int = 10, in_channels: int = 3, norm: Literal["group", "batch"] = "group",
        stem: Literal["imagenet", "cifar"] = "imagenet",
    ) -> None:
        super().__init__()
        if norm not in ("group", "batch"):
            raise ValueError(f"norm must be 'group' or 'batch', got {norm!r}")
        if stem not in ("imagenet", "cifar"):
            raise ValueError(f"stem must be 'imagenet' or 'cifar', got {stem!r}")
        if stem == "imagenet":
            self.conv1 = nn.Conv2d(in_channels, 64, 7, 2, 3, bias=False)
            self.maxpool: nn.Module = nn.MaxPool2d(3, 2, 1)
        else:
            self.conv1 = nn.Conv2d(in_channels, 64, 3, 1, 1, bias=False)
            self.maxpool = nn.Identity()
        self.bn1 = _norm(norm, 64)
        widths, inplanes = (64, 128, 256, 512), 64
        for i, planes in enumerate(widths, start=1):
            stride = 1 if i == 1 else 2
            layer = nn.Sequential(BasicBlock(inplanes, planes, stride, norm), BasicBlock(planes, planes, 1, norm))
            self.add_module(f"layer{i}", layer)
            inplanes = planes
        self.fc = nn.Linear(512, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        h = self.maxpool(torch.relu(self.bn1(self.conv1(x))))
        h = self.layer4(self.layer3(self.layer2(self.layer1(h))))
        return self.fc(h.mean(dim=(-2, -1)))
