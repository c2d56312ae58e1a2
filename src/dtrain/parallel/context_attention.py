"""Attention over the whole sequence for context parallelism: each rank's queries, the
sequence's keys and values.

While a step runs (`WholeSequence.installed`), ``F.scaled_dot_product_attention`` attends
each rank's queries to the whole sequence's keys and values: they are gathered from the
context ranks (an all-gather whose backward reduce-scatters: each rank gets the gradient of
its own keys and values, summed over the ranks that attended to them), and each of the
rank's two chunks of queries (`held_chunks`) attends the keys up to its chunk's end with
the causal mask aligned to the lower right (``torch.nn.attention.bias.causal_lower_right``,
which the fused kernels take without building a mask): the attention one process computes
over the whole sequence, chunk by chunk. For backward each rank keeps only its own queries,
keys and values: backward gathers the keys and values again and recomputes its chunks'
attention (as ring attention keeps only its own). The traffic per layer is torch's ring
attention's under its default all-gather rotation (every rank receives (cp - 1) / cp of
the keys and values); torch's own context parallelism
(``torch.distributed.tensor.experimental``) is a prototype that dispatches only the CUDA
attention kernels, so it cannot run on the CPU ranks the tests use.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right
from torch.utils.checkpoint import checkpoint

from dtrain.errors import ConfigError
from dtrain.parallel.collective_timing import CollectiveTiming, timed

SDPA = F.scaled_dot_product_attention
"""torch's own attention, which the chunks call."""


def held_chunks(cp: int, rank: int) -> tuple[int, int]:
    """The two of the 2 x `cp` chunks of every sequence that context rank `rank` holds, in
    the order it holds them (head-tail load balancing)."""
    return rank, 2 * cp - 1 - rank


class WholeSequence:
    """This rank's attention over the whole sequence (see the module's docstring).

    Args:
        group: the context-parallel ranks of this rank's data-parallel share.
    """

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.cp = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.model_class = "the model"
        """The model's class name, for messages."""
        self.timing: CollectiveTiming | None = None
        """Whom to tell when the gathers start and end (the step's breakdown)."""
        self._owner: int | None = None
        """The thread whose step is attending (another thread's attention is left alone)."""
        self._found: Callable[..., torch.Tensor] = SDPA
        self._attended = 0

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        """Inside this block ``F.scaled_dot_product_attention`` attends over the whole
        sequence (what it was is restored after); a model that attended nothing through
        it is refused by name."""
        self._found = F.scaled_dot_product_attention
        F.scaled_dot_product_attention = self._attend  # type: ignore[assignment]
        self._owner = threading.get_ident()
        try:
            yield
        finally:
            F.scaled_dot_product_attention = self._found
            self._owner = None
        if self._attended == 0:
            raise ConfigError(
                f"--cp {self.cp} cuts each sample's sequence, but {self.model_class}'s forward "
                "never called torch.nn.functional.scaled_dot_product_attention, the attention "
                "dtrain makes attend over the whole sequence: its tokens would see only "
                "their rank's slice. Compute attention with F.scaled_dot_product_attention "
                "(Hugging Face: attn_implementation='sdpa'), or drop --cp."
            )

    def _attend(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
    ) -> torch.Tensor:
        """``F.scaled_dot_product_attention`` of this rank's queries (..., L, E) over the
        whole sequence's keys and values, L the rank's tokens (two chunks); another
        thread's attention (an evaluation running beside the step) is torch's own."""
        if threading.get_ident() != self._owner:
            return self._found(
                query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa=enable_gqa
            )
        if key.shape[-2] != query.shape[-2]:
            raise ConfigError(
                f"{self.model_class} attends queries of {query.shape[-2]} tokens to keys of "
                f"{key.shape[-2]} (cross-attention, or attention over another axis), which "
                "--cp cannot cut as one sequence; drop --cp."
            )
        if attn_mask is not None:
            raise ConfigError(
                f"{self.model_class}'s attention passes an attention mask, which --cp "
                "cannot cut (it is built for the whole sequence, or for a rank's slice of "
                "it); use is_causal=True without a mask, or drop --cp."
            )
        self._attended += 1
        # Backward gathers the keys and values again rather than keeping the whole
        # sequence's: a rank keeps only its own queries, keys and values for backward.
        return checkpoint(
            self._chunks,
            query,
            key,
            value,
            dropout_p,
            is_causal,
            scale,
            enable_gqa,
            use_reentrant=False,
        )

    def _chunks(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        dropout_p: float,
        is_causal: bool,
        scale: float | None,
        enable_gqa: bool,
    ) -> torch.Tensor:
        """Each of this rank's two chunks of queries attending the whole sequence's keys
        and values up to its end (all of them without `is_causal`)."""
        with timed(self.timing):
            keys, values = self._whole(key), self._whole(value)
        if enable_gqa and keys.shape[-3] != query.shape[-3]:
            # Grouped-query attention: each key head serves a run of query heads. Repeated
            # here, as the lower-right causal bias's fused GPU kernels take no groups.
            repeat = query.shape[-3] // keys.shape[-3]
            keys, values = (t.repeat_interleave(repeat, dim=-3) for t in (keys, values))
            enable_gqa = False
        c = query.shape[-2] // 2
        out = []
        # torch's own attention while the chunks attend: the lower-right causal bias
        # dispatches by identity with F.scaled_dot_product_attention.
        F.scaled_dot_product_attention = SDPA
        try:
            for half, j in enumerate(held_chunks(self.cp, self.rank)):
                q = query[..., half * c : (half + 1) * c, :]
                end = (j + 1) * c if is_causal else keys.shape[-2]
                out.append(
                    SDPA(
                        q,
                        keys[..., :end, :],
                        values[..., :end, :],
                        attn_mask=causal_lower_right(c, end) if is_causal else None,
                        dropout_p=dropout_p,
                        scale=scale,
                        enable_gqa=enable_gqa,
                    )
                )
        finally:
            F.scaled_dot_product_attention = self._attend  # type: ignore[assignment]
        return torch.cat(out, dim=-2)

    def _whole(self, part: torch.Tensor) -> torch.Tensor:
        """The whole sequence (..., T, E) from every rank's two chunks (..., 2c, E)."""
        parts = _Gathered.apply(part, self.group, self.timing).unbind(0)
        c = part.shape[-2] // 2
        chunks: list[torch.Tensor | None] = [None] * (2 * self.cp)
        for rank, held in enumerate(parts):
            for half, j in enumerate(held_chunks(self.cp, rank)):
                chunks[j] = held[..., half * c : (half + 1) * c, :]
        return torch.cat(chunks, dim=-2)  # type: ignore[arg-type]


class _Gathered(torch.autograd.Function):
    """Every rank's `part`, stacked in rank order (cp, ...); backward hands each rank the
    sum over the ranks of the gradient of its own part."""

    @staticmethod
    def forward(
        ctx: Any, part: torch.Tensor, group: dist.ProcessGroup, timing: CollectiveTiming | None
    ) -> torch.Tensor:
        ctx.group, ctx.timing = group, timing
        part = part.contiguous()
        cp = dist.get_world_size(group)
        out = part.new_empty((cp * part.shape[0], *part.shape[1:]))
        dist.all_gather_into_tensor(out, part, group=group)
        return out.view(cp, *part.shape)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        mine = grad.new_empty(grad.shape[1:])
        whole = grad.flatten(0, 1).contiguous()
        with timed(ctx.timing):
            dist.reduce_scatter_tensor(mine, whole, group=ctx.group)
        return mine, None, None
