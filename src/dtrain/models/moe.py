"""A mixture-of-experts MLP for the bundled GPT (`--experts E --top-k K`).

A router scores each token against every expert; the token goes to its `top_k` best
(softmax over all experts, the chosen scores renormalised to sum to one, as Mixtral
does) and the outputs of those experts are summed with those weights. No token is
dropped (no capacity limit) and there is no auxiliary load-balancing loss: the demo's
routers learn from the language-modelling loss alone.

The experts are stored as Hugging Face MoE models store them, stacked: every parameter
of :class:`Experts` has the expert as its first dimension, and its forward takes the
tokens with their chosen experts and weights. That is the layout expert parallelism
(`dtrain.parallel.expert_parallel`) splits over ranks.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class Experts(nn.Module):
    """`num_experts` GELU MLPs (dim -> hidden -> dim), stacked on their first dimension."""

    def __init__(self, num_experts: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.up = nn.Parameter(torch.empty(num_experts, hidden, dim))
        self.down = nn.Parameter(torch.empty(num_experts, dim, hidden))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Each expert's matrices drawn as an nn.Linear of the same shape draws its weight."""
        for weight in (self.up, self.down):
            bound = 1 / math.sqrt(weight.shape[-1])
            nn.init.uniform_(weight, -bound, bound)

    def forward(
        self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        """(T, dim) tokens, their (T, K) chosen experts and weights -> (T, dim): each
        token's weighted sum of its experts' outputs."""
        out = torch.zeros_like(hidden)
        for e in range(self.num_experts):
            token, slot = torch.where(top_k_index == e)
            y = F.gelu(hidden[token] @ self.up[e].T) @ self.down[e].T
            y = y * top_k_weights[token, slot, None].to(y.dtype)
            out.index_add_(0, token, y.to(out.dtype))  # bf16 under autocast
        return out


class MoE(nn.Module):
    """Router and experts: (N, T, dim) -> (N, T, dim), each token through its top-k."""

    def __init__(self, dim: int, num_experts: int, top_k: int) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(
                f"--top-k {top_k} routes each token to that many of the {num_experts} "
                "experts; pick a top-k between 1 and --experts"
            )
        self.top_k = top_k
        self.router = nn.Linear(dim, num_experts, bias=False)
        self.experts = Experts(num_experts, dim, 4 * dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(N, T, dim) -> (N, T, dim)."""
        flat = x.reshape(-1, x.shape[-1])
        probs = F.softmax(self.router(flat).float(), dim=-1)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return self.experts(flat, chosen, weights.to(x.dtype)).view_as(x)
