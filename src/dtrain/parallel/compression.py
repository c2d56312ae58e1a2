"""Gradient compression for DDP's all-reduce (`--grad-compression`).

fp16 and bf16 do what torch's `fp16_compress_hook` does: each bucket is divided by the
world size, cast, all-reduced in that format (half the bytes of fp32) and cast back
(torch's `bf16_compress_hook` refuses every backend but NCCL and XCCL; this one runs on
gloo too, and divides before the cast, so fp16 overflows less).
``powersgd[:RANK]`` is torch's `powerSGD_hook` (Vogels et al., NeurIPS 2019): each
gradient matrix M is sent as two rank-RANK factors P = MQ and Q = M^T P, with error
feedback (what the factors missed is added to the next step's gradient, per rank) and
warm start (each step's Q starts from the last one's). Under hsdp the fp16/bf16 cast is
FSDP2's reduce dtype instead (`dtrain.parallel.data_parallel.ShardOptions`), and with
--hierarchical the cast is applied to what crosses machines (`dtrain.parallel.hierarchical`).

torch keeps PowerSGD's state by DDP bucket index; :class:`PowerSGD` also files it by
parameter, so that a checkpoint restores it into whatever buckets the resumed DDP forms
(DDP buckets parameters in one order at first, then rebuilds them in gradient-ready order
after its first step).
"""

# No `from __future__ import annotations`: DDP checks the hook's annotations as objects.
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import (
    PowerSGDState,
    powerSGD_hook,
)
from torch.nn.parallel import DistributedDataParallel

from dtrain.checkpoint.canonical import canonical_name
from dtrain.config import grad_compression
from dtrain.errors import ConfigError

CAST_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
"""The dtype each casting --grad-compression all-reduces in."""

START_POWERSGD_ITER = 2
"""PowerSGD compresses from the third step on; the first two are all-reduced whole. DDP
rebuilds its buckets after its first step, and torch refuses error feedback or warm start
from an earlier step (a bucket's remembered error would no longer fit it). torch's own
default is 1000 (a tenth of training, its docs suggest); dtrain cannot know the run's
length, so it compresses as early as torch allows."""

MIN_COMPRESSION_RATE = 2.0
"""torch's default: a matrix is sent as factors only where they are under half its size;
vectors (biases, norms) and matrices too small to gain are all-reduced whole."""

POWERSGD_ATTRIBUTE = "_dtrain_powersgd"
"""Where `register_compression` leaves the PowerSGD state on the DDP wrapper, the object
every strategy built on DDP keeps (the checkpoints find it there)."""


def cast_dtype(setting: str) -> torch.dtype | None:
    """The dtype a --grad-compression value casts gradients to; None for none/powersgd."""
    kind, _ = grad_compression(setting)
    return CAST_DTYPES.get(kind)


def register_compression(
    wrapped: DistributedDataParallel, group: dist.ProcessGroup, setting: str
) -> None:
    """Register the DDP communication hook of --grad-compression `setting` on `wrapped`
    (nothing for none)."""
    kind, rank = grad_compression(setting)
    if kind in CAST_DTYPES:
        wrapped.register_comm_hook(Cast(group, CAST_DTYPES[kind]), cast_hook)
    elif kind == "powersgd":
        named = wrapped.module.named_parameters()
        scalars = [name for name, p in named if p.requires_grad and not p.dim()]
        if scalars:
            raise ConfigError(
                f"--grad-compression powersgd cuts each gradient into a matrix by its first "
                f"dimension, and {', '.join(canonical_name(n) for n in scalars)} "
                f"{'is a 0-d parameter' if len(scalars) == 1 else 'are 0-d parameters'}; give "
                "each the shape (1,) (e.g. nn.Parameter(torch.ones(1))), or use "
                "--grad-compression bf16."
            )
        state = PowerSGD(group, rank, wrapped.module)
        wrapped.register_comm_hook(state, powersgd_hook)
        setattr(wrapped, POWERSGD_ATTRIBUTE, state)


@dataclass(frozen=True)
class Cast:
    """The state of `cast_hook`: the group to all-reduce over, and in which dtype."""

    group: dist.ProcessGroup
    dtype: torch.dtype


def cast_hook(state: Cast, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: the bucket averaged over `state.group` in `state.dtype`.
    Each rank's share of the average is taken before the cast (in place: the bucket is
    overwritten with the result anyway), so fp16 overflows only where the shares do."""
    buffer = bucket.buffer().div_(state.group.size())
    compressed = buffer.to(state.dtype)
    work = dist.all_reduce(compressed, group=state.group, async_op=True)
    assert work is not None
    return work.get_future().then(lambda _: buffer.copy_(compressed))


def powersgd_of(model: nn.Module | None) -> "PowerSGD | None":
    """The PowerSGD state of a DDP wrapper under --grad-compression powersgd, else None."""
    return getattr(model, POWERSGD_ATTRIBUTE, None)


class PowerSGD:
    """torch's :class:`PowerSGDState` for one rank, and its state filed by parameter name
    between a checkpoint (or a rebuild of DDP's buckets) and the buckets it goes back into."""

    def __init__(self, group: dist.ProcessGroup, rank: int, model: nn.Module) -> None:
        self.torch_state = PowerSGDState(
            group,
            matrix_approximation_rank=rank,
            start_powerSGD_iter=START_POWERSGD_ITER,
            min_compression_rate=MIN_COMPRESSION_RATE,
            use_error_feedback=True,
            warm_start=True,
        )
        self.rank = rank
        self.world = group.size()
        self._names = {id(p): canonical_name(name) for name, p in model.named_parameters()}
        self._layouts: dict[int, tuple[tuple[str, torch.Size], ...]] = {}
        """Each bucket's parameters (name, shape), in bucket order, as torch's state has them."""
        self._errors: dict[str, torch.Tensor] = {}
        """Error feedback by parameter (flat), not yet back in a bucket."""
        self._qs: dict[str, torch.Tensor] = {}
        """Warm-start Q by compressed parameter (flat), not yet back in a bucket."""
        self._seen: dict[int, int] = {}
        """The step (torch's `iter`) in which each bucket's hook last ran."""
        self.pending: torch.futures.Future[torch.Tensor] | None = None
        """The future of the last bucket `powersgd_hook` started."""

    # -- the hook's side --------------------------------------------------------------------
    def prepare(self, bucket: dist.GradBucket) -> None:
        """Before torch's hook compresses `bucket`: put back the state filed by parameter
        for it; where DDP rebuilt its buckets, file every bucket's state by parameter first."""
        step = self.torch_state.iter
        if step < self.torch_state.start_powerSGD_iter:
            return  # whole all-reduce: torch keeps no state yet
        index = bucket.index()
        layout = tuple((self._names[id(p)], p.shape) for p in bucket.parameters())
        known = self._layouts.get(index)
        if known != layout:
            if known is not None:
                # Buckets already compressed in this step kept their layout, and their
                # new error is still being computed: they stay as torch has them.
                self._file_by_parameter({i for i, seen in self._seen.items() if seen == step})
            self._layouts[index] = layout
            self._restore(index, layout, bucket.buffer())
        self._seen[index] = step

    def _file_by_parameter(self, keep: set[int]) -> None:
        """Move torch's per-bucket state of every bucket but those in `keep` into the
        per-parameter record (and out of torch's)."""
        moved = [index for index in self._layouts if index not in keep]
        for name, (error, q) in self._by_parameter(moved).items():
            if error is not None:
                self._errors[name] = error
            if q is not None:
                self._qs[name] = q
        state = self.torch_state
        for index in moved:
            for record in (state.error_dict, state.p_memory_dict, state.q_memory_dict):
                record.pop(index, None)
            del self._layouts[index]

    def _by_parameter(
        self, indices: list[int] | None = None
    ) -> dict[str, tuple[torch.Tensor | None, torch.Tensor | None]]:
        """(error, Q) of each parameter in torch's per-bucket state (of the buckets
        `indices`, default all), as flat views."""
        state = self.torch_state
        out: dict[str, tuple[torch.Tensor | None, torch.Tensor | None]] = {}
        for index in self._layouts if indices is None else indices:
            layout = self._layouts[index]
            errors = state.error_dict.get(index)
            qs = state.q_memory_dict.get(index)
            pieces = _split(errors, [shape.numel() for _, shape in layout])
            q_pieces = _split(qs, [length for _, length in self._q_order(layout)])
            q_of = {i: q for (i, _), q in zip(self._q_order(layout), q_pieces, strict=False)}
            for i, (name, _) in enumerate(layout):
                out[name] = (pieces[i] if pieces else None, q_of.get(i))
        return out

    def _restore(
        self, index: int, layout: tuple[tuple[str, torch.Size], ...], buffer: torch.Tensor
    ) -> None:
        """Bucket `index`'s error and warm-start Q from the per-parameter record: a
        parameter without a recorded error starts from zero; the bucket's Qs come back only
        all together (else torch draws them afresh)."""
        state = self.torch_state
        names = [name for name, _ in layout]
        if any(name in self._errors for name in names):
            state.error_dict[index] = torch.cat(
                [
                    self._errors.pop(name, torch.zeros(shape.numel())).to(buffer)
                    for name, shape in layout
                ]
            )
        order = self._q_order(layout)
        if order and all(names[i] in self._qs for i, _ in order):
            qs = [self._qs.pop(names[i]).to(buffer) for i, _ in order]
            state.q_memory_dict[index] = torch.cat(qs)
            # torch draws new Qs where a bucket has no P buffer; P is recomputed each step.
            rows = sum(layout[i][1][0] * self._rank_of(layout[i][1]) for i, _ in order)
            state.p_memory_dict[index] = buffer.new_empty(rows)

    def _q_order(self, layout: tuple[tuple[str, torch.Size], ...]) -> list[tuple[int, int]]:
        """(position in the bucket, length of its Q) of each matrix torch compresses, in
        the order of torch's Q buffer: grouped by matrix shape, shapes in order of first
        appearance (`powerSGD_hook` with batch_tensors_with_same_shape=False)."""
        by_shape: dict[tuple[int, int], list[tuple[int, int]]] = {}
        for i, (_, shape) in enumerate(layout):
            n = shape[0]
            m = shape.numel() // n
            r = self._rank_of(shape)
            if (n + m) * r * MIN_COMPRESSION_RATE < n * m:
                by_shape.setdefault((n, m), []).append((i, m * r))
        return [entry for entries in by_shape.values() for entry in entries]

    def _rank_of(self, shape: torch.Size) -> int:
        """The rank of the factors of a gradient of `shape` (its matrix: rows x the rest)."""
        return min(shape[0], shape.numel() // shape[0], self.rank)

    # -- checkpoints ------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """This rank's state, on the CPU, by parameter name (tensors and plain values, as
        checkpoints' ``weights_only`` loading wants)."""
        state = self.torch_state
        errors = dict(self._errors)
        qs = dict(self._qs)
        for name, (error, q) in self._by_parameter().items():
            if error is not None:
                errors[name] = error
            if q is not None:
                qs[name] = q
        _, keys, position, has_gauss, gauss = state.rng.get_state()
        return {
            "world_size": self.world,
            "matrix_rank": self.rank,
            "iter": state.iter,
            "rng": {
                "keys": torch.from_numpy(keys.astype(np.int64)),
                "position": int(position),
                "has_gauss": int(has_gauss),
                "gauss": float(gauss),
            },
            "errors": {name: t.detach().to("cpu", copy=True) for name, t in errors.items()},
            "q": {name: t.detach().to("cpu", copy=True) for name, t in qs.items()},
        }

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        """Continue from `saved` (this rank's `state_dict` from a job of the same world
        size and rank): torch's buckets take it back at their next compressed step."""
        state = self.torch_state
        state.iter = int(saved["iter"])
        rng = saved["rng"]
        keys = rng["keys"].numpy().astype(np.uint32)
        state.rng.set_state(("MT19937", keys, rng["position"], rng["has_gauss"], rng["gauss"]))
        state.error_dict.clear()
        state.p_memory_dict.clear()
        state.q_memory_dict.clear()
        self._layouts.clear()
        self._seen.clear()
        self._errors = dict(saved["errors"])
        self._qs = dict(saved["q"])

    def fits(self, saved: dict[str, Any] | None) -> bool:
        """True if `saved` was written by a rank of a job like this one (same world size,
        same PowerSGD rank), so its error feedback means the same here."""
        return (
            saved is not None
            and saved.get("world_size") == self.world
            and saved.get("matrix_rank") == self.rank
        )


def powersgd_hook(state: PowerSGD, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: torch's `powerSGD_hook`, with the state filed by parameter
    put back into `bucket` first (`PowerSGD.prepare`), issued once the bucket before it is
    done.

    torch's hook issues a bucket's P and Q all-reduces from its futures' callbacks, which
    gloo runs on its own threads when the work before them ends: a rank could issue the
    next bucket's first all-reduce before this one's Q, another rank after it, and the
    group would mismatch (gloo: "Received data size doesn't match expected size") on any
    model of more than one bucket. Waiting here for the previous bucket's whole chain keeps
    every rank issuing them in bucket order, as DDP calls the hook. (NCCL's futures run
    their callbacks as the work is queued, so there the wait costs nothing.)"""
    state.prepare(bucket)
    if state.pending is not None:
        state.pending.wait()
    state.pending = powerSGD_hook(state.torch_state, bucket)
    return state.pending


def _split(flat: torch.Tensor | None, lengths: list[int]) -> list[torch.Tensor]:
    """`flat` cut into consecutive pieces of `lengths` (empty for None)."""
    if flat is None:
        return []
    return list(torch.split(flat, lengths)) if lengths else []
