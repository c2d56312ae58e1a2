"""`local-sgd`: replicas that train alone for H optimizer steps, then sync.

Local SGD (Stich, ICLR 2019; Lin et al., ICLR 2020): every process holds a whole replica
and reads its share of each global batch, as under ddp, but backward exchanges nothing;
after every H-th optimizer step (``--sync-every H``) the replicas average their parameters
and floating-point and complex buffers (BatchNorm's running statistics) in one all-reduce
per dtype (torch's ``model_averaging.utils.average_parameters``), so they communicate H
times less often than ddp. Each replica keeps its own optimizer state, as torch's
PeriodicModelAverager and torchft's LocalSGD do. Integer and bool buffers (counters,
masks) are not averaged: every replica keeps its own, as a mean of them means nothing.

A buffer's mean is taken as rank 0's value plus the mean of the replicas' differences from
it, so that a buffer every replica holds alike (a rotary table, Hugging Face's `inv_freq`)
stays bit for bit what it was: a plain mean of three equal float32 values changes about
one in seven of them by a unit in the last place, at every sync.

DiLoCo (Douillard et al. 2023), with ``--outer-optimizer sgd|nesterov``: a sync averages
the replicas' changes since the last sync (the outer gradient: the synced model minus the
replica), and an outer torch SGD steps the synced model with it; every replica then goes
on from the new synced model. The paper's outer optimizer is the default: nesterov,
momentum 0.9, lr 0.7. Outer sgd at lr 1.0 without momentum is plain averaging.

With H = 1 and plain averaging this trains ddp's model under SGD with or without momentum,
nesterov or weight decay: every replica steps from the same parameters with an update
linear in its gradient, so the mean of the replicas' momentum buffers evolves as ddp's
buffer and the mean of their updated parameters is ddp's. Adam's update is not linear in
the gradient: there H = 1 is near ddp, not equal. Clipping (--clip-grad-norm) clips each
replica's own gradient.

Between syncs the replicas differ: `engine.evaluate` then runs each replica on its share
of the data (the mean over the replicas, not the averaged model); at a sync step it
evaluates the synced model. A checkpoint's model is the mean of the replicas (the synced
model at a sync step), loadable under every strategy, with rank 0's optimizer state; each
rank's replica, optimizer state and steps since the sync, and DiLoCo's synced model and
outer optimizer state, travel in the trainer state, so that a resume at the same number of
processes continues exactly (at another number, every replica starts from the saved model,
as after a sync).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.model_averaging.utils import average_parameters
from torch.optim import Optimizer

from dtrain.checkpoint.canonical import canonical_state_dict
from dtrain.checkpoint.format import load_model, model_tensors
from dtrain.checkpoint.optimizer_state import load_by_name, state_by_name
from dtrain.config import Config
from dtrain.errors import ConfigError
from dtrain.parallel.broadcast import broadcast_model, broadcast_tensors
from dtrain.process.topology import Topology
from dtrain.step.batches import LossFn, Weight
from dtrain.strategies.base import Strategy
from dtrain.strategies.specs import StrategySpec

DEFAULT_SYNC_EVERY = 8
"""Optimizer steps between two syncs without --sync-every."""

OUTER_DEFAULTS = {"sgd": (1.0, 0.0), "nesterov": (0.7, 0.9)}
"""(lr, momentum) of each outer optimizer without --outer-lr / --outer-momentum: DiLoCo's
for nesterov; for sgd those that make a sync plain averaging."""


class LocalSGD(Strategy):
    """Whole replicas, one per process, synced every `sync_every` optimizer steps."""

    def __init__(self, config: Config, topology: Topology, spec: StrategySpec) -> None:
        super().__init__(config, topology, spec)
        self.sync_every = config.sync_every or DEFAULT_SYNC_EVERY
        lr, momentum = OUTER_DEFAULTS.get(config.outer_optimizer, (0.0, 0.0))
        self.outer_lr = lr if config.outer_lr is None else config.outer_lr
        self.outer_momentum = momentum if config.outer_momentum is None else config.outer_momentum
        self.placement = replace(
            self.placement,
            layout_text=self._layout_text(),
            coupling=replace(self.placement.coupling, averages_gradients=False),
        )
        self.since_sync = 0
        """Optimizer steps taken since the last sync (the same on every replica)."""
        self.syncs = 0
        self._params: list[nn.Parameter] = []
        self._buffers: list[torch.Tensor] = []
        self._synced: list[nn.Parameter] = []
        """DiLoCo: the model of the last sync, which the outer optimizer steps."""
        self._outer: torch.optim.SGD | None = None
        self._counts_steps = False
        """True once `setup` hooked the optimizer's steps (the syncs follow them)."""

    @property
    def state_by_module(self) -> bool:
        """Both checkpoint formats save the replicas' mean (`full_state`)."""
        return False

    def _layout_text(self) -> str:
        """How often the replicas sync and how (the setup banner's layout)."""
        text = f"sync every {self.sync_every} step{'s' if self.sync_every > 1 else ''}"
        if self.config.outer_optimizer == "none":
            return text + ", averaging"
        return (
            f"{text}, DiLoCo outer {self.config.outer_optimizer} lr {self.outer_lr:g} "
            f"momentum {self.outer_momentum:g}"
        )

    # -- setup ----------------------------------------------------------------------------
    def wrap(
        self, model: nn.Module, optimizer: Optimizer | None
    ) -> tuple[nn.Module, Optimizer | None]:
        """Start every replica from rank 0's model; sync after every `sync_every`-th step
        of `optimizer` (a post-step hook, so hand-written loops sync too)."""
        wrapped, optimizer = super().wrap(model, optimizer)
        module = self.unwrap()
        broadcast_model(module, None, self.topology.device)
        self._params = [p for p in module.parameters() if p.requires_grad]
        self._buffers = [b for b in module.buffers() if _averaged(b)]
        if self.config.outer_optimizer != "none":
            self._synced = [nn.Parameter(p.detach().clone()) for p in self._params]
            self._outer = torch.optim.SGD(
                self._synced,
                lr=self.outer_lr,
                momentum=self.outer_momentum,
                nesterov=self.config.outer_optimizer == "nesterov",
            )
        if optimizer is not None:
            optimizer.register_step_post_hook(self._stepped)
        self._counts_steps = optimizer is not None
        return wrapped, optimizer

    def forward_backward(self, batch: Any, loss_fn: LossFn | None, scale: Weight) -> torch.Tensor:
        self._require_optimizer()
        return super().forward_backward(batch, loss_fn, scale)

    def backward(self, loss: torch.Tensor) -> None:
        self._require_optimizer()
        super().backward(loss)

    def _require_optimizer(self) -> None:
        # Without the optimizer the replicas would never sync, and train apart all run.
        if not self._counts_steps:
            raise ConfigError(
                "--strategy local-sgd syncs the replicas after every --sync-every steps of "
                "the optimizer it was given, and engine.setup got none; pass the optimizer "
                "to engine.setup(model, optimizer) before training."
            )

    def _stepped(self, *_: Any) -> None:
        self.since_sync += 1
        # >=: a run resumed with a smaller --sync-every than the one that saved it syncs at
        # its next step.
        if self.since_sync >= self.sync_every:
            self.sync()

    # -- the sync -------------------------------------------------------------------------
    def _average(self, tensors: list[torch.Tensor], alike: list[torch.Tensor]) -> None:
        """Replace each of `tensors` and `alike` by its mean over the replicas (one
        all-reduce per dtype); each of `alike` (buffers, frozen parameters) as rank 0's value
        plus the mean difference from it, exact where the replicas hold the same value."""
        group = self.placement.dp_group
        if not dist.is_initialized() or dist.get_world_size(group) == 1:
            return
        anchors = [t.clone() for t in alike]
        broadcast_tensors(anchors, group, self.topology.device)
        for t, anchor in zip(alike, anchors, strict=True):
            # Equal values differ by exactly 0, infinities included (where t - anchor is NaN).
            t.copy_(torch.where(t == anchor, 0, t - anchor))
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for t in [*tensors, *alike]:
            by_dtype.setdefault(t.dtype, []).append(t)
        for same in by_dtype.values():
            average_parameters(iter(same), group)  # type: ignore[arg-type]
        for t, anchor in zip(alike, anchors, strict=True):
            t.add_(anchor)

    @torch.no_grad()
    def sync(self) -> None:
        """Bring every replica to the new synced model (collective over the replicas):
        the mean of the replicas, or DiLoCo's outer step on their mean change."""
        if self._outer is None:
            self._average(self._params, self._buffers)
        else:
            deltas = [g - p for g, p in zip(self._synced, self._params, strict=True)]
            self._average(deltas, self._buffers)
            for g, delta in zip(self._synced, deltas, strict=True):
                g.grad = delta
            self._outer.step()
            self._outer.zero_grad(set_to_none=True)
            for p, g in zip(self._params, self._synced, strict=True):
                p.copy_(g)
        self.since_sync = 0
        self.syncs += 1

    def figures(self) -> dict[str, object]:
        """H, the outer optimizer, the syncs taken, and the bytes each replica all-reduces
        per optimizer step: a sync's payload over H (ddp all-reduces the gradients, about
        the parameters' bytes, every step)."""
        payload = sum(t.numel() * t.element_size() for t in [*self._params, *self._buffers])
        out: dict[str, object] = {
            "sync_every": self.sync_every,
            "outer_optimizer": self.config.outer_optimizer,
            "syncs": self.syncs,
            "sync_bytes_per_step": payload / self.sync_every,
        }
        if self._outer is not None:
            out |= {"outer_lr": self.outer_lr, "outer_momentum": self.outer_momentum}
        return out

    # -- checkpoints ----------------------------------------------------------------------
    @torch.no_grad()
    def full_state(
        self, optimizer: Optimizer | None
    ) -> tuple[dict[str, torch.Tensor] | None, dict[str, Any] | None]:
        """The mean of the replicas (collective) and rank 0's optimizer state; at a sync
        step every replica holds the synced model, which is saved as it is."""
        if self.since_sync == 0:
            return super().full_state(optimizer)
        module = self.unwrap()
        state = canonical_state_dict(module.state_dict(keep_vars=True))
        trained = {id(p) for p in self._params}
        mean = {
            k: v.detach().clone()
            for k, v in state.items()
            if isinstance(v, torch.Tensor) and _averaged(v)
        }
        self._average(
            [t for k, t in mean.items() if id(state[k]) in trained],
            [t for k, t in mean.items() if id(state[k]) not in trained],
        )
        if not self.topology.is_main:
            return None, None
        tensors = {
            k: mean.get(k, v).detach().to("cpu").contiguous()  # type: ignore[arg-type]
            for k, v in state.items()
        }
        return tensors, state_by_name(optimizer, module) if optimizer else None

    def load_full_state(
        self,
        tensors: dict[str, torch.Tensor],
        optimizer: Optimizer | None,
        optimizer_state: dict[str, Any] | None,
        strict: bool,
    ) -> list[str]:
        """Every replica loads the model: a sync point (DiLoCo's synced model is it)."""
        skipped = super().load_full_state(tensors, optimizer, optimizer_state, strict)
        if self._outer is not None:
            with torch.no_grad():
                for g, p in zip(self._synced, self._params, strict=True):
                    g.copy_(p)
        self.since_sync = 0
        return skipped

    def own_state(self, optimizer: Optimizer | None) -> dict[str, Any] | None:
        """This replica's optimizer state and steps since the sync, its parameters between
        syncs, and on rank 0 DiLoCo's synced model and outer optimizer state."""
        module = self.unwrap()
        state: dict[str, Any] = {
            "since_sync": self.since_sync,
            "optimizer": state_by_name(optimizer, module) if optimizer else None,
        }
        if self.since_sync:
            state["model"] = model_tensors(module)
        if self._outer is not None and self.placement.dp_rank == 0:
            outer = self._outer.state_dict()
            state["synced"] = [g.detach().cpu() for g in self._synced]
            state["outer"] = {
                "state": {
                    i: {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in s.items()}
                    for i, s in outer["state"].items()
                },
                "param_groups": outer["param_groups"],
            }
        return {"replica": state, "powersgd": None}

    @torch.no_grad()
    def load_own_state(
        self,
        mine: dict[str, Any] | None,
        first: dict[str, Any] | None,
        optimizer: Optimizer | None,
        model_loaded: bool,
    ) -> list[str]:
        """Continue this replica where it was saved; at another number of ranks (`mine`
        None) every replica goes on from the saved model, its mean."""
        saved = first.get("replica") if first else None
        if saved is None or not model_loaded:
            return []
        own = mine["replica"] if mine else None
        self._load_replica(own, saved, optimizer)
        if own is not None or not saved.get("since_sync"):
            return []
        return [
            "was saved by replicas between two syncs at another number of ranks; the "
            f"{self.placement.dp_size} replicas now start from their mean, as after a sync."
        ]

    def _load_replica(
        self, mine: dict[str, Any] | None, first: dict[str, Any], optimizer: Optimizer | None
    ) -> None:
        module = self.unwrap()
        if mine is not None:
            if "model" in mine:
                load_model(module, mine["model"])
            if optimizer is not None and mine["optimizer"] is not None:
                load_by_name(optimizer, module, mine["optimizer"])
            self.since_sync = mine["since_sync"]
        # DiLoCo's synced model and outer momentum are every replica's: restored at any
        # number of replicas (where the replicas restart from the saved model, the synced
        # one is the model of the last sync, which the outer momentum belongs to).
        at_sync = mine is not None or not first["since_sync"]
        if self._outer is not None and "outer" in first and at_sync:
            for g, saved in zip(self._synced, first["synced"], strict=True):
                g.copy_(saved)
            self._outer.load_state_dict(first["outer"])

    def close(self) -> None:
        self._params, self._buffers, self._synced, self._outer = [], [], [], None
        super().close()


def _averaged(tensor: torch.Tensor) -> bool:
    """Whether a sync averages `tensor` over the replicas (floating point or complex)."""
    return tensor.is_floating_point() or tensor.is_complex()
