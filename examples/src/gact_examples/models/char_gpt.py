"""A character-level GPT: token + position embeddings, pre-LayerNorm blocks with causal softmax
attention (explicit softmax and attention dropout) and a GELU MLP."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["Block", "CausalSelfAttention", "CharGPT"]


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with an explicit softmax (its output is saved for
    backward, so GACT sees and compresses it) and attention dropout.

    Args:
        n_embd: embedding width, divisible by ``n_head``.
        n_head: attention heads.
        block_size: the longest sequence (size of the causal mask).
        dropout: dropout on the attention weights and on the output.
    """

    def __init__(self, n_embd: int, n_head: int, block_size: int, dropout: float) -> None:
        super().__init__()
        if n_embd % n_head:
            raise ValueError(
                f"n_embd={n_embd} is not divisible by n_head={n_head}; pick n_embd a multiple "
                "of n_head"
            )
        self.n_head = n_head
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)
        self.attn_drop = nn.Dropout(dropout)
        self.resid_drop = nn.Dropout(dropout)
        mask = torch.tril(torch.ones(block_size, block_size, dtype=torch.bool))
        self.register_buffer("mask", mask.view(1, 1, block_size, block_size), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.shape[-1]))
        att = att.masked_fill(~self.mask[:, :, :t, :t], float("-inf"))
        att = self.attn_drop(F.softmax(att, dim=-1))
        y = (att @ v).transpose(1, 2).contiguous().view(b, t, c)
        return self.resid_drop(self.proj(y))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: attention then a GELU MLP, each with a residual."""

    def __init__(self, n_embd: int, n_head: int, block_size: int, dropout: float) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, block_size, dropout)
        self.ln2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(n_embd, 4 * n_embd),
            nn.GELU(),
            nn.Linear(4 * n_embd, n_embd),
            nn.Dropout(dropout),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class CharGPT(nn.Module):
    """A GPT over characters: returns logits, or ``(logits, loss)`` when targets are given.

    Args:
        vocab_size: number of distinct characters.
        block_size: the longest sequence.
        n_layer: transformer blocks.
        n_head: attention heads per block.
        n_embd: embedding width.
        dropout: dropout probability everywhere.

    Example:
        >>> model = CharGPT(vocab_size=11, block_size=16, n_layer=1, n_head=2, n_embd=32)
        >>> idx = torch.randint(0, 11, (2, 16))
        >>> logits, loss = model(idx, idx)
        >>> logits.shape, loss.ndim
        (torch.Size([2, 16, 11]), 0)
    """

    def __init__(
        self,
        vocab_size: int,
        block_size: int = 64,
        n_layer: int = 2,
        n_head: int = 4,
        n_embd: int = 128,
        dropout: float = 0.1,
    ) -> None:
        super().__init__()
        self.block_size = block_size
        self.tok_emb = nn.Embedding(vocab_size, n_embd)
        self.pos_emb = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.Sequential(
            *(Block(n_embd, n_head, block_size, dropout) for _ in range(n_layer))
        )
        self.ln_f = nn.LayerNorm(n_embd)
        self.head = nn.Linear(n_embd, vocab_size, bias=False)
        self.apply(self._init)

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, 0.0, 0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        t = idx.shape[1]
        if t > self.block_size:
            raise ValueError(
                f"sequence length {t} exceeds block size {self.block_size}; pass at most "
                f"{self.block_size} tokens or build the model with a larger block_size"
            )
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        logits = self.head(self.ln_f(self.blocks(x)))
        if targets is None:
            return logits
        loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))
        return logits, loss
