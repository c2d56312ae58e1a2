"""A mixture of experts' load-balancing loss over the whole global batch.

Hugging Face MoE models (Mixtral, Qwen2-MoE, ...) add ``coef * E * sum_e f_e * P_e`` to
their loss, f_e the share of the routing choices that went to expert e and P_e its mean
router probability, both over the batch the model sees. Under data parallelism each process
sees its share only: the product of two means is not the mean of the products, so each
process's own loss (what `transformers` computes) trains towards another balance than one
process on the global batch does.

For the length of a training run the model module's ``load_balancing_loss_func`` is
replaced by one that counts the choices and rows of every data-parallel process (an
all-reduce, no gradient) and lets this process's probabilities carry the gradient:
process r returns ``E * sum_e f_e * p_{r,e} * W / w_r``, p_{r,e} its probability sums over
all rows, W the sum of the micro-batch weights (`dtrain.step.batches.share_weights`) of
all processes and w_r its own. The step's weighted mean over processes is then the global
batch's loss, its gradient the global batch's gradient. Evaluation (no gradient) computes
the model's own.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dtrain.errors import ConfigError
from dtrain.step.batches import Weight

NAME = "load_balancing_loss_func"
"""The function Hugging Face MoE models compute their auxiliary loss with."""
SIGNATURE = ("gate_logits", "num_experts", "top_k", "attention_mask")
"""Its parameters in the models whose loss dtrain computes over the global batch (Mixtral,
Qwen2-MoE, DBRX, JetMoE, ...); Switch Transformers' takes other arguments."""


class GlobalBalance:
    """The replacement of one model module's balancing loss, while installed."""

    def __init__(self, model: nn.Module, group: dist.ProcessGroup) -> None:
        self.module = sys.modules[type(model).__module__]
        self.own: Callable[..., Any] = getattr(self.module, NAME)
        self.group = group
        self.weight: Weight = 1.0
        """This process's weight of the micro-batch being computed (set by the step)."""
        setattr(self.module, NAME, self)

    @classmethod
    def install(cls, model: nn.Module, group: dist.ProcessGroup) -> GlobalBalance | None:
        """The replacement for `model`'s module, or None where it computes no such loss;
        a ConfigError for a model that adds one dtrain cannot compute over the global
        batch (a function of other arguments)."""
        own = getattr(sys.modules.get(type(model).__module__), NAME, None)
        if not callable(own):
            return None
        if tuple(inspect.signature(own).parameters)[: len(SIGNATURE)] != SIGNATURE:
            if _adds_balance(model):
                raise ConfigError(
                    f"{type(model).__name__} adds a load-balancing loss (output_router_logits"
                    "=True) that dtrain cannot compute over the global batch (its "
                    f"{NAME} takes other arguments than Mixtral's), so each data-parallel "
                    "rank would train towards its own share's balance; build the model "
                    "with output_router_logits=False, or train it in one process."
                )
            return None
        return cls(model, group)

    def __call__(
        self,
        gate_logits: Any,
        num_experts: int | None = None,
        top_k: int = 2,
        attention_mask: torch.Tensor | None = None,
    ) -> Any:
        if not torch.is_grad_enabled() or not isinstance(gate_logits, tuple) or not num_experts:
            return self.own(gate_logits, num_experts, top_k, attention_mask)
        device = gate_logits[0].device
        chosen = torch.zeros(num_experts, device=device)
        probs = torch.zeros(num_experts, device=device)
        rows = torch.zeros((), device=device)
        mask = None if attention_mask is None else attention_mask.reshape(-1).to(device).float()
        for logits in gate_logits:
            routing = torch.softmax(logits.to(device).float(), dim=-1)
            kept = torch.ones(routing.shape[0], device=device) if mask is None else mask
            picks = torch.topk(routing, top_k, dim=-1).indices.reshape(-1)
            chosen = chosen.scatter_add(0, picks, kept.repeat_interleave(top_k))
            probs = probs + (routing * kept[:, None]).sum(0)
            rows = rows + kept.sum()
        weight = torch.as_tensor(self.weight, dtype=torch.float32, device=device)
        totals = torch.cat([chosen, rows[None], weight[None]]).detach()
        dist.all_reduce(totals, group=self.group)
        share = torch.where(weight > 0, totals[-1] / weight, 0.0)
        every = totals[-2]
        return num_experts * torch.sum(totals[:num_experts] / every * probs / every) * share

    def release(self) -> None:
        """Give the model's module its own function back."""
        if getattr(self.module, NAME, None) is self:
            setattr(self.module, NAME, self.own)


def refuse_local_balance(model: nn.Module, strategy: str) -> None:
    """A ConfigError for a Hugging Face MoE model that adds its load-balancing loss
    (``output_router_logits``), under a strategy whose replicas, towers or micro-batches
    would each compute it over their part of the step's batch only."""
    if not _adds_balance(model):
        return
    raise ConfigError(
        f"{type(model).__name__} adds its load-balancing loss (output_router_logits=True), "
        f"which under strategy {strategy} each replica, tower or micro-batch would compute "
        "over its own part of the batch: another balance than one process trains towards. "
        "Use ddp, zero1, zero2, zero3 or hsdp without --cp and without --grad-accumulation "
        "(dtrain makes the loss the global batch's there), or build the model with "
        "output_router_logits=False."
    )


def _adds_balance(model: nn.Module) -> bool:
    """True if `model` is a Hugging Face MoE model that adds its load-balancing loss."""
    if not getattr(getattr(model, "config", None), "output_router_logits", False):
        return False
    return callable(getattr(sys.modules.get(type(model).__module__), NAME, None))
