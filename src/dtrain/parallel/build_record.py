"""What a model's constructor does to its tensors while it is built on the meta device, kept
so that setup can do it again with storage (`dtrain.parallel.materialize`).

A build on torch's meta device computes no values. While the model is built inside
``engine.init_empty()``, a torch function mode (`torch.overrides.TorchFunctionMode`)
watches every torch call and keeps, in order, each step of the build that gives the
model's tensors values:

- each call of a module's own initialisation, ``reset_parameters()`` (torch's layers call
  it from their constructors) or ``init_weights()`` (a model's constructor ends with it;
  Hugging Face's ``post_init`` calls it), with the tensors its module tree held when it
  started; a call inside another (``init_weights()`` calling a block's) belongs to the
  outer one;
- each in-place operation on a whole tensor outside such a call, with its arguments
  (torchvision's ResNet draws ``nn.init.kaiming_normal_`` in its constructor); the
  ``torch.nn.init`` functions that do nothing on the meta device (``orthogonal_``,
  ``dirac_``, ``sparse_``, ``trunc_normal_``) or write through ``out=`` (``eye_``) are kept
  as one step each, the function and its arguments.

A call keeps the module tree it ran on (each submodule and the names of the tensors each
holds) and each module's plain attributes (numbers, strings): setup replays it with those and
refuses the model if the tree changed after the call (a head replaced, a child added).

Setup replays these steps in their order from the random state the block started with,
which draws exactly the numbers the whole build drew. What cannot be replayed from the
record is kept as a refusal naming the module whose constructor did it: an in-place write
through a view (``weight[0].zero_()``) or from a tensor computed during the build, a
random tensor made there (``nn.Parameter(torch.randn(n))``), a draw from a generator of the
model's own, random numbers drawn on the CPU once the first step has begun, a seed or
generator state set then (``torch.manual_seed``, ``torch.set_rng_state``,
``torch.random.fork_rng``, watched for the block's duration), and an initialisation method
that rebinds one of its arguments (setup reads them at its first torch call). What runs in
the block before the first step, a seed or a draw, runs so in a whole build too:
the replay starts from the generator's state at the first step.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from dtrain.parallel.call_reading import call_arguments, rebound_argument, writes_in_place

INIT_METHODS = frozenset({"reset_parameters", "init_weights"})
"""The methods by which a module initialises its own tensors (replayed as calls)."""
RANDOM_FACTORIES = frozenset(
    {"rand", "randn", "randint", "randperm", "normal", "bernoulli", "multinomial", "poisson"}
    | {"rand_like", "randn_like", "randint_like"}
)
"""torch functions that make a new tensor of random numbers."""
INIT_FUNCTIONS = {
    f.__code__: f
    for f in (nn.init.orthogonal_, nn.init.dirac_, nn.init.sparse_, nn.init.trunc_normal_)
    + (nn.init.eye_,)
}
"""torch.nn.init's functions that set nothing on the meta device (they return early, or
write through ``out=``): each call outside an `InitCall` is kept as an `InitOp` of its own,
found by its code so that an alias (``from torch.nn.init import orthogonal_``) is too."""
SEED_SETTERS = ("manual_seed", "seed", "set_rng_state", "fork_rng")
"""The functions of ``torch`` and ``torch.random`` that set the CPU generator's state."""
PLAIN = (bool, int, float, complex, str, bytes, type(None))
"""The attribute values a call's snapshot keeps (an ``std``, a depth): holding any other
object would keep alive what the model dropped (an LSTM's weak references to its weights)."""

Held = tuple[tuple[nn.Module, str, torch.Tensor], ...]
"""(module, name, tensor) for each meta tensor of a module tree at one moment."""
Layout = tuple[tuple[str, int, tuple[str, ...]], ...]
"""(path, id of the module, names of its parameters and buffers) for each module of a tree."""


def own_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    """The parameters and buffers `module` holds itself (not its children's), by name."""
    tensors: dict[str, torch.Tensor] = {}
    for store in (module._parameters, module._buffers):
        tensors.update({name: t for name, t in store.items() if t is not None})
    return tensors


def meta_held(module: nn.Module) -> Held:
    """Every tensor of `module`'s tree still on the meta device, where it is held now."""
    return tuple(
        (sub, name, t)
        for sub in module.modules()
        for name, t in own_tensors(sub).items()
        if t.is_meta
    )


def layout(module: nn.Module) -> Layout:
    """The tree of `module` now: each submodule, by path, with the names of its tensors."""
    return tuple(
        (path, id(sub), (*sub._parameters, *sub._buffers)) for path, sub in module.named_modules()
    )


def attributes(module: nn.Module) -> tuple[tuple[nn.Module, dict[str, Any]], ...]:
    """Each module of `module`'s tree with its attributes now that hold `PLAIN` values."""
    return tuple(
        (sub, {k: v for k, v in vars(sub).items() if isinstance(v, PLAIN)})
        for sub in module.modules()
    )


@dataclass(frozen=True)
class InitCall:
    """A call of ``module.<method>(*args, **kwargs)`` seen during the build."""

    module: nn.Module
    method: str
    held: Held
    """The meta tensors of the module's tree when the call started, where they were held."""
    tree: Layout
    """The module's tree when the call started."""
    state: tuple[tuple[nn.Module, dict[str, Any]], ...]
    """Each module of the tree with its plain attributes when the call started."""
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, module: nn.Module, method: str, *args: Any, **kwargs: Any) -> InitCall:
        """The call of ``module.<method>(*args, **kwargs)`` starting now."""
        return cls(
            module, method, meta_held(module), layout(module), attributes(module), args, kwargs
        )

    def run(self) -> None:
        """Call it again, each module of the tree holding the plain attributes it held then
        (a number or string set since is set back for the call's duration)."""
        swapped = []
        for sub, kept in self.state:
            now = vars(sub)
            changed = {k: v for k, v in kept.items() if k not in now or now[k] is not v}
            swapped.append((sub, {k: now[k] for k in changed if k in now}, changed))
            now.update(changed)
        try:
            getattr(self.module, self.method)(*self.args, **self.kwargs)
        finally:
            for sub, before, changed in swapped:
                for k in changed:
                    vars(sub).pop(k)
                vars(sub).update(before)


@dataclass(frozen=True)
class Ref:
    """An argument of an `InitOp` that is a tensor of the build: its value at replay."""

    tensor: torch.Tensor


@dataclass(frozen=True)
class InitOp:
    """An in-place ``func(*args, **kwargs)`` on a whole tensor outside any `InitCall`, every
    tensor of the build among its arguments (the one it writes first) as a `Ref`."""

    func: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]

    def refs(self) -> list[torch.Tensor]:
        """The tensors of the build it reads or writes."""
        return [a.tensor for a in (*self.args, *self.kwargs.values()) if isinstance(a, Ref)]


Step = InitCall | InitOp


@dataclass(frozen=True)
class Unreplayable:
    """A step of the build that setup cannot do again."""

    owner: nn.Module | None
    """The module whose constructor did it (None: code outside any constructor)."""
    what: str


@dataclass
class BuildRecord:
    """The record of one ``engine.init_empty()`` block."""

    rng_state: torch.Tensor
    """The CPU generator's state when the build's first step started (what ran in the
    block before it, a seed or a draw, runs so in a whole build too)."""
    steps: list[Step] = field(default_factory=list)
    init_weights_ran: set[nn.Module] = field(default_factory=set)
    """Every module whose ``init_weights()`` ran, as a step or inside one."""
    unreplayable: list[Unreplayable] = field(default_factory=list)
    reseeded: list[Unreplayable] = field(default_factory=list)
    """Each setting of the CPU generator's state once the first step had started."""
    drew_on_cpu: bool = False
    """True if the CPU generator moved once the first step had started (a real tensor drew
    from it, or a seed was set): the steps after cannot draw as the whole build does."""


class _Recorder(TorchFunctionMode):
    """Keeps the steps of a build in `record` (see the module's docstring). Frames that were
    on the stack when recording started (the script's own, which may sit in a method of the
    same names) are not part of the build."""

    def __init__(self, record: BuildRecord, outside: set[FrameType]) -> None:
        super().__init__()
        self.record = record
        self.outside = outside
        self.call: FrameType | None = None  # the frame of the call being recorded as a step
        self.known: dict[int, torch.Tensor] = {}  # tensors whose values the replay holds
        self.aliases: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id -> (alias, base)

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: tuple[type, ...],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        self._note(func, args, kwargs, result)
        return result

    def _frames(self) -> Iterator[FrameType]:
        frame = inspect.currentframe()
        while frame is not None and frame not in self.outside:
            yield frame
            frame = frame.f_back

    def _note(self, func: Callable[..., Any], args: tuple, kwargs: dict, result: Any) -> None:
        name = getattr(func, "__name__", "")
        values = [*args, *kwargs.values()]
        if any(isinstance(v, torch.Generator) for v in values):
            self._refuse(f"{name} with a generator of its own")
        outer = function = None
        for frame in self._frames():
            module = frame.f_locals.get("self") if frame.f_code.co_name in INIT_METHODS else None
            if isinstance(module, nn.Module):
                if frame.f_code.co_name == "init_weights":
                    self.record.init_weights_ran.add(module)
                outer = (frame, module)
            if frame.f_code in INIT_FUNCTIONS:
                function = frame
        if outer is not None:
            self._in_call(*outer)
            return
        if function is not None and self._in_function(function):
            return
        self.call = None
        # torch.nn.init's functions that are torch functions take the tensor by keyword.
        target = args[0] if args else kwargs.get("tensor")
        target = target if isinstance(target, torch.Tensor) else None
        if name in RANDOM_FACTORIES and isinstance(result, torch.Tensor) and result.is_meta:
            self._refuse(f"torch.{name}")
        elif target is None or not target.is_meta:
            return
        elif name == "detach" or getattr(func, "__self__", None) is torch.Tensor.data:
            self.aliases[id(result)] = (result, self._base(target))
        elif isinstance(kwargs.get("out"), torch.Tensor) and kwargs["out"].is_meta:
            self._refuse(f"{name} with out=")
        elif writes_in_place(name):
            self._in_place(func, name, target, args, kwargs)

    def _in_call(self, frame: FrameType, module: nn.Module) -> None:
        if frame is self.call:
            return
        self.call = frame  # held until the next step: its id is not reused meanwhile
        method = frame.f_code.co_name
        args, kwargs = call_arguments(frame)
        if any(isinstance(v, torch.Tensor) and v.is_meta for v in (*args, *kwargs.values())):
            self._refuse(f"{method}() given a tensor of the build")
        rebound = rebound_argument(frame.f_code)
        if rebound is not None:
            self._refuse(f"{method}() assigns its argument '{rebound}'")
        call = InitCall.of(module, method, *args, **kwargs)
        self.known.update((id(t), t) for _, _, t in call.held)
        self._append(call)

    def _in_function(self, frame: FrameType) -> bool:
        """Record the call of a torch.nn.init function in `frame` on a meta tensor as one
        step (its torch calls inside are not steps); False: not on a meta tensor."""
        tensor = frame.f_locals.get("tensor")
        if not isinstance(tensor, torch.Tensor) or not tensor.is_meta:
            return False
        if frame is not self.call:
            self.call = frame
            function = INIT_FUNCTIONS[frame.f_code]
            args, kwargs = call_arguments(frame, first=0)
            if any(isinstance(v, torch.Generator) for v in (*args, *kwargs.values())):
                self._refuse(f"{function.__name__} with a generator of its own")
            self._in_place(function, function.__name__, tensor, args, kwargs)
        return True

    def _in_place(
        self, func: Callable[..., Any], name: str, target: torch.Tensor, args: tuple, kwargs: dict
    ) -> None:
        if target._base is not None:  # no public test of "is a view"
            self._refuse(f"{name} through a view")
            return
        base = self._base(target)
        self.known[id(base)] = base
        resolved = tuple(self._argument(name, a, target) for a in args)
        named = {k: self._argument(name, v, target) for k, v in kwargs.items()}
        self._append(InitOp(func, resolved, named))

    def _append(self, step: Step) -> None:
        if not self.record.steps:
            self.record.rng_state = torch.get_rng_state()
        self.record.steps.append(step)

    def _argument(self, name: str, value: Any, target: torch.Tensor) -> Any:
        if value is target:
            return Ref(self._base(target))
        if isinstance(value, (tuple, list)):
            if any(isinstance(v, torch.Tensor) and v.is_meta for v in value):
                self._refuse(f"{name} indexed by a tensor computed in the constructor")
            return value
        if not isinstance(value, torch.Tensor) or not value.is_meta:
            return value
        base = self._base(value)
        if id(base) not in self.known:
            self._refuse(f"{name} from a tensor computed in the constructor")
        return Ref(base)

    def _base(self, tensor: torch.Tensor) -> torch.Tensor:
        """The tensor `tensor` is a whole alias of (``.data``, ``.detach()``), or itself."""
        alias = self.aliases.get(id(tensor))
        return alias[1] if alias is not None and alias[0] is tensor else tensor

    def _refuse(self, what: str) -> None:
        self.record.unreplayable.append(Unreplayable(self._owner(), what))

    def _owner(self) -> nn.Module | None:
        """The module whose constructor is running (the innermost), if any."""
        for frame in self._frames():
            module = frame.f_locals.get("self") if frame.f_code.co_name == "__init__" else None
            if isinstance(module, nn.Module):
                return module
        return None

    def watched(self, name: str, setter: Callable[..., Any]) -> Callable[..., Any]:
        """`setter` of the CPU generator's state, noting each call once a step has started."""

        @functools.wraps(setter)
        def watched_setter(*args: Any, **kwargs: Any) -> Any:
            if self.record.steps:
                self.record.reseeded.append(Unreplayable(self._owner(), name))
            return setter(*args, **kwargs)

        return watched_setter


@contextlib.contextmanager
def _watching_seeds(recorder: _Recorder) -> Iterator[None]:
    """Route `SEED_SETTERS` through `recorder` while the block runs (restored after it)."""
    originals = [
        (m, n, getattr(m, n)) for m in (torch, torch.random) for n in SEED_SETTERS if hasattr(m, n)
    ]
    for module, name, setter in originals:
        setattr(module, name, recorder.watched(f"{module.__name__}.{name}", setter))
    try:
        yield
    finally:
        for module, name, setter in originals:
            setattr(module, name, setter)


@contextlib.contextmanager
def recording() -> Iterator[BuildRecord]:
    """Build on the meta device inside this block; the record it yields is filled as the
    block runs (complete when it ends)."""
    record = BuildRecord(torch.get_rng_state())
    outside: set[FrameType] = set()
    frame = inspect.currentframe()
    while frame is not None:
        outside.add(frame)
        frame = frame.f_back
    recorder = _Recorder(record, outside)
    try:
        with _watching_seeds(recorder), torch.device("meta"), recorder:
            yield record
    finally:
        outside.clear()  # frames and the last call's locals are not kept past the block
        recorder.call = None
        record.drew_on_cpu = not torch.equal(torch.get_rng_state(), record.rng_state)
