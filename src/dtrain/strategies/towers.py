"""`towers`: one process, N model replicas ("towers") sharing one set of variables.

TensorFlow's towers, PyTorch `nn.DataParallel` and Keras `multi_gpu_model`: the
variables live on a parameter device (the CPU, or the only GPU); each batch is split
evenly over the towers; every tower runs a replica refreshed from the variables; the
outputs are gathered on the parameter device, where the loss is computed over the whole
batch; after backward the towers' gradients are summed per variable (variables without
a gradient skipped) and the optimizer applies them once. Works on CPU as well as GPUs.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import parallel_apply
from torch.optim import Optimizer

from dtrain.config import Config
from dtrain.errors import ConfigError
from dtrain.parallel.hooks import gradient_hooks
from dtrain.parallel.preparation import unwrap
from dtrain.parallel.sync_batchnorm import warn_unsynced_batchnorm
from dtrain.process.topology import Topology, use_gpus
from dtrain.step.batches import (
    LabelCounter,
    Weight,
    batch_size,
    share_weights,
    split,
    to_device,
    weigh,
)
from dtrain.strategies.base import Strategy
from dtrain.strategies.specs import StrategySpec, tower_count


def tower_devices(config: Config) -> tuple[list[torch.device], torch.device]:
    """The towers' devices and the parameter device for `config`.

    GPUs: one tower per visible GPU (or the first --towers of them); the variables stay
    on the only GPU, or on the CPU when there are several. CPU: --towers replicas
    (default 2) on the CPU.
    """
    count = tower_count(config)
    if use_gpus(config):
        devices = [torch.device("cuda", i) for i in range(count)]
        param_device = devices[0] if count == 1 else torch.device("cpu")
        return devices, param_device
    return [torch.device("cpu")] * count, torch.device("cpu")


def _gather(outputs: Sequence[Any], device: torch.device, weights: Sequence[Weight]) -> Any:
    """Merge the towers' outputs on `device`: tensors concatenated along dim 0, 0-d tensors
    (a loss the model computed) summed times the towers' `weights` (`share_weights`),
    tuples, lists and dicts (Hugging Face outputs) merged key by key; other values
    (key-value caches) cannot be merged and become None."""
    first = outputs[0]
    if isinstance(first, torch.Tensor):
        if first.dim() == 0:
            return sum(weigh(o.to(device), w) for o, w in zip(outputs, weights, strict=True))
        return torch.cat([o.to(device) for o in outputs], dim=0)
    if isinstance(first, (tuple, list)):
        return type(first)(_gather(parts, device, weights) for parts in zip(*outputs, strict=True))
    if isinstance(first, Mapping):
        merged = {key: _gather([o[key] for o in outputs], device, weights) for key in first}
        try:
            return type(first)(**merged)
        except TypeError:
            return merged
    return None


class TowerReplicas(nn.Module):
    """Runs `module` as replicas on `devices`; `module` itself keeps the variables.

    `state_dict()` and `parameters()` are those of `module` alone (canonical names under
    ``module.``); the replicas are plain attributes, refreshed before every forward.
    """

    def __init__(
        self,
        module: nn.Module,
        devices: list[torch.device],
        param_device: torch.device,
        labels: LabelCounter | None = None,
    ) -> None:
        super().__init__()
        self.labels = labels
        """How the model's own loss counts labels (towers' losses then weigh by them)."""
        self.module = module.to(param_device)
        self.devices = devices
        self.param_device = param_device
        # A tower on the parameter device computes with the variables themselves, as
        # nn.DataParallel does with its first device; the others hold copies.
        master_used = False
        hooks = gradient_hooks(self.module)  # copies lose them; each tower runs them
        replicas: list[nn.Module] = []
        for device in devices:
            if device == param_device and not master_used:
                replicas.append(self.module)
                master_used = True
            else:
                replicas.append(copy.deepcopy(self.module).to(device))
                hooks.register(replicas[-1])
        self._replicas = replicas

    @property
    def replicas(self) -> list[nn.Module]:
        """One module per tower (the first may be `module` itself)."""
        return self._replicas

    def train(self, mode: bool = True) -> TowerReplicas:
        super().train(mode)
        for replica in self._replicas:
            replica.train(mode)
        return self

    @torch.no_grad()
    def _refresh(self) -> None:
        source = list(self.module.parameters()) + list(self.module.buffers())
        for replica in self._replicas:
            if replica is self.module:
                continue
            target = list(replica.parameters()) + list(replica.buffers())
            for dst, src in zip(target, source, strict=True):
                dst.copy_(src, non_blocking=True)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Cut the batch (every tensor argument, positional or keyword, along dim 0) over
        the towers, run each replica on its part, and merge their outputs."""
        towers = len(self._replicas)
        samples = batch_size((args, kwargs))
        if samples < towers:
            raise ConfigError(
                f"A batch of {samples} sample(s) cannot be split over {towers} towers; "
                f"use a batch of at least {towers} (a multiple of {towers} keeps the towers even) "
                "or fewer --towers."
            )
        self._refresh()
        pieces = split((args, kwargs), towers)
        # The towers' losses weigh as their shares of the samples, or of the labels that
        # the model's own loss averages over.
        counted = self.labels is not None and self.labels.applies(kwargs, None)
        weights = share_weights([p[1] for p in pieces] if counted else pieces, None, self.labels)
        parts = [to_device(part, device) for part, device in zip(pieces, self.devices, strict=True)]
        tower_args = [part[0] for part in parts]
        tower_kwargs = [part[1] for part in parts]
        if all(d.type == "cuda" for d in self.devices) and len(set(self.devices)) == towers:
            outputs = parallel_apply(self._replicas, tower_args, tower_kwargs, self.devices)
        else:
            # CPU towers share the cores; running them one after the other is as fast.
            outputs = [
                replica(*a, **kw)
                for replica, a, kw in zip(self._replicas, tower_args, tower_kwargs, strict=True)
            ]
        if self.training:
            self._keep_first_buffers()
        return _gather(outputs, self.param_device, weights)

    @torch.no_grad()
    def _keep_first_buffers(self) -> None:
        """Running statistics (BatchNorm) follow the first tower, as in nn.DataParallel."""
        first = self._replicas[0]
        if first is not self.module:
            for dst, src in zip(self.module.buffers(), first.buffers(), strict=True):
                dst.copy_(src)

    @torch.no_grad()
    def combine_gradients(self) -> None:
        """Sum every tower's gradient into the variables, per variable, skipping None."""
        params = list(self.module.parameters())
        for replica in self._replicas:
            if replica is self.module:
                continue
            for param, tower_param in zip(params, replica.parameters(), strict=True):
                if tower_param.grad is None:
                    continue
                grad = tower_param.grad.to(self.param_device)
                if param.grad is None:
                    param.grad = grad
                else:
                    param.grad.add_(grad)
                tower_param.grad = None


class Towers(Strategy):
    """Single-process data parallel over N replicas (`--towers N`)."""

    def __init__(self, config: Config, topology: Topology, spec: StrategySpec) -> None:
        super().__init__(config, topology, spec)
        devices, self.param_device = tower_devices(config)
        # Batches arrive on the parameter device, where the towers' outputs are gathered.
        self.placement = replace(
            self.placement,
            input_device=self.param_device,
            devices=tuple(devices),
            # The towers' gradients are summed after autograd's pass.
            coupling=replace(self.placement.coupling, exchange_after_backward=True),
            micro_splits=len(devices),
        )

    def wrap(
        self, model: nn.Module, optimizer: Optimizer | None
    ) -> tuple[nn.Module, Optimizer | None]:
        model, preparation = unwrap(model, self.config)
        devices = list(self.placement.devices)
        warn_unsynced_batchnorm(
            model,
            len(devices),
            "tower's",
            "nn.DataParallel does the same. To normalise over the whole batch, use "
            "--strategy ddp --sync-batchnorm.",
        )
        self.model = TowerReplicas(model, devices, self.param_device, self.labels)
        for replica in self.model.replicas:
            preparation.finish(replica)
        return self.model, optimizer

    def unwrap(self) -> nn.Module:
        assert isinstance(self.model, TowerReplicas)
        return self.model.module

    def eval_module(self) -> nn.Module:
        assert self.model is not None
        return self.model

    def backward(self, loss: torch.Tensor) -> None:
        assert isinstance(self.model, TowerReplicas)
        loss.backward()
        self.model.combine_gradients()
