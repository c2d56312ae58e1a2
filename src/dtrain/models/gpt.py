"""A decoder-only transformer language model (GPT-2 style, Radford et al. 2019).

Pre-norm blocks of causal multi-head self-attention and a GELU MLP, learned positional
embeddings, an untied output head; no dropout, so runs are comparable across strategies.
With `experts`, each block's MLP is a mixture of experts (`dtrain.models.moe`).
Its repeated `blocks` are what sharding, pipeline and tensor parallelism split. Attention
reshapes by head size, not head count, so it also runs on a column-sharded slice of the
heads (tensor parallelism).

Input: token ids (N, T) with T <= context; output: logits (N, T, vocab).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dtrain.models.moe import MoE


@dataclass(frozen=True)
class GPTConfig:
    """Sizes of a GPT."""

    vocab_size: int = 256
    context: int = 64
    dim: int = 64
    layers: int = 2
    heads: int = 4
    experts: int = 0
    """Experts per MLP (a mixture of experts, `dtrain.models.moe`); 0: a dense MLP."""
    top_k: int = 2
    """Experts each token is routed to, with `experts`."""

    @property
    def head_dim(self) -> int:
        """Channels per attention head."""
        return self.dim // self.heads


SIZES: dict[str, GPTConfig] = {
    "tiny": GPTConfig(dim=64, layers=2, heads=4),
    "small": GPTConfig(dim=128, layers=4, heads=4),
    "medium": GPTConfig(dim=384, layers=6, heads=6, context=128),
    "100m": GPTConfig(dim=768, layers=12, heads=12, context=256),
}


class Attention(nn.Module):
    """Causal multi-head self-attention with separate q, k, v projections."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        if config.dim % config.heads:
            raise ValueError(f"dim {config.dim} is not divisible by {config.heads} heads")
        self.head_dim = config.head_dim
        self.q = nn.Linear(config.dim, config.dim)
        # No key bias: it adds the same q.b to every score of a query, which softmax
        # ignores, so its gradient is zero up to rounding (noise that Adam would amplify).
        self.k = nn.Linear(config.dim, config.dim, bias=False)
        self.v = nn.Linear(config.dim, config.dim)
        self.out = nn.Linear(config.dim, config.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(N, T, dim) -> (N, T, dim)."""
        n, t, _ = x.shape

        def heads(proj: nn.Linear) -> torch.Tensor:
            return proj(x).view(n, t, -1, self.head_dim).transpose(1, 2)

        y = F.scaled_dot_product_attention(
            heads(self.q), heads(self.k), heads(self.v), is_causal=True
        )
        return self.out(y.transpose(1, 2).reshape(n, t, -1))


class MLP(nn.Module):
    """dim -> 4 dim -> dim with GELU."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.up = nn.Linear(config.dim, 4 * config.dim)
        self.down = nn.Linear(4 * config.dim, config.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(N, T, dim) -> (N, T, dim)."""
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    """x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(config.dim)
        self.attn = Attention(config)
        self.ln2 = nn.LayerNorm(config.dim)
        self.mlp: nn.Module = (
            MoE(config.dim, config.experts, config.top_k) if config.experts else MLP(config)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(N, T, dim) -> (N, T, dim)."""
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Embeddings(nn.Module):
    """Token ids (N, T) -> token + learned position embeddings (N, T, dim)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.tok = nn.Embedding(config.vocab_size, config.dim)
        self.pos = nn.Embedding(config.context, config.dim)

    def forward(
        self, tokens: torch.Tensor, position_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """(N, T) token ids -> (N, T, dim); `position_ids` (N, T): each token's position
        (default 0 .. T-1; context parallelism gives each rank's)."""
        if position_ids is None:
            position_ids = torch.arange(tokens.shape[1], device=tokens.device)
        return self.tok(tokens) + self.pos(position_ids)


class OutputHead(nn.Module):
    """Final LayerNorm and the projection to vocabulary logits."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(config.dim)
        self.proj = nn.Linear(config.dim, config.vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(N, T, dim) -> (N, T, vocab)."""
        return self.proj(self.ln(x))


class GPT(nn.Module):
    """Embeddings, `layers` blocks, output head: a composition of its `pipeline_layers`."""

    def __init__(self, config: GPTConfig | None = None) -> None:
        super().__init__()
        self.config = config or GPTConfig()
        c = self.config
        self.embed = Embeddings(c)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.layers))
        self.head = OutputHead(c)

    def forward(
        self, tokens: torch.Tensor, position_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """(N, T) token ids -> (N, T, vocab) logits; `position_ids` (N, T) as `Embeddings`
        takes them."""
        x = self.embed(tokens, position_ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    def pipeline_layers(self) -> list[tuple[str, nn.Module]]:
        """The forward as a chain of (name, module): what pipeline parallelism splits."""
        blocks = [(f"blocks.{i}", block) for i, block in enumerate(self.blocks)]
        return [("embed", self.embed), *blocks, ("head", self.head)]

    def tensor_parallel_plan(self, degree: int) -> dict[str, str]:
        """Megatron-style sharding of every block over `degree` ranks (Shoeybi et al. 2019).

        q, k, v and the MLP's up projection are split by output columns (whole heads per
        rank), the attention output and MLP down projection by input rows, so each block
        needs one all-reduce forward and one backward per sub-layer.
        """
        c = self.config
        if c.experts:
            raise ValueError(
                "tensor parallelism splits the dense MLP's matrices; with --experts, place "
                "the experts over ranks with --ep instead"
            )
        if c.heads % degree or (4 * c.dim) % degree:
            raise ValueError(
                f"tensor parallelism over {degree} ranks splits the {c.heads} attention heads "
                f"and the {4 * c.dim} MLP channels evenly; pick a degree that divides both"
            )
        plan = {"attn.q": "colwise", "attn.k": "colwise", "attn.v": "colwise"}
        plan |= {"attn.out": "rowwise", "mlp.up": "colwise", "mlp.down": "rowwise"}
        return {f"blocks.*.{path}": style for path, style in plan.items()}

    def expert_parallel_plan(self) -> list[str]:
        """The experts modules expert parallelism (--ep) splits: every block's, with
        --experts; none for a dense GPT."""
        if not self.config.experts:
            return []
        return [f"blocks.{i}.mlp.experts" for i in range(len(self.blocks))]


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy: logits (N, T, V), targets (N, T)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
