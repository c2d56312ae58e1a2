"""The candidate layouts for N processes on K machines, and the flags that run each one.

Candidates: single; towers (one process, N replicas); ddp; zero1/2/3; ps with K servers;
pipeline over every stage count the world allows, under gpipe, 1f1b and interleaved
(where the layers and micro-batches allow) with a few micro-batch counts; tensor; hybrid
(every dp x pp x tp with at least two of them above 1); ddp and zero3 with the sequence
cut over every --cp the world allows; ddp and zero3 with each MoE layer's experts split
over every --ep the world allows; hierarchical ddp and hsdp across machines. A layout
is kept only if dtrain itself would run it: its flags make a valid Config, the strategy's
own launch checks pass, the global batch divides, and the model can be split that way
(pipeline_layers(), tensor_parallel_plan(degree), position_ids for --cp, experts modules
whose experts --ep divides). The reason for leaving each other one out is kept for the
report.

`inexact_layouts` adds the layouts that send fewer bytes by changing the training:
--grad-compression (a 16-bit cast under ddp, zero1, hierarchical ddp and hsdp; PowerSGD
under ddp and zero1) and local-sgd (plain averaging and DiLoCo). Each layout has a
`Layout.training` class: "exact" (the same model as `single`), "rounded" (a 16-bit cast:
the same training within the format's rounding of each gradient) or "approximate"
(PowerSGD, local SGD, DiLoCo: a different training, whose loss can differ). Exact and
rounded layouts compete on speed; approximate ones rank after every layout that keeps the
training, however fast (`dtrain.plan.estimate.rank`).
"""

from __future__ import annotations

from dataclasses import dataclass

from dtrain.config import Config, grad_compression, training_of
from dtrain.errors import ConfigError

MASTER_PLACEHOLDER = "NODE0:29500"
"""--master in the flags of multi-machine layouts: node 0's address and a free port go here."""
SCHEDULE_MICROBATCHES = (1, 2, 4)
"""Micro-batch counts tried, in multiples of the stage count."""
POWERSGD_RANKS = (1, 4)
"""PowerSGD ranks tried: the paper's cheapest, and one that approximates closer."""
SYNC_EVERY = (8, 32)
"""local-sgd's steps between syncs tried: its default, and DiLoCo's order of magnitude
(the paper syncs every 500 steps; a short run would then hardly sync)."""


@dataclass(frozen=True)
class Layout:
    """One way to run the job."""

    strategy: str
    nproc: int = 1
    nnodes: int = 1
    towers: int = 0
    servers: int = 0
    dp: int = 1
    pp: int = 1
    tp: int = 1
    cp: int = 1
    """Context-parallel ranks sharing each sample (ddp, zero3)."""
    ep: int = 1
    """Expert-parallel ranks splitting each MoE layer's experts (ddp, zero3)."""
    microbatches: int = 1
    schedule: str = ""
    virtual: int = 1
    hierarchical: bool = False
    shard_size: int = 0
    grad_compression: str = "none"
    sync_every: int = 0
    """local-sgd: optimizer steps between two syncs."""
    outer_optimizer: str = "none"
    """local-sgd: DiLoCo's outer optimizer, or none for plain averaging."""

    @property
    def training(self) -> str:
        """How faithfully the layout trains `single`'s model (`dtrain.config.training_of`):
        "exact", "rounded" or "approximate"."""
        return training_of(self.strategy, self.grad_compression)

    @property
    def exact(self) -> bool:
        """True if the layout trains the same model as `single` (up to float rounding)."""
        return self.training == "exact"

    @property
    def note(self) -> str:
        """How the layout changes the training, in one sentence ("" if it does not)."""
        check = "check the loss against an exact layout's."
        if self.strategy == "local-sgd":
            how = "averages" if self.outer_optimizer == "none" else "DiLoCo syncs"
            return (
                f"Changes the training: the replicas train alone for {self.sync_every} steps "
                f"and drift apart between syncs ({how} them); {check}"
            )
        kind, rank = grad_compression(self.grad_compression)
        if kind == "powersgd":
            return (
                f"Changes the training: PowerSGD approximates each gradient matrix by rank-{rank} "
                f"factors (with error feedback); {check}"
            )
        if kind != "none":
            where = "it crosses machines" if self.hierarchical else "it is averaged"
            return (
                f"Rounds each gradient to {kind} before {where}: the same training within "
                f"{kind}'s rounding."
            )
        return ""

    @property
    def world(self) -> int:
        """Training processes in all (parameter servers not counted)."""
        return self.nproc * self.nnodes

    @property
    def processes_per_node(self) -> int:
        """Processes on each machine, servers included (they share its cores)."""
        return self.nproc + self.servers

    @property
    def data_parallel(self) -> int:
        """Ranks that each read a different share of the global batch."""
        if self.strategy in ("single", "towers"):
            return 1
        if self.strategy in ("pipeline", "tensor", "hybrid"):
            return self.dp
        return self.world // self.cp

    def flags(self) -> str:
        """The TOPOLOGY flags of `dtrain run` / `dtrain demo` that run this layout."""
        out = [f"--strategy {self.strategy}"]
        if self.strategy == "towers":
            out.append(f"--towers {self.towers}")
        if self.strategy not in ("single", "towers"):
            out.append(f"--nproc {self.nproc}")
        if self.nnodes > 1:
            out.append(f"--nnodes {self.nnodes} --master {MASTER_PLACEHOLDER}")
        if self.hierarchical:
            out.append("--hierarchical")
        if self.shard_size:
            out.append(f"--shard-size {self.shard_size}")
        if self.grad_compression != "none":
            out.append(f"--grad-compression {self.grad_compression}")
        if self.sync_every:
            out.append(f"--sync-every {self.sync_every}")
        if self.outer_optimizer != "none":
            out.append(f"--outer-optimizer {self.outer_optimizer}")
        if self.servers:
            out.append(f"--servers {self.servers}")
        if self.cp > 1:
            out.append(f"--cp {self.cp}")
        if self.ep > 1:
            out.append(f"--ep {self.ep}")
        if self.strategy == "hybrid":
            out.append(f"--dp {self.dp} --pp {self.pp} --tp {self.tp}")
        elif self.strategy == "pipeline":
            out.append(f"--pp {self.pp}")
        elif self.strategy == "tensor":
            out.append(f"--tp {self.tp}")
        if self.pp > 1:
            out.append(f"--microbatches {self.microbatches} --schedule {self.schedule}")
            if self.schedule == "interleaved":
                out.append(f"--virtual-stages {self.virtual}")
        return " ".join(out)

    def config(self) -> Config:
        """The Config these flags give (a ConfigError if dtrain refuses them)."""
        options: dict[str, object] = {"strategy": self.strategy, "nproc": self.nproc}
        if self.strategy in ("single", "towers"):
            options["nproc"] = 1
        if self.strategy == "towers":
            options["towers"] = self.towers
        if self.nnodes > 1:
            options |= {"nnodes": self.nnodes, "master": MASTER_PLACEHOLDER}
        options |= {"hierarchical": self.hierarchical, "servers": self.servers or 1}
        if self.shard_size:
            options["shard_size"] = self.shard_size
        options["grad_compression"] = self.grad_compression
        if self.sync_every:
            options |= {"sync_every": self.sync_every, "outer_optimizer": self.outer_optimizer}
        if self.cp > 1:
            options["cp"] = self.cp
        if self.ep > 1:
            options["ep"] = self.ep
        if self.strategy == "hybrid":
            options |= {"dp": self.dp, "pp": self.pp, "tp": self.tp}
        elif self.strategy == "pipeline":
            options["pp"] = self.pp
        elif self.strategy == "tensor":
            options["tp"] = self.tp
        if self.pp > 1:
            options |= {"microbatches": self.microbatches, "schedule": self.schedule}
            if self.schedule == "interleaved":
                options["virtual_stages"] = self.virtual
        return Config(**options)  # type: ignore[arg-type]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _pipelines(strategy: str, nproc: int, nnodes: int, dp: int, pp: int, tp: int) -> list[Layout]:
    out = []
    base = {"strategy": strategy, "nproc": nproc, "nnodes": nnodes, "dp": dp, "pp": pp, "tp": tp}
    for factor in SCHEDULE_MICROBATCHES:
        m = factor * pp
        out.append(Layout(**base, microbatches=m, schedule="gpipe"))  # type: ignore[arg-type]
        out.append(Layout(**base, microbatches=m, schedule="1f1b"))  # type: ignore[arg-type]
        out.append(Layout(**base, microbatches=m, schedule="interleaved", virtual=2))  # type: ignore[arg-type]
    return out


def enumerate_layouts(nproc: int, nnodes: int, gpus: int) -> list[Layout]:
    """Every layout worth considering for `nproc` processes per machine on `nnodes`
    machines (`gpus`: GPUs visible here, 0 on the CPU), before any check."""
    world = nproc * nnodes
    out = [Layout("single")]
    if nnodes == 1 and nproc > 1 and (gpus == 0 or gpus >= nproc):
        out.append(Layout("towers", towers=nproc))
    if world == 1:
        return out
    for name in ("ddp", "zero1", "zero2", "zero3"):
        out.append(Layout(name, nproc=nproc, nnodes=nnodes))
    for cp in _divisors(world)[1:]:
        out += [Layout(name, nproc=nproc, nnodes=nnodes, cp=cp) for name in ("ddp", "zero3")]
    for ep in _divisors(world)[1:]:
        out += [Layout(name, nproc=nproc, nnodes=nnodes, ep=ep) for name in ("ddp", "zero3")]
    if nnodes > 1:
        out.append(Layout("ddp", nproc=nproc, nnodes=nnodes, hierarchical=True))
        if nproc > 1:
            out.append(Layout("hsdp", nproc=nproc, nnodes=nnodes, shard_size=nproc))
    else:
        for servers in sorted({1, max(1, nproc // 2), nproc}):
            out.append(Layout("ps", nproc=nproc, servers=servers))
    out += _pipelines("pipeline", nproc, nnodes, 1, world, 1)
    out.append(Layout("tensor", nproc=nproc, nnodes=nnodes, tp=world))
    for dp in _divisors(world):
        for pp in _divisors(world // dp):
            tp = world // (dp * pp)
            if sum(d > 1 for d in (dp, pp, tp)) < 2:
                continue
            if pp > 1:
                out += [
                    p for p in _pipelines("hybrid", nproc, nnodes, dp, pp, tp)
                    if p.schedule == "1f1b" and p.microbatches == max(4, pp)
                ]  # fmt: skip
            else:
                out.append(Layout("hybrid", nproc=nproc, nnodes=nnodes, dp=dp, tp=tp))
    return out


def inexact_layouts(nproc: int, nnodes: int, half: str) -> list[Layout]:
    """The layouts that send fewer bytes than ddp by changing the training, for `nproc`
    processes per machine on `nnodes` machines: the `half` cast (bf16, or fp16 on GPUs
    without bf16: the two cost the same, so only one is listed) under ddp, zero1 and,
    across machines, hierarchical ddp and hsdp; PowerSGD at `POWERSGD_RANKS` under ddp
    and zero1; local-sgd every `SYNC_EVERY` steps, averaging and DiLoCo (nesterov)."""
    if nproc * nnodes == 1:
        return []
    job = {"nproc": nproc, "nnodes": nnodes}
    out = [Layout(name, **job, grad_compression=half) for name in ("ddp", "zero1")]
    if nnodes > 1:
        out.append(Layout("ddp", **job, hierarchical=True, grad_compression=half))
        if nproc > 1:
            out.append(Layout("hsdp", **job, shard_size=nproc, grad_compression=half))
    for name in ("ddp", "zero1"):
        out += [Layout(name, **job, grad_compression=f"powersgd:{r}") for r in POWERSGD_RANKS]
    for outer in ("none", "nesterov"):
        out += [Layout("local-sgd", **job, sync_every=h, outer_optimizer=outer) for h in SYNC_EVERY]
    return out


def check(layout: Layout, global_batch: int, model: object) -> str | None:
    """Why dtrain would refuse `layout` for this batch and model, or None if it runs."""
    from dtrain.parallel.context_parallel import check_positions
    from dtrain.parallel.expert_parallel import check_experts
    from dtrain.parallel.split import layers_of, split_layers
    from dtrain.parallel.tensor_plan import plan_of
    from dtrain.step.batches import check_batch
    from dtrain.strategies.specs import lookup

    try:
        config = layout.config()
        spec = lookup(config.strategy)
        spec.check_launch(config)
        dp, splits = spec.batch_layout(config)
        check_batch(global_batch, dp, splits, 1)
        if layout.pp > 1:
            split_layers(layers_of(model), layout.pp * layout.virtual, None)  # type: ignore[arg-type]
        if layout.tp > 1:
            plan_of(model, layout.tp)  # type: ignore[arg-type]
        if layout.cp > 1:
            check_positions(model, layout.cp)  # type: ignore[arg-type]
        if layout.ep > 1:
            check_experts(model, layout.ep)  # type: ignore[arg-type]
    except ConfigError as e:
        return str(e)
    return None
