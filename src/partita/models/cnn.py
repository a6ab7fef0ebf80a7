"""A small image classifier written as ordinary single-device PyTorch.

conv 3x3 -> batch norm -> ReLU -> max pool 2 -> conv 3x3 -> batch norm -> ReLU -> avg pool 2 ->
flatten -> linear. NCHW input. No partita code.
"""

from __future__ import annotations

import torch
from torch import nn

from partita.errors import ArgumentError

__all__ = ["SmallCNN"]


class SmallCNN(nn.Module):
    """``forward(x: [batch, in_channels, size, size]) -> logits [batch, num_classes]``.

    ``size`` must be divisible by 4 (two 2x2 pools).

    Example:
        >>> SmallCNN(in_channels=3, num_classes=10, size=8)(torch.randn(2, 3, 8, 8)).shape
        torch.Size([2, 10])
    """

    def __init__(
        self, in_channels: int = 3, num_classes: int = 10, size: int = 16, width: int = 8
    ) -> None:
        super().__init__()
        if size % 4:
            raise ArgumentError(f"SmallCNN size={size} must be divisible by 4 (two 2x2 pools).")
        self.conv1 = nn.Conv2d(in_channels, width, 3, padding=1, bias=False)  # BN follows
        self.bn1 = nn.BatchNorm2d(width)
        self.pool1 = nn.MaxPool2d(2)
        self.conv2 = nn.Conv2d(width, 2 * width, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(2 * width)
        self.pool2 = nn.AvgPool2d(2)
        self.fc = nn.Linear(2 * width * (size // 4) ** 2, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool1(torch.relu(self.bn1(self.conv1(x))))
        x = self.pool2(torch.relu(self.bn2(self.conv2(x))))
        return self.fc(torch.flatten(x, 1))
