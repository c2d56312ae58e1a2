"""Models built without memory: on the meta device, given storage only where they are held.

A model built inside ``engine.init_empty()`` has every shape and no values (torch's meta
device). `engine.setup` shards, splits or slices it first, gives storage on the device
only to this rank's part (`materialize`), then gives that part its values (`DeferredInit`).

The rule: the model starts from exactly the values, bit for bit, that building it whole on
the CPU from the same random state gives, or setup refuses it by name before training;
never from silently different ones. While the block runs, `dtrain.parallel.build_record`
records each step of the build that gives tensors values, in the build's order: each
``reset_parameters()`` call (torch's layers make it in their constructors), each
``init_weights()`` call (a constructor ending with it; every Hugging Face model makes it
through ``post_init``, each of its sub-models too), and each in-place initialisation a
constructor does itself (``nn.init.kaiming_normal_`` in torchvision's ResNet). Setup
replays these steps in that order on host tensors, from the random state the build's first
step started from: the same draws in the same order, so the same values, and the CPU generator
left where the whole build leaves it (random numbers drawn between the block and setup are
drawn again). A tensor a call rebinds (``self.freqs_cis = table()``) takes the new value.
A model whose constructor does not call its ``init_weights()`` (torchtitan's models, which
their trainer initialises after building them) has it called once after those steps: it
starts as the whole build followed by ``model.init_weights()``.

Refused by name, each with what to do: a tensor that no replayed step sets, or sets only
in part (floating and complex tensors start as NaN; any other must have been written); a
step of the build that cannot be replayed (`dtrain.parallel.build_record`); a submodule's
``init_weights()`` the build never called (dtrain cannot tell when a whole build would); a
model put on the meta device outside ``engine.init_empty()``. Host memory holds one
module's tensors at a time, or the whole model's while an ``init_weights()`` runs.

Every rank starts from rank 0's model, as when a built model is broadcast: a rank that
holds only a part draws it from the random state rank 0's build started from. Setup leaves
the CPU generator as the whole build would have (under the strategies that split the
model, as rank 0's build would have).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from dtrain.checkpoint.canonical import canonical_name
from dtrain.errors import SetupError
from dtrain.parallel.build_record import (
    BuildRecord,
    InitCall,
    InitOp,
    Ref,
    Step,
    own_tensors,
)
from dtrain.parallel.replay_refusals import OUTSIDE, refuse_unreplayable
from dtrain.process.logs import LOGGER

INIT_RULE = (
    "give it a reset_parameters() method that sets all its own parameters and buffers (as "
    "torch's layers have), or define init_weights() on the model"
)

Slot = tuple[int, str]
"""Where a tensor is held: (id of the module, name)."""


def _is_meta(tensor: torch.Tensor) -> bool:
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.is_meta


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
            if any(_is_meta(t) for t in own_tensors(sub).values()):
                sub.to_empty(device=device, recurse=False)


@dataclass(frozen=True)
class DeferredInit:
    """The replay of a model's build on the meta device: its steps, where the tensors they
    set are held in the model, and the random state to draw their values from."""

    rng_state: torch.Tensor
    """The CPU generator's state when the build's first step started."""
    steps: tuple[Step, ...]
    places: dict[int, list[tuple[str, str]]]
    """id of each tensor the model held on the meta device -> its (module path, name)s."""
    after: dict[tuple[int, int, str], int]
    """(step, slot) -> id of the tensor the slot held after that step of the build, for a
    slot the step rebinds."""
    release_at: dict[int, list[int]]
    """step -> ids of the tensors no later step needs: set in the model after it."""
    loaded: frozenset[int] = frozenset()
    """ids of the tensors a load sets right after setup (``engine.setup(pretrained=...)``):
    the replay stands meta tensors in for them, so it neither draws nor keeps their values."""

    @classmethod
    def of(
        cls, model: nn.Module, record: BuildRecord | None, loaded: frozenset[str] = frozenset()
    ) -> DeferredInit | None:
        """The replay of `model`'s build, or None if nothing in it is on the meta device;
        refuses a model that could not start as its whole build (see the module's
        docstring). `loaded`: the state-dict names a load sets right after setup."""
        places: dict[int, list[tuple[str, str]]] = {}
        for path, module in model.named_modules():
            for name, tensor in own_tensors(module).items():
                if _is_meta(tensor):
                    places.setdefault(id(tensor), []).append((path, name))
        if not places:
            return None
        if record is None:
            raise SetupError(
                "The model holds tensors on the meta device but was not built inside "
                "engine.init_empty, so setup cannot know how its build initialises them; "
                "build it inside `with engine.init_empty():`, or give it values before setup."
            )
        refuse_unreplayable(model, record)
        steps = list(record.steps)
        if callable(getattr(model, "init_weights", None)) and model not in record.init_weights_ran:
            LOGGER.info(
                "%s's constructor does not call init_weights(); setup calls it after the "
                "build's own initialisation.",
                type(model).__name__,
            )
            steps.append(InitCall.of(model, "init_weights"))
        after, last = _lifetimes(model, steps)
        for tid, keys in places.items():
            if tid not in last:
                path, name = keys[0]
                module = model.get_submodule(path)
                raise SetupError(
                    f"Module '{path or 'model'}' ({type(module).__name__}) was built on the "
                    f"meta device (engine.init_empty) holding {name}, which nothing in its "
                    f"build initialises in a way setup can replay (no reset_parameters() or "
                    f"init_weights() sets it); {INIT_RULE}, {OUTSIDE}."
                )
        release_at: dict[int, list[int]] = {}
        for tid, k in last.items():
            release_at.setdefault(k, []).append(tid)
        skipped = frozenset(
            tid
            for tid, keys in places.items()
            if any(canonical_name(f"{path}.{name}".lstrip(".")) in loaded for path, name in keys)
        )
        return cls(record.rng_state, tuple(steps), places, after, release_at, skipped)

    def from_first_rank(self) -> DeferredInit:
        """This replay with rank 0's random state (a collective over every process of a
        multi-process job), so that every rank draws the values rank 0 would: the model
        every rank starts from is rank 0's, as when a built model is broadcast."""
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return self
        state = [self.rng_state]
        dist.broadcast_object_list(state, src=0)
        return replace(self, rng_state=state[0])

    @torch.no_grad()
    def initialise(self, model: nn.Module) -> None:
        """Give the tensors of `model` that were on the meta device, where this rank holds
        them, the values the whole build gives them (what it does not hold is replayed
        too, to keep the random stream in step, and dropped). The CPU generator is left
        where the whole build would have left it, or, with tensors `loaded`, where a build
        that draws none of their values would have."""
        try:
            self._replay(model)
            return
        except (_ReadsLoaded, RuntimeError, NotImplementedError) as e:  # read a loaded value?
            if not self.loaded:
                raise
            LOGGER.info(
                "Initialising the model without the values it loads failed (%s); setup "
                "replays its whole build instead.",
                e,
            )
        replace(self, loaded=frozenset())._replay(model)

    def _replay(self, model: nn.Module) -> None:
        torch.set_rng_state(self.rng_state)
        replay = _Replay(self)
        for k, step in enumerate(self.steps):
            if isinstance(step, InitOp):
                replay.op(step)
            else:
                replay.call(k, step)
            for tid in self.release_at.get(k, ()):
                replay.release(model, tid)


def _lifetimes(
    model: nn.Module, steps: list[Step]
) -> tuple[dict[tuple[int, int, str], int], dict[int, int]]:
    """For the replay of `steps`: which tensor each slot a call holds is after the call (the
    one the next call holding that slot found there, or the one the model holds now), and
    the last step that needs each tensor's value."""
    later: dict[Slot, int] = {
        (id(module), name): id(tensor)
        for module in model.modules()
        for name, tensor in own_tensors(module).items()
        if _is_meta(tensor)
    }
    after: dict[tuple[int, int, str], int] = {}
    last: dict[int, int] = {}
    for k in range(len(steps) - 1, -1, -1):
        step = steps[k]
        if isinstance(step, InitOp):
            for tensor in step.refs():
                last.setdefault(id(tensor), k)
            continue
        for module, name, tensor in step.held:
            slot = (id(module), name)
            if slot in later:
                after[(k, *slot)] = later[slot]
                last.setdefault(later[slot], k)
            last.setdefault(id(tensor), k)
        later.update(((id(m), n), id(t)) for m, n, t in step.held)
    return after, last


class _ReadsLoaded(Exception):
    """A replayed step gave a tensor that is not loaded a value read from one that is."""


class _Replay:
    """The host tensors of one replay, by the id of the build's tensor they stand for."""

    def __init__(self, deferred: DeferredInit) -> None:
        self.deferred = deferred
        self.values: dict[int, torch.Tensor] = {}
        self.fresh: dict[int, tuple[torch.Tensor, int]] = {}  # made here: (tensor, version)

    def value(self, tensor: torch.Tensor) -> torch.Tensor:
        """The host tensor standing for `tensor`: unset (see `_unset_like`) until written;
        a meta tensor for one that is loaded after setup, or, then, that the model no longer
        holds at the end of its build (a head's own weight before it was tied)."""
        if id(tensor) not in self.values and self._stands_in(id(tensor)):
            self.values[id(tensor)] = _unset_like(tensor, torch.device("meta"))
        if id(tensor) not in self.values:
            host = _unset_like(tensor)
            self.values[id(tensor)] = host
            self.fresh[id(tensor)] = (host, host._version)
        return self.values[id(tensor)]

    def _stands_in(self, tid: int) -> bool:
        loaded = self.deferred.loaded
        return bool(loaded) and (tid in loaded or tid not in self.deferred.places)

    def op(self, step: InitOp) -> None:
        """Apply a recorded in-place operation to the host tensors."""
        args = [self.value(a.tensor) if isinstance(a, Ref) else a for a in step.args]
        kwargs = {
            k: self.value(v.tensor) if isinstance(v, Ref) else v for k, v in step.kwargs.items()
        }
        step.func(*args, **kwargs)

    def call(self, k: int, step: InitCall) -> None:
        """Run a recorded call with host tensors where its module tree held the build's; a
        tensor it rebinds stands for the one the build held there next."""
        swapped = []
        for module, name, tensor in step.held:
            host = self.value(tensor)
            swapped.append((module, name, own_tensors(module).get(name), host))
            _put(module, name, host)
        try:
            step.run()
        finally:
            for module, name, before, host in swapped:
                now = own_tensors(module).get(name)
                nxt = self.deferred.after.get((k, id(module), name))
                if now is not None and now is not host and nxt is not None:
                    self.values[nxt] = now
                    self.fresh.pop(nxt, None)
                _put(module, name, before)

    def release(self, model: nn.Module, tid: int) -> None:
        """Drop the host tensor for `tid`, first setting it where `model` holds it."""
        values, fresh = self.values.pop(tid, None), self.fresh.pop(tid, None)
        if tid in self.deferred.loaded or tid not in self.deferred.places:
            return  # the load sets it, or the model does not hold it
        if values is not None and values.is_meta:
            raise _ReadsLoaded(f"'{self.deferred.places[tid][0][1]}' took a loaded tensor's value")
        for path, name in self.deferred.places.get(tid, ()):
            module = model.get_submodule(path)
            held = own_tensors(module)[name]
            where = f"Initialising module '{path or 'model'}' ({type(module).__name__})"
            untouched = fresh is not None and fresh[0] is values and values._version == fresh[1]
            if values is None or untouched or _has_nan(values):
                raise SetupError(
                    f"{where} built on the meta device left '{name}' unset (setup replays "
                    "reset_parameters(), init_weights() and torch.nn.init calls, not values "
                    f"computed in a constructor); {INIT_RULE}, {OUTSIDE}."
                )
            if values.shape != held.shape or values.dtype != held.dtype:
                raise SetupError(
                    f"{where} built on the meta device gave '{name}' shape "
                    f"{tuple(values.shape)} {values.dtype} where the model holds "
                    f"{tuple(held.shape)} {held.dtype}; give it its own shape and dtype."
                )
            _copy_held(held, values)


def _has_nan(tensor: torch.Tensor) -> bool:
    return (tensor.is_floating_point() or tensor.is_complex()) and bool(tensor.isnan().any())


def _unset_like(tensor: torch.Tensor, device: torch.device | None = None) -> torch.Tensor:
    """A whole-size host tensor for `tensor`'s values (a parameter for a parameter), NaN
    where the dtype has it, so that a value left unset is found; a tensor of another dtype
    is found unset by its version counter (no in-place write ever bumped it). On `device`
    if given (meta: a stand-in without values)."""
    if tensor.is_floating_point() or tensor.is_complex():
        host = torch.full(tensor.shape, float("nan"), dtype=tensor.dtype, device=device)
    else:
        host = torch.zeros(tensor.shape, dtype=tensor.dtype, device=device)
    if isinstance(tensor, nn.Parameter):
        return nn.Parameter(host, requires_grad=tensor.requires_grad)
    return host


def _put(module: nn.Module, name: str, value: torch.Tensor | None) -> None:
    """Hold `value` as `module`'s parameter or buffer `name`, bypassing setattr's checks
    (None: hold nothing there)."""
    store = module._parameters if name in module._parameters else module._buffers
    if value is None:
        store.pop(name, None)
    else:
        store[name] = value


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
    model: nn.Module,
    record: BuildRecord | None,
    places_parts: bool,
    device: torch.device,
    loaded: frozenset[str] = frozenset(),
) -> DeferredInit | None:
    """At setup, for a model built on the meta device (`record`: the build's, if it was
    built inside ``engine.init_empty()``): materialise and initialise it whole on `device`
    now; or, where the strategy places only this rank's part (`places_parts`), return what
    it needs to do so part by part. None: nothing left to do (a built model too).
    `loaded`: state-dict names a load sets right after setup, whose values are not drawn."""
    deferred = DeferredInit.of(model, record, loaded)
    if deferred is None:
        return None
    if places_parts:
        return deferred.from_first_rank()
    materialize(model, device)
    deferred.initialise(model)
    return None
