"""Typed options for the topology: which strategy, how many processes, which devices.

`dtrain run` and `dtrain demo` build a :class:`Config` from their flags (each field's
``help`` is its ``--help`` text) and hand it to every worker through one environment
variable (``DTRAIN_CONFIG``, JSON); `dtrain.init()` reads it back, and keyword arguments
given to `init` override it.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field, fields

from dtrain.config import rules
from dtrain.config.rules.launching import default_strategy
from dtrain.errors import ConfigError

ENV_VAR = "DTRAIN_CONFIG"


def option(default: object, help: str, flag: str | None = None) -> object:
    """A dataclass field that is also a command-line flag (``--name`` unless `flag`)."""
    return field(default=default, metadata={"help": help, "flag": flag})


@dataclass
class Config:
    """Topology and strategy options shared by `dtrain run`, `dtrain demo` and `dtrain.init`."""

    strategy: str = option(
        None,
        "Strategy: how the work is spread over devices (default: ddp with more than one "
        "process, else single).",
    )
    nproc: int = option(1, "Processes on this machine (one per device for ddp).")
    towers: int | None = option(
        None, "Replicas in one process for --strategy towers (default: every GPU, or 2 on CPU)."
    )
    devices: list[int] | None = option(
        None, "Comma-separated GPU indices to use (sets CUDA_VISIBLE_DEVICES)."
    )
    cpu: bool = option(False, "Run on the CPU with gloo even when GPUs are visible.")
    grad_accumulation: int = option(
        1, "Micro-batches per optimizer step; gradients are synchronised once per step."
    )
    sync_batchnorm: bool = option(
        False,
        "Normalise BatchNorm layers over the whole global batch (statistics all-reduced over "
        "the data-parallel workers, CPU and GPU): ddp, zero1, zero2, zero3, hsdp, hybrid.",
    )
    find_unused_parameters: bool = option(
        False,
        "ddp, zero1: let DDP find, every step, the parameters that took no part in the loss "
        "(a branch skipped always or sometimes); costs a walk of the graph per step.",
    )
    compile: bool = option(
        False,
        "torch.compile each repeated block after parallelising (a model passed in already "
        "compiled is unwrapped and compiled this way too).",
    )
    compile_backend: str = option(
        "inductor",
        "The torch.compile backend of --compile (and of a model passed in compiled): "
        "inductor, or another of torch._dynamo.list_backends() such as aot_eager.",
    )
    hierarchical: bool = option(
        False,
        "ddp: average gradients inside each machine, then across machines (one leader per "
        "machine), then back inside: fewer bytes on the links between machines.",
    )
    precision: str = option(
        "fp32",
        "fp32; bf16-mixed (bf16 compute, fp32 master weights and reductions); or fp16-mixed "
        "(the same in fp16, with dynamic loss scaling: for GPUs without bf16).",
    )
    grad_compression: str = option(
        "none",
        "Compress the gradients each step sends between data-parallel processes (ddp, "
        "--hierarchical, zero1, hsdp): none; fp16 or bf16 (all-reduced in that format, half "
        "the bytes; under hsdp every gradient reduction, inside machines too); or "
        "powersgd[:RANK] (ddp, zero1: low-rank PowerSGD with error feedback, rank 1 unless "
        "given, e.g. powersgd:4; the first two steps are sent whole).",
    )
    activation_checkpointing: str = option(
        "none",
        "none; full: recompute every repeated block's forward in backward instead of keeping "
        "its activations (less memory, about one more forward of compute); selective: every "
        "other block.",
    )
    cpu_offload: bool = option(
        False, "Keep sharded parameters, gradients and optimizer state in host memory (zero3)."
    )
    blocks: list[str] | None = option(
        None,
        "Comma-separated class names of the model's repeated blocks to shard or split "
        "(default: found automatically).",
    )
    memory_report: bool = option(
        False, "Measure per-rank bytes of parameters, gradients and optimizer state."
    )
    log_every: int = option(
        10,
        "Read the loss back from the device every N steps (progress bar, logs, the "
        "non-finite-loss check); the steps between never wait for the device.",
    )
    clip_grad_norm: float | None = option(
        None,
        "Clip the whole model's gradient to this global L2 norm before each optimizer step "
        "of engine.train_step (the same norm under every strategy); the logs show the norm "
        "before clipping.",
    )
    logger: list[str] | None = option(
        None,
        "Comma-separated metric logs written by rank 0 under --out every --log-every steps: "
        "csv, tensorboard.",
    )
    out: str | None = option(
        None,
        "Directory for logs and metrics (and the demo's checkpoints); default runs/demo for "
        "dtrain demo, runs/dtrain for dtrain run.",
    )
    metrics_json: str | None = option(
        None,
        "Write the run's results (strategy, world_size, steps, train_loss, samples_per_second, "
        "wall_seconds, breakdown, diagnosis, ...) to this JSON file when the script ends "
        "(rank 0).",
    )
    trace: str | None = option(
        None,
        "Write a Chrome/Perfetto trace of the job to this JSON file when the script ends: "
        "one process per rank, spans for data, forward, backward, communication and "
        "optimizer on one clock (open it in ui.perfetto.dev).",
    )
    trace_steps: str = option(
        "0:50",
        "The optimizer steps the trace holds, A:B as a slice of the run's steps: steps A+1 "
        "to B as the progress bar counts them (10:30: steps 11 to 30); bounds its size.",
    )
    checkpoint_format: str = option(
        "consolidated",
        "consolidated (one safetensors file of the whole model, written by rank 0) or "
        "sharded (every rank writes its own part with torch.distributed.checkpoint).",
    )
    async_checkpoint: bool = option(
        False, "Write sharded checkpoints in the background while training goes on."
    )
    seed: int | None = option(
        None,
        "Seed every RNG (Python, NumPy, torch on the CPU and on every GPU) with this on every "
        "rank, and the data shuffle with it. Without it, dtrain.init keeps the seed the "
        "script set when every rank set the same one (or there is one process), and "
        "otherwise seeds every rank with rank 0's; each shuffling loader then draws its "
        "seed from torch's generator when it is made, as DataLoader does (dtrain demo: 0).",
    )
    timeout_s: float = option(
        600.0, "Seconds a collective may wait before a hung rank is reported.", flag="--timeout"
    )
    nnodes: int = option(
        1,
        "Machines taking part; each runs the same command. MIN:MAX: elastic, the job starts "
        "once MIN have joined (and those that join within a short last call).",
    )
    node_rank: int = option(0, "This machine's index in [0, --nnodes).")
    master: str | None = option(
        None, "HOST:PORT of node 0's rendezvous (multi-node); default a free local port."
    )
    iface: str | None = option(
        None,
        "Network interface the workers use to reach the other machines (sets "
        "GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME); default: the one that routes to --master.",
    )
    min_nnodes: int | None = None
    """Elastic jobs (``--nnodes MIN:MAX``): the fewest machines the job runs with; `nnodes`
    is then the most. None: exactly `nnodes` (not a flag of its own)."""
    max_restarts: int = option(
        0, "Restart the whole group up to this many times after a worker fails."
    )
    last_call_s: int = option(
        3,
        "Elastic jobs (--nnodes MIN:MAX): once MIN machines have joined, seconds the "
        "rendezvous waits for more before the job starts (and again at every restart).",
        flag="--last-call",
    )
    servers: int = option(
        1, "Parameter-server processes of the whole job, the same number on each machine (ps)."
    )
    ps_mode: str = option(
        "sync", "Parameter-server updates: sync, async or ssp (bounded staleness) (ps)."
    )
    staleness: int | None = option(
        None, "ssp: how many steps a worker may run ahead of the slowest (default 2) (ps)."
    )
    backup_workers: int = option(
        0, "sync: each round takes the first --nproc minus B gradients, drops the rest (ps)."
    )
    staleness_lr: bool = option(
        False,
        "async/ssp: divide each gradient's learning rate by its staleness (Zhang et al. 2016).",
        flag="--staleness-aware-lr",
    )
    sync_every: int | None = option(
        None,
        "local-sgd: optimizer steps each replica takes alone between two syncs of the "
        "replicas (default 8; 1 syncs after every step).",
    )
    outer_optimizer: str = option(
        "none",
        "local-sgd: none (a sync averages the replicas' parameters), sgd or nesterov "
        "(DiLoCo: a sync averages the replicas' changes since the last sync, and this "
        "optimizer applies them to the model of the last sync).",
    )
    outer_lr: float | None = option(
        None, "local-sgd: the outer optimizer's learning rate (default: nesterov 0.7, sgd 1.0)."
    )
    outer_momentum: float | None = option(
        None, "local-sgd: the outer optimizer's momentum (default: nesterov 0.9, sgd 0)."
    )
    pp: int | None = option(
        None, "Pipeline stages (pipeline, hybrid; default: --nproc for pipeline, else 1)."
    )
    tp: int | None = option(
        None, "Tensor-parallel ranks per layer (tensor, hybrid; default: --nproc for tensor)."
    )
    dp: int | None = option(None, "Data-parallel replicas (hybrid; default: --nproc / (pp x tp)).")
    cp: int = option(
        1,
        "Context-parallel ranks (ddp, zero1-3, hsdp, tensor, hybrid): each sample's sequence "
        "is cut over them and attention sees the whole sequence; the data-parallel ranks "
        "are what is left of --nproc (--nproc / (cp x tp)).",
    )
    ep: int = option(
        1,
        "Expert-parallel ranks (ddp, zero2, zero3, hsdp): each mixture-of-experts layer's "
        "experts are split over groups of this many data-parallel ranks, tokens sent to "
        "them by all-to-all; must divide the data-parallel ranks and each layer's experts.",
    )
    shard_size: int | None = option(
        None,
        "hsdp: ranks that shard each replica's state (default: the processes of one "
        "machine, --nproc); the groups of them replicate across machines.",
    )
    dp_mode: str = option(
        "ddp", "How hybrid's data-parallel replicas synchronise: ddp, zero2 or zero3."
    )
    microbatches: int | None = option(
        None, "Micro-batches per pipeline step (default: max(4, stages)); 1 is the naive split."
    )
    schedule: str = option("1f1b", "Pipeline schedule: gpipe, 1f1b or interleaved.")
    virtual_stages: int | None = option(
        None, "Stages per pipeline rank for --schedule interleaved (default 2)."
    )
    split_points: list[str] | None = option(
        None,
        "Comma-separated layer names that begin a pipeline stage (default: balanced by "
        "parameter count).",
    )
    hosts: list[str] | None = option(
        None,
        "Start every machine from this one over ssh: comma-separated HOST:SLOTS (processes "
        "on that host); the first host serves the rendezvous.",
        flag="-H/--hosts",
    )
    hostfile: str | None = option(
        None, "Like -H, from a file of lines 'HOST slots=N' (DeepSpeed's and OpenMPI's form)."
    )
    ssh_port: int = option(22, "The port sshd listens on, on every host of -H/--hostfile.")
    ssh_identity: str | None = option(
        None, "The private key ssh logs in with on every host of -H/--hostfile."
    )
    extra: dict[str, str] = field(default_factory=dict)
    """Strategy-specific options added by later strategies (not a flag)."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check the values that do not depend on the machine; raise ConfigError if wrong.
        An unset strategy becomes ddp with more than one process (or any -H/--hostfile
        job), else single. The rules live in `dtrain.config.rules`, one module per concern."""
        if self.strategy is None:
            self.strategy = default_strategy(self)
        rules.check(self)

    def replace(self, **changes: object) -> Config:
        """Return a copy with `changes` applied, rejecting unknown option names."""
        known = {f.name for f in fields(self)}
        unknown = sorted(set(changes) - known)
        if unknown:
            raise ConfigError(
                f"Unknown option(s) {', '.join(unknown)}; known options: "
                f"{', '.join(sorted(known))}."
            )
        return dataclasses.replace(self, **changes)

    def to_json(self) -> str:
        """Serialise for the environment of worker processes."""
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Config:
        """Inverse of :meth:`to_json`."""
        return cls(**json.loads(text))

    @classmethod
    def from_env(cls) -> Config | None:
        """The configuration `dtrain run` passed to this process, or None outside it."""
        text = os.environ.get(ENV_VAR)
        return cls.from_json(text) if text else None
