"""Expert parallelism (``--ep N``): each mixture-of-experts layer's experts over N ranks.

The MoE layers are found as the model says (`experts_of`): a model's own
``expert_parallel_plan()`` (names of its experts modules, ``*`` for any one part), else a
Hugging Face config's ``base_model_ep_plan``. An experts module holds its experts stacked
(every parameter's first dimension is the expert, as Hugging Face MoE models and the
bundled GPT's `--experts` store them) and is called with the tokens, their chosen experts
and weights: ``experts(hidden (T, dim), top_k_index (T, K), top_k_weights (T, K))``.

The expert-parallel groups are N neighbouring data-parallel ranks; rank r of a group keeps
experts r*E/N .. (r+1)*E/N - 1 of every layer, as a DTensor sharded on the expert
dimension (replicated over the groups), so checkpoints hold the whole layer under its own
name (`dtrain.parallel.device_mesh.expert_mesh` says on which mesh). Its forward sends
each token to its experts' ranks and back (`dtrain.parallel.all_to_all`), then calls the
module's own forward on the experts it holds. The data-parallel wrappers (DDP, FSDP)
leave the experts alone: after backward their gradients are summed over the ranks
holding the same experts and divided by the data-parallel ranks, which gives the whole
batch's mean as for every other parameter.
"""

from __future__ import annotations

import contextlib
import inspect
import re
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from dtrain.errors import ConfigError
from dtrain.parallel.all_to_all import dispatch
from dtrain.parallel.collective_timing import CollectiveTiming
from dtrain.parallel.device_mesh import ExpertMesh


def experts_of(model: nn.Module) -> dict[str, nn.Module]:
    """`model`'s experts modules by name: those its ``expert_parallel_plan()`` names, else
    its Hugging Face config's ``base_model_ep_plan`` (relative to the base model); empty
    for a model with neither (a dense model)."""
    own = getattr(model, "expert_parallel_plan", None)
    if callable(own):
        patterns = list(own())
    else:
        plan = getattr(getattr(model, "config", None), "base_model_ep_plan", None) or {}
        # The module entries are those whose parameters the plan names below them.
        inner = [k for k in plan if any(other.startswith(k + ".") for other in plan)]
        prefix = getattr(model, "base_model_prefix", "")
        nested = prefix and isinstance(getattr(model, prefix, None), nn.Module)
        base = f"{prefix}." if nested else ""
        patterns = [base + k for k in inner]
    rules = [re.compile(re.escape(p).replace(r"\*", r"[^.]+")) for p in patterns]
    return {
        name: module
        for name, module in model.named_modules()
        if any(rule.fullmatch(name) for rule in rules)
    }


def expert_count(name: str, module: nn.Module) -> int:
    """The experts `module` stacks: the first dimension its parameters share; a
    ConfigError names a module not laid out that way (parameters of different first
    dimensions, held by a module inside it, buffers, a forward that does not take the
    tokens with their chosen experts and weights)."""
    inner = [n for n, _ in module.named_parameters() if "." in n]
    buffers = [n for n, _ in module.named_buffers()]
    if inner or buffers:
        raise ConfigError(
            f"Expert parallelism splits the experts module '{name}' by its own parameters, "
            f"but it holds {', '.join((inner + buffers)[:3])} in modules inside it or as "
            "buffers, which would stay whole; keep every expert tensor a parameter of the "
            f"experts module itself, or leave '{name}' out of the model's "
            "expert_parallel_plan()."
        )
    try:
        inspect.signature(module.forward).bind(None, None, None)
    except TypeError:
        raise ConfigError(
            f"Expert parallelism calls the experts module '{name}' as experts(hidden, "
            "top_k_index, top_k_weights), but its forward takes "
            f"{inspect.signature(module.forward)}; name the module that takes the routed "
            "tokens in the model's expert_parallel_plan()."
        ) from None
    dims = {p.shape[0] if p.dim() else 0 for p in module.parameters()}
    if len(dims) != 1 or 0 in dims:
        raise ConfigError(
            f"Expert parallelism splits the experts module '{name}' on its parameters' first "
            f"dimension (the expert), but they do not share one (first dimensions "
            f"{sorted(dims)}); store the experts stacked, or leave '{name}' out of the "
            "model's expert_parallel_plan()."
        )
    return dims.pop()


def check_experts(model: nn.Module, ep: int) -> dict[str, nn.Module]:
    """`model`'s experts modules, each with a number of experts `ep` divides; a
    ConfigError for a model without any, or experts that do not divide."""
    found = experts_of(model)
    if not found:
        raise ConfigError(
            f"--ep {ep} places each mixture-of-experts layer's experts over {ep} ranks, but "
            f"{type(model).__name__} has no experts modules: neither an "
            "expert_parallel_plan() naming them nor a Hugging Face config with a "
            "base_model_ep_plan; drop --ep for a dense model (the bundled GPT has experts "
            "with --experts E)."
        )
    for name, module in found.items():
        count = expert_count(name, module)
        if count % ep:
            raise ConfigError(
                f"--ep {ep} does not divide the {count} experts of '{name}'; use an --ep "
                f"that divides {count}."
            )
    return found


class ExpertParallel:
    """The experts of a model split over the ep ranks of `mesh`
    (`dtrain.parallel.device_mesh.expert_mesh`), their forward dispatching tokens by
    all-to-all."""

    def __init__(
        self,
        model: nn.Module,
        mesh: ExpertMesh,
        dp: int,
        device: torch.device,
        compiled: bool = False,
        timing: CollectiveTiming | None = None,
    ) -> None:
        if compiled:
            raise ConfigError(
                "--ep sends each MoE layer's tokens to other ranks with a number of rows "
                "known only when they are routed, which compiling the model would trace "
                "once and keep; pass the model to engine.setup uncompiled with --ep."
            )
        self.timing = timing
        """Told when the all-to-alls start and end (the strategy's handover)."""
        self.ep = mesh.ep
        self.group = mesh.group
        self.replicas = mesh.replicas
        self.dp = dp
        self.modules = check_experts(model, self.ep)
        self.params: list[nn.Parameter] = []
        """The experts' parameters (DTensors), which the data-parallel wrappers leave alone."""
        self.names: list[str] = []
        self._set_forwards: dict[str, Any] = {}
        """A forward the script set on an experts module itself, kept for `release`."""
        rank = mesh.rank
        for path, module in self.modules.items():
            count = expert_count(path, module)
            local = count // self.ep
            for name, param in list(module.named_parameters(recurse=False)):
                if param.is_meta:
                    raise ConfigError(
                        f"--ep takes each rank's experts of '{path}' from the whole layer, "
                        "but it is on the meta device (built inside engine.init_empty()); "
                        "build a model with experts normally under --ep."
                    )
                mine = param.detach()[rank * local : (rank + 1) * local].to(device, copy=True)
                shard = DTensor.from_local(mine, mesh.mesh, mesh.placements, run_check=False)
                held = nn.Parameter(shard, requires_grad=param.requires_grad)
                module.register_parameter(name, held)
                self.params.append(held)
                self.names.append(f"{path}.{name}")
            self._set_forwards[path] = module.__dict__.get("forward")
            module.forward = self._forward_of(module, count)  # type: ignore[method-assign]

    def _forward_of(self, module: nn.Module, count: int) -> Any:
        own = module.forward  # its own (or one the script set on it), before the wrap

        def forward(
            hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
        ) -> torch.Tensor:
            def compute(rows: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
                with _holding_local(module, count // self.ep, rows.dtype, self._reduce) as held:
                    ones = top_k_weights.new_ones(rows.shape[0], 1)
                    out = own(rows, experts[:, None], ones)
                    # Tied to the rows and the experts even where no token came (a module
                    # may skip experts it has no tokens for): every rank then runs both
                    # exchanges' backward and reduces its experts' gradients.
                    return out + sum((t[:0].sum() for t in (rows, *held)), out.new_zeros(()))

            return dispatch(
                hidden, top_k_index, top_k_weights, count, self.group, compute, self.timing
            )

        return forward

    def _reduce(self, grad: torch.Tensor) -> torch.Tensor:
        """One backward's gradient of this rank's experts made the whole batch's: summed
        over the ranks holding the same experts and divided by the data-parallel ranks
        (each rank's loss is the mean over its share), as it flows into the parameter.
        Linear, so accumulating micro-batches (with or without no_sync) adds up alike."""
        grad = grad / self.dp
        if self.replicas is not None:
            grad = grad.contiguous()
            dist.all_reduce(grad, group=self.replicas)
        return grad

    def release(self) -> None:
        """Give the experts modules their own forward back."""
        for path, module in self.modules.items():
            module.__dict__.pop("forward", None)
            if self._set_forwards[path] is not None:  # one the script set on the module
                module.forward = self._set_forwards[path]  # type: ignore[method-assign]


@contextlib.contextmanager
def _holding_local(
    module: nn.Module,
    local: int,
    dtype: torch.dtype,
    reduce: Callable[[torch.Tensor], torch.Tensor],
) -> Iterator[list[torch.Tensor]]:
    """`module` holds this rank's experts as plain tensors in `dtype` (the tokens' own:
    FSDP's mixed precision leaves the experts in their stored dtype) and says it has
    `local` experts, for its own forward; each backward's gradient of them passes through
    `reduce` on its way to the parameter. Yields the tensors held."""
    params = dict(module._parameters)
    count = getattr(module, "num_experts", None)
    held = []
    for name, param in params.items():
        if isinstance(param, DTensor):
            mine = param.to_local()
            if mine.requires_grad:
                mine.register_hook(reduce)
            if mine.is_floating_point():
                mine = mine.to(dtype)
            module._parameters[name] = mine  # type: ignore[assignment]
            held.append(mine)
    if count is not None:
        module.num_experts = local
    try:
        yield held
    finally:
        module._parameters.update(params)
        if count is not None:
            module.num_experts = count
