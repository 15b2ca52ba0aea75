"""The example models, in plain PyTorch, and a BERT classifier from ``transformers``: nothing in
them knows about GACT.

Example:
    >>> import torch
    >>> ResNetSmall(in_channels=1, num_classes=10, width=8)(torch.randn(2, 1, 16, 16)).shape
    torch.Size([2, 10])
"""

from __future__ import annotations

from .bert import bert_classifier, passages, with_cls
from .char_gpt import CharGPT
from .gnn import GNN, Graph
from .resnet import ResNet18, ResNetSmall

__all__ = [
    "GNN",
    "CharGPT",
    "Graph",
    "ResNet18",
    "ResNetSmall",
    "bert_classifier",
    "passages",
    "with_cls",
]
