"""A BERT sequence classifier built from a config by ``transformers`` (random weights, nothing
downloaded), and the ``[CLS]`` token in front of its inputs. ``transformers`` is imported only
when a model is built: ``pip install "./examples[transformers]"``."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["bert_classifier", "passages", "with_cls"]


def bert_classifier(
    vocab: int,
    num_labels: int,
    *,
    length: int,
    n_layer: int = 4,
    n_head: int = 4,
    n_embd: int = 128,
    dropout: float = 0.1,
) -> Any:
    """``transformers.BertForSequenceClassification`` over ``vocab`` tokens plus ``[CLS]``
    (token id ``vocab``), for inputs of up to ``length`` tokens after the ``[CLS]``.

    Args:
        vocab: tokens of the vocabulary (the ``[CLS]`` token is added after them).
        num_labels: classes.
        length: the longest input, without the ``[CLS]`` token.
        n_layer, n_head, n_embd: encoder layers, attention heads, hidden width (the feed-forward
            width is ``4 * n_embd``).
        dropout: hidden and attention dropout.

    Example:
        >>> model = bert_classifier(10, 3, length=6, n_layer=1, n_head=2, n_embd=16)
        >>> model(input_ids=with_cls(torch.randint(0, 10, (2, 6)), 10)).logits.shape
        torch.Size([2, 3])
    """
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(
        vocab_size=vocab + 1,
        hidden_size=n_embd,
        num_hidden_layers=n_layer,
        num_attention_heads=n_head,
        intermediate_size=4 * n_embd,
        max_position_embeddings=length + 1,
        hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout,
        num_labels=num_labels,
    )
    return BertForSequenceClassification(config)


def with_cls(tokens: torch.Tensor, cls: int) -> torch.Tensor:
    """``tokens`` (B x T ids) with the ``[CLS]`` token ``cls`` in front of every row."""
    return torch.cat([tokens.new_full((len(tokens), 1), cls), tokens], dim=1)


def passages(ids: torch.Tensor, starts: torch.Tensor, length: int, cls: int) -> torch.Tensor:
    """The ``length``-token passages of ``ids`` beginning at ``starts``, ``[CLS]`` in front.

    Example:
        >>> passages(torch.arange(10), torch.tensor([0, 5]), 3, 99).tolist()
        [[99, 0, 1, 2], [99, 5, 6, 7]]
    """
    return with_cls(ids[starts.unsqueeze(1) + torch.arange(length)], cls)
