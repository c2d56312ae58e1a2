"""Models built without memory: on the meta device, given storage only where they are held.

A model built inside ``engine.init_empty()`` has every shape and no values (torch's meta
device). `engine.setup` shards, splits or slices it first, gives storage on the device
only to this rank's part (`materialize`), then gives that part the values a build of the
whole model on the CPU would have drawn from the same random state (`DeferredInit`).

The rule the model must follow is the one a whole build follows without being told: each
layer's constructor draws its initial values with its ``reset_parameters()``, in the
order the layers are built (their order in ``model.named_modules()``), and a model whose
constructor then re-initialises them itself does it in ``init_weights()``. dtrain replays
exactly that on the CPU: every module's ``reset_parameters()`` in module order, one module
at a time, or, for a model that defines ``init_weights()``, all of them then
``init_weights()`` on the whole model in host memory. A module that holds tensors and has
no ``reset_parameters()`` (in a model without ``init_weights()``) cannot be replayed and
is refused by name, as is one whose ``reset_parameters()`` leaves a tensor unset.

Every rank starts from rank 0's model, as when a built model is broadcast: a rank that
holds only a part draws it from the random state rank 0 had on entering
``engine.init_empty()``. Setup leaves the CPU generator as the whole build would have
(under the strategies that split the model, as rank 0's build would have).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from dtrain.errors import SetupError

INIT_RULE = (
    "give it a reset_parameters() method that sets all its own parameters and buffers (as "
    "torch's layers have), or define init_weights() on the model"
)


def _is_meta(tensor: torch.Tensor) -> bool:
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.is_meta


def _own(module: nn.Module) -> dict[str, torch.Tensor]:
    """The parameters and buffers `module` holds itself (not its children's), by name."""
    tensors: dict[str, torch.Tensor] = {}
    for store in (module._parameters, module._buffers):
        tensors.update({name: t for name, t in store.items() if t is not None})
    return tensors


@contextlib.contextmanager
def _swap_on_conversion() -> Iterator[None]:
    """`nn.Module.to_empty` inside keeps each parameter object (`torch.utils.swap_tensors`),
    so an optimizer built on the meta parameters holds the materialised ones."""
    before = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        yield
    finally:
        torch.__future__.set_swap_module_params_on_conversion(before)


def materialize(module: nn.Module, device: torch.device) -> None:
    """Give every meta tensor of `module` uninitialised storage on `device`, in place (the
    same parameter objects; a sharded or sliced DTensor gets storage for its local part).
    Tensors that already have storage keep it and their values."""
    with _swap_on_conversion():
        for sub in module.modules():
            if any(_is_meta(t) for t in _own(sub).values()):
                sub.to_empty(device=device, recurse=False)


@dataclass(frozen=True)
class DeferredInit:
    """The record of a model built on the meta device: which of its modules' own tensors
    were empty and the random state to draw their values from."""

    rng_state: torch.Tensor
    """The CPU generator's state when the model was built (``engine.init_empty()``)."""
    empty: dict[str, list[str]]
    """Module path -> names of the parameters and buffers it held on the meta device."""
    whole_init: bool
    """True if the model defines ``init_weights()``: replay on the whole model at once."""

    @classmethod
    def of(cls, model: nn.Module, rng_state: torch.Tensor) -> DeferredInit | None:
        """The record of `model`, or None if nothing in it is on the meta device; refuses a
        module that could not be initialised (see the module's docstring)."""
        empty = {
            path: names
            for path, module in model.named_modules()
            if (names := [n for n, t in _own(module).items() if _is_meta(t)])
        }
        if not empty:
            return None
        whole_init = callable(getattr(model, "init_weights", None))
        if not whole_init:
            for path, names in empty.items():
                module = model.get_submodule(path)
                if not callable(getattr(module, "reset_parameters", None)):
                    raise SetupError(
                        f"Module '{path or 'model'}' ({type(module).__name__}) was built on the "
                        f"meta device (engine.init_empty) holding {', '.join(names)} but has no "
                        f"reset_parameters() to initialise them; {INIT_RULE}, or build the model "
                        "outside engine.init_empty."
                    )
        return cls(rng_state, empty, whole_init)

    def from_first_rank(self) -> DeferredInit:
        """This record with rank 0's random state (a collective over every process of a
        multi-process job), so that every rank draws the values rank 0 would: the model
        every rank starts from is rank 0's, as when a built model is broadcast."""
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return self
        state = [self.rng_state]
        dist.broadcast_object_list(state, src=0)
        return replace(self, rng_state=state[0])

    @torch.no_grad()
    def initialise(self, model: nn.Module) -> None:
        """Give the tensors of `model` that were empty, where this rank holds them, the
        values a whole build would have drawn (what it does not hold is replayed too, to
        keep the random stream in step, and dropped). The CPU generator is left where the
        whole build would have left it: at the recorded state advanced by every draw of
        the build (random numbers drawn between the build and this call are drawn again)."""
        torch.set_rng_state(self.rng_state)
        if self.whole_init:
            self._replay(model, list(self.empty), model.init_weights)  # type: ignore[operator]
        else:
            for path in self.empty:
                self._replay(model, [path], None)

    def _replay(
        self, model: nn.Module, paths: list[str], then: Callable[[], object] | None
    ) -> None:
        """Swap host tensors full of NaN into the modules at `paths`, run their
        ``reset_parameters()`` in order (then `then`), check each tensor was set, and copy
        the values into the tensors the modules hold."""
        modules = {path: model.get_submodule(path) for path in paths}
        held = {path: {n: _own(modules[path])[n] for n in self.empty[path]} for path in paths}
        host: dict[int, torch.Tensor] = {}  # one per tensor object: tied weights stay tied
        for path, tensors in held.items():
            for name, tensor in tensors.items():
                if id(tensor) not in host:
                    host[id(tensor)] = _unset_like(tensor)
                _put(modules[path], name, host[id(tensor)], tensor)
        try:
            for module in modules.values():
                reset = getattr(module, "reset_parameters", None)
                if callable(reset):
                    reset()
            if then is not None:
                then()
        finally:
            for path, tensors in held.items():
                for name, tensor in tensors.items():
                    _put(modules[path], name, tensor, tensor)
        for path, tensors in held.items():
            for name, tensor in tensors.items():
                values = host[id(tensor)]
                if values.is_floating_point() and values.isnan().any():
                    raise SetupError(
                        f"Initialising module '{path or 'model'}' ({type(modules[path]).__name__})"
                        f" built on the meta device left '{name}' unset; {INIT_RULE}."
                    )
                _copy_held(tensor, values)


def _unset_like(tensor: torch.Tensor) -> torch.Tensor:
    """A whole-size host tensor for `tensor`'s values, NaN where it can be (so a value that
    initialisation did not set is found), zeros otherwise."""
    if tensor.is_floating_point():
        return torch.full(tensor.shape, float("nan"), dtype=tensor.dtype)
    return torch.zeros(tensor.shape, dtype=tensor.dtype)


def _put(module: nn.Module, name: str, value: torch.Tensor, like: torch.Tensor) -> None:
    """Register `value` as `module`'s parameter or buffer `name` (a parameter as one with
    `like`'s requires_grad), bypassing the checks of setattr."""
    if name in module._parameters:
        if not isinstance(value, nn.Parameter):
            value = nn.Parameter(value, requires_grad=like.requires_grad)
        module._parameters[name] = value
    else:
        module._buffers[name] = value


def _copy_held(tensor: torch.Tensor, values: torch.Tensor) -> None:
    """Copy the part of the whole `values` that `tensor` holds on this rank into it: all of
    it, the local shard or slice of a DTensor, nothing if this rank does not hold it."""
    if _is_meta(tensor):
        return
    if not isinstance(tensor, DTensor):
        tensor.copy_(values)
        return
    shape, offset = compute_local_shape_and_global_offset(
        values.shape, tensor.device_mesh, tensor.placements
    )
    part = values[tuple(slice(o, o + s) for s, o in zip(shape, offset, strict=True))]
    tensor.to_local().copy_(part)


def prepare(
    model: nn.Module, rng_state: torch.Tensor, places_parts: bool, device: torch.device
) -> DeferredInit | None:
    """At setup, for a model built on the meta device: materialise and initialise it whole
    on `device` now; or, where the strategy places only this rank's part (`places_parts`),
    return what it needs to do so part by part. None: nothing left to do (a built model
    too)."""
    deferred = DeferredInit.of(model, rng_state)
    if deferred is None:
        return None
    if places_parts:
        return deferred.from_first_rank()
    materialize(model, device)
    deferred.initialise(model)
    return None
