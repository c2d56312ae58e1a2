"""One training script full of ordinary PyTorch habits, run under any strategy.

`run_habit(strategy, habit)` builds a small transformer-like model (embedding, two
residual blocks, a final norm and a head) the way user scripts do, applies one habit
(frozen layers, a sometimes-unused branch, param groups, BatchNorm, tied weights,
accumulation by hand, OneCycleLR, clipping by hand, gradient hooks, torch.compile, a seed
per rank, float64, a non-contiguous parameter, ...) and trains 4 steps on a fixed batch
stream. It returns the whole model's parameters (main rank), or the dtrain error that
refused the habit, so that a test can demand: equal to `single`, or refused by name.
"""

from __future__ import annotations

import contextlib
import gc
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: N812 - torch's usual alias
from torch import nn

import dtrain
from dtrain.config import Config
from dtrain.errors import ConfigError, SetupError
from dtrain.process.topology import init_process_group
from dtrain.strategies.ps import serving
from dtrain.strategies.specs import lookup

VOCAB, DIM, CONTEXT, BATCH, STEPS = 32, 16, 4, 12, 4
SIDE = {"on": False}
"""Whether the blocks' side branch runs in this step (set by the loop: a branch used every
other step, whatever copy of the model runs)."""


@dataclass(frozen=True)
class Habit:
    """What one user script does differently from the plain loop."""

    frozen: bool = False  # block 0 frozen, the optimizer built on what trains (LoRA-style)
    frozen_in_optimizer: bool = False  # block 0 frozen but still in the optimizer
    sometimes_unused: bool = False  # a branch used every other step (+ a never-used layer)
    groups: bool = False  # no weight decay on biases and norms, another lr for the head
    batchnorm: bool = False  # BatchNorm in each block, --sync-batchnorm on data parallel
    tied: bool = False  # head.weight = emb.weight
    accumulate: str = ""  # "no_sync" / "plain": 2 micro-batches by hand per step
    dict_output: bool = False  # forward returns {"logits": ...}
    onecycle: bool = False  # OneCycleLR (cycles AdamW's beta1 as well as the lr)
    clip: bool = False  # torch.nn.utils.clip_grad_norm_ by hand
    hook: bool = False  # p.register_hook on block 1 before setup
    compiled: bool = False  # model = torch.compile(model) before setup
    rank_seed: bool = False  # torch.manual_seed(1337 + rank) before building the model
    double: bool = False  # model.double()
    noncontiguous: bool = False  # a parameter that is a transposed view
    evaluate: bool = False  # engine.evaluate after the second step (eval mode and back)
    bf16: bool = False  # --precision bf16-mixed (against single in bf16-mixed)

    @property
    def by_hand(self) -> bool:
        """True if the loop is written by hand (engine.backward, optimizer.step)."""
        return bool(self.accumulate) or self.clip


HABITS: dict[str, Habit] = {
    "plain": Habit(),
    "frozen": Habit(frozen=True),
    "frozen_in_optimizer": Habit(frozen_in_optimizer=True),
    "sometimes_unused": Habit(sometimes_unused=True),
    "groups": Habit(groups=True),
    "batchnorm": Habit(batchnorm=True),
    "tied": Habit(tied=True),
    "accumulate_no_sync": Habit(accumulate="no_sync"),
    "accumulate_plain": Habit(accumulate="plain"),
    "dict_output": Habit(dict_output=True),
    "onecycle": Habit(onecycle=True),
    "clip": Habit(clip=True),
    "hook": Habit(hook=True),
    "compiled": Habit(compiled=True),
    "rank_seed": Habit(rank_seed=True),
    "double": Habit(double=True),
    "noncontiguous": Habit(noncontiguous=True),
    "evaluate": Habit(evaluate=True),
    "bf16": Habit(bf16=True),
}


class Block(nn.Module):
    """x + down(gelu(up(norm(x)))), with an optional BatchNorm and a side branch."""

    def __init__(self, batchnorm: bool) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, 2 * DIM)
        self.down = nn.Linear(2 * DIM, DIM)
        self.bn = nn.BatchNorm1d(DIM) if batchnorm else None
        self.side = nn.Linear(DIM, DIM)  # used only on the steps SIDE["on"] says
        self.spare = nn.Linear(DIM, DIM)  # never used (with sometimes_unused)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.down(F.gelu(self.up(self.norm(x))))
        if self.bn is not None:
            h = self.bn(h.transpose(1, 2)).transpose(1, 2)
        if SIDE["on"]:
            h = h + self.side(h)
        return h


class Tail(nn.Module):
    """The final norm and the head, as one pipeline layer (a wrapper of the model's own
    modules, as ports of nanoGPT write it)."""

    def __init__(self, norm: nn.Module, head: nn.Module) -> None:
        super().__init__()
        self.norm, self.head = norm, head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(x))


class HabitNet(nn.Module):
    """Tokens (N, T) -> logits (N, T, VOCAB)."""

    def __init__(self, habit: Habit) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList([Block(habit.batchnorm) for _ in range(2)])
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.dict_output = habit.dict_output
        if habit.tied:
            self.head.weight = self.emb.weight
        if not habit.sometimes_unused:
            for block in self.blocks:
                del block.side, block.spare
                block.side = block.spare = None  # type: ignore[assignment]

    def forward(self, x: torch.Tensor) -> Any:
        h = self.emb(x)
        for block in self.blocks:
            h = block(h)
        logits = self.head(self.norm(h))
        return {"logits": logits} if self.dict_output else logits

    def pipeline_layers(self) -> list[tuple[str, nn.Module]]:
        """The chain of layers a pipeline cuts into stages."""
        return [
            ("emb", self.emb),
            ("blocks.0", self.blocks[0]),
            ("blocks.1", self.blocks[1]),
            ("tail", Tail(self.norm, self.head)),
        ]

    def tensor_parallel_plan(self, degree: int) -> dict[str, str]:
        """Megatron's MLP split: up by columns, down by rows."""
        return {"blocks.*.up": "colwise", "blocks.*.down": "rowwise"}


def loss_fn(output: Any, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy over every position (logits, or a dict holding them)."""
    logits = output["logits"] if isinstance(output, dict) else output
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def dataset() -> torch.utils.data.TensorDataset:
    """A fixed stream of random token sequences and next tokens."""
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, VOCAB, (BATCH * STEPS, CONTEXT + 1), generator=g)
    return torch.utils.data.TensorDataset(tokens[:, :-1], tokens[:, 1:])


def _optimizer(model: nn.Module, habit: Habit) -> torch.optim.Optimizer:
    if habit.onecycle:
        return torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-3, weight_decay=0.1)
    if habit.groups:
        plain = [p for n, p in model.named_parameters() if p.dim() < 2 and "head" not in n]
        head = [model.head.weight]
        rest = [p for p in model.parameters() if all(p is not q for q in [*plain, *head])]
        return torch.optim.SGD(
            [
                {"params": rest, "weight_decay": 1e-2},
                {"params": plain, "weight_decay": 0.0},
                {"params": head, "lr": 0.05},
            ],
            lr=0.1,
            momentum=0.9,
        )
    trains = [p for p in model.parameters() if p.requires_grad or habit.frozen_in_optimizer]
    return torch.optim.SGD(trains, lr=0.1, momentum=0.9, weight_decay=1e-2)


def _build(habit: Habit, rank: int) -> nn.Module:
    if habit.rank_seed:
        torch.manual_seed(1337 + rank)
    model: nn.Module = HabitNet(habit)
    if habit.double:
        model = model.double()
    if habit.noncontiguous:
        up = model.blocks[0].up
        up.weight = nn.Parameter(up.weight.detach().t().contiguous().t())
    if habit.frozen or habit.frozen_in_optimizer:
        model.blocks[0].requires_grad_(False)
    if habit.hook:
        for p in model.blocks[1].parameters():
            p.register_hook(lambda g: g * 0.5)
    return model


def _options(strategy: str, habit: Habit, extra: dict[str, Any]) -> dict[str, Any]:
    options: dict[str, Any] = {"strategy": strategy, **extra}
    if strategy in ("pipeline", "tensor"):
        options["pp" if strategy == "pipeline" else "tp"] = 2
    if strategy == "hybrid":  # dp 2 x pp 2 at four processes
        options.update(pp=2, microbatches=2)
    if habit.sometimes_unused and strategy in ("ddp", "zero1"):
        options["find_unused_parameters"] = True
    data_parallel = strategy in ("ddp", "zero1", "zero2", "zero3", "ps")
    if habit.batchnorm and data_parallel:
        options["sync_batchnorm"] = True
    if habit.compiled:  # the model comes compiled: dtrain notices by itself
        options["compile_backend"] = "aot_eager"  # traced like inductor, not code-generated
    if not habit.rank_seed:
        options["seed"] = 0
    if habit.bf16:
        options["precision"] = "bf16-mixed"
    return options


def run_habit(
    strategy: str, name: str, close: bool = True, extra: dict[str, Any] | None = None
) -> Any:
    """Train `STEPS` steps of the habit `name` under `strategy` (`extra`: more options of
    dtrain.init); return the parameters on the main rank (None elsewhere), or
    ``"refused: <message>"`` when dtrain refused it."""
    habit = HABITS[name]
    try:
        engine = dtrain.init(**_options(strategy, habit, extra or {}))
    except ConfigError as e:
        return f"refused: {e}"
    try:
        return _train(engine, habit)
    except (ConfigError, SetupError) as e:
        return f"refused: {e}"
    finally:
        SIDE["on"] = False
        gc.collect()
        if close:
            engine.close()
        else:
            engine.strategy.close()


def _train(engine: dtrain.Engine, habit: Habit) -> Any:
    model = _build(habit, engine.rank)
    optimizer = _optimizer(model, habit)
    if habit.compiled:
        model = torch.compile(model)
    schedule = (
        torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=2e-2, total_steps=STEPS)
        if habit.onecycle
        else None
    )
    model, optimizer = engine.setup(model, optimizer)
    loader = engine.dataloader(dataset(), global_batch_size=BATCH, shuffle=False)
    for step, batch in enumerate(loader):
        SIDE["on"] = habit.sometimes_unused and step % 2 == 1
        if not habit.by_hand:
            engine.train_step(batch, loss_fn)
        else:
            inputs, targets = engine.to_device(batch)
            parts = 2 if habit.accumulate else 1
            for i, (x, y) in enumerate(zip(inputs.chunk(parts), targets.chunk(parts), strict=True)):
                last = i == parts - 1
                quiet = habit.accumulate == "no_sync" and not last
                with engine.no_sync() if quiet else contextlib.nullcontext():
                    engine.backward(loss_fn(model(x), y) / parts)
            if habit.clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            optimizer.step()
            optimizer.zero_grad()
        if schedule is not None:
            schedule.step()
        if habit.evaluate and step == 1:
            held_out = engine.dataloader(dataset(), batch_size=4, shuffle=False, drop_last=False)
            engine.evaluate(held_out, loss_fn)
    del model, optimizer
    return engine.state_dict()


def run_habits(
    strategy: str, names: list[str], extra: dict[str, Any] | None = None, close: bool = True
) -> dict[str, Any]:
    """`run_habit` for each of `names` in this process group, one after the other
    (`close=False` keeps the group after the last)."""
    last = len(names) - 1
    return {
        name: run_habit(strategy, name, close=close and i == last, extra=extra)
        for i, name in enumerate(names)
    }


def run_strategies(plan: dict[str, list[str]]) -> dict[str, dict[str, Any]]:
    """`run_habits` for each strategy of `plan` (strategy -> habit names), one after the
    other in this process group."""
    last = len(plan) - 1
    return {
        strategy: run_habits(strategy, names, close=i == last)
        for i, (strategy, names) in enumerate(plan.items())
    }


def run_ps_habits(names: list[str], workers: int, servers: int) -> Any:
    """One rank of a ps job running each habit of `names` in turn: a worker returns what
    `run_habits` returns, a server serves every run (as the launcher has it) and returns
    "server"."""
    options = {"nproc": workers, "servers": servers}
    config = Config(strategy="ps", **options)
    if lookup("ps").role_main(config, int(os.environ["RANK"])) is None:
        return run_habits("ps", names, options)
    init_process_group(serving.topology(config, server=True), config.timeout_s)
    for _ in names:
        serving.serve_job(config)
    dist.destroy_process_group()
    return "server"
