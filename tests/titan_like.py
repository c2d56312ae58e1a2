"""A small decoder laid out as torchtitan lays out its Llama, written here for the tests.

What it shares with torchtitan's pattern (and what makes it hard to split): the blocks live
in an ``nn.ModuleDict`` named ``layers`` (keys "0", "1", ...), each block is called with
an extra argument, the rotary table, and that table is a complex64 buffer the model holds
at its root (``freqs_cis``), computed again in ``init_weights``. Its ``pipeline_layers()``
hands each block the table through a small wrapper that registers the model's buffer as
its own, so every stage running a block holds the table under the model's name.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class TitanConfig:
    """The sizes of the decoder."""

    vocab: int = 64
    dim: int = 32
    heads: int = 4
    blocks: int = 3
    context: int = 16
    theta: float = 10000.0


def rotary_table(head_dim: int, length: int, theta: float) -> torch.Tensor:
    """(length, head_dim / 2) complex64: e^(i t w_k) for position t and w_k = theta^(-2k/d)
    (RoFormer, Su et al. 2021)."""
    frequencies = theta ** -(torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(length, dtype=torch.float32), frequencies)
    return torch.polar(torch.ones_like(angles), angles)


def rotate(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """`x` (N, T, H, D) with each pair of features turned by its position's angle."""
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    turned = pairs * table[: x.shape[1]].view(1, x.shape[1], 1, -1)
    return torch.view_as_real(turned).flatten(3).type_as(x)


class Attention(nn.Module):
    """Causal self-attention with rotary positions on queries and keys."""

    def __init__(self, c: TitanConfig) -> None:
        super().__init__()
        self.heads = c.heads
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(c.dim, c.dim, bias=False) for _ in "qkvo")

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        n, t, _ = x.shape
        q, k, v = (w(x).view(n, t, self.heads, -1) for w in (self.wq, self.wk, self.wv))
        q, k = rotate(q, freqs_cis), rotate(k, freqs_cis)
        heads = [h.transpose(1, 2) for h in (q, k, v)]
        out = F.scaled_dot_product_attention(*heads, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(n, t, -1))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, c: TitanConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(c.dim, 2 * c.dim, bias=False)
        self.w2 = nn.Linear(2 * c.dim, c.dim, bias=False)
        self.w3 = nn.Linear(c.dim, 2 * c.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    """Pre-norm attention and feed-forward, each with its residual."""

    def __init__(self, c: TitanConfig) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(c.dim)
        self.attention = Attention(c)
        self.ffn_norm = nn.RMSNorm(c.dim)
        self.feed_forward = FeedForward(c)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), freqs_cis)
        return h + self.feed_forward(self.ffn_norm(h))


class WithTable(nn.Module):
    """A block as a pipeline layer: called on the hidden states alone, it passes the
    model's rotary table, registered here so that the stage holds and moves it."""

    def __init__(self, block: Block, freqs_cis: torch.Tensor) -> None:
        super().__init__()
        self.block = block
        self.register_buffer("freqs_cis", freqs_cis, persistent=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.block(h, self.freqs_cis)


class TitanLike(nn.Module):
    """Token embeddings, ``layers`` "0".."n-1", final norm, output projection; (N, T)
    token ids -> (N, T, vocab) logits."""

    def __init__(self, c: TitanConfig | None = None) -> None:
        super().__init__()
        self.c = c = c or TitanConfig()
        self.tok_embeddings = nn.Embedding(c.vocab, c.dim)
        self.layers = nn.ModuleDict({str(i): Block(c) for i in range(c.blocks)})
        self.norm = nn.RMSNorm(c.dim)
        self.output = nn.Linear(c.dim, c.vocab, bias=False)
        self.register_buffer("freqs_cis", self._table(), persistent=True)

    def _table(self) -> torch.Tensor:
        return rotary_table(self.c.dim // self.c.heads, self.c.context, self.c.theta)

    def init_weights(self) -> None:
        """The table again (a model built on the meta device has none yet), and small
        normal weights."""
        self.freqs_cis = self._table()
        for name, param in self.named_parameters():
            if name.endswith("norm.weight"):
                nn.init.ones_(param)
            else:
                nn.init.normal_(param, std=0.05)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for block in self.layers.values():
            h = block(h, self.freqs_cis)
        return self.output(self.norm(h))

    def pipeline_layers(self) -> list[tuple[str, nn.Module]]:
        """The forward as a chain of (name, module)."""
        blocks = [(f"layers.{k}", WithTable(b, self.freqs_cis)) for k, b in self.layers.items()]
        return [
            ("tok_embeddings", self.tok_embeddings),
            *blocks,
            ("norm", self.norm),
            ("output", self.output),
        ]
