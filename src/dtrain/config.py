"""Typed options for the topology: which strategy, how many processes, which devices.

`dtrain run` and `dtrain demo` build a :class:`Config` from their flags (each field's
``help`` is its ``--help`` text) and hand it to every worker through one environment
variable (``DTRAIN_CONFIG``, JSON); `dtrain.init()` reads it back, and keyword arguments
given to `init` override it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field, fields

from dtrain.errors import ConfigError
from dtrain.names import (
    ACTIVATION_CHECKPOINTING,
    CHECKPOINT_FORMATS,
    DP_MODES,
    LOGGERS,
    OUTER_OPTIMIZERS,
    PRECISIONS,
    PS_MODES,
    SCHEDULES,
)

ENV_VAR = "DTRAIN_CONFIG"

MAX_TIMEOUT_S = 7 * 24 * 3600
"""The longest --timeout: a week of seconds, far below where torch's timers overflow."""

GRAD_COMPRESSIONS = ("none", "fp16", "bf16", "powersgd")
"""The kinds of --grad-compression (powersgd takes an optional :RANK)."""
COMPRESSES_CAST = ("ddp", "zero1", "hsdp")
"""The strategies whose gradient exchange fp16 and bf16 compress."""
COMPRESSES_POWERSGD = ("ddp", "zero1")
"""The strategies whose gradient exchange PowerSGD compresses: DDP's, through its hook."""
POWERSGD_NOT_FSDP = (
    " (hsdp's all-reduce across replicas runs inside FSDP2, which reduces in one dtype and "
    "takes no compression hook: fp16 or bf16 compress it)"
)

PORTS = range(1, 65536)
"""The TCP ports --master and --ssh-port may name."""


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
        "The optimizer steps A:B (from step A up to, not including, step B) the trace "
        "holds; bounds its size.",
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
        job), else single."""
        if self.strategy is None:
            many = self.nproc * self.nnodes > 1 or self.hosts or self.hostfile
            self.strategy = "ddp" if many else "single"
        if self.nproc < 1:
            raise ConfigError(f"--nproc must be at least 1, got {self.nproc}.")
        if self.towers is not None and self.towers < 1:
            raise ConfigError(f"--towers must be at least 1, got {self.towers}.")
        if self.grad_accumulation < 1:
            raise ConfigError(
                f"--grad-accumulation must be at least 1, got {self.grad_accumulation}."
            )
        if self.nnodes < 1:
            raise ConfigError(f"--nnodes must be at least 1, got {self.nnodes}.")
        if not 0 <= self.node_rank < self.nnodes:
            raise ConfigError(
                f"--node-rank must lie in [0, --nnodes), got node rank {self.node_rank} "
                f"of {self.nnodes} node(s)."
            )
        if self.nnodes > 1 and not self.master:
            raise ConfigError(
                "A multi-node run needs --master HOST:PORT (node 0's address and a free "
                "port), the same on every node."
            )
        if self.master is not None:
            host, _, port = self.master.rpartition(":")
            # port 0 stays allowed: -H's per-host configs leave the port to the launch
            if not host or not (port.isascii() and port.isdigit()) or int(port) > PORTS[-1]:
                raise ConfigError(
                    f"--master must be HOST:PORT with a port from 1 to 65535, got "
                    f"{self.master!r}; for example --master 10.0.0.1:29500."
                )
        if self.ssh_port not in PORTS:
            raise ConfigError(
                f"--ssh-port must be a port from 1 to 65535, got {self.ssh_port}; sshd listens "
                "on 22 unless its configuration says otherwise."
            )
        if self.hosts and self.hostfile:
            raise ConfigError(
                "Give the hosts either with -H or with --hostfile, not both; drop one of them."
            )
        if (self.hosts or self.hostfile) and (self.nnodes != 1 or self.master):
            raise ConfigError(
                "-H/--hostfile start every machine from this one and set --nnodes, "
                "--node-rank, --master and --nproc for each; drop those flags."
            )
        if self.iface is not None and (not self.iface or self.iface.split() != [self.iface]):
            raise ConfigError(
                f"--iface must name one network interface such as eth0, got {self.iface!r}."
            )
        if self.min_nnodes is not None and not 1 <= self.min_nnodes <= self.nnodes:
            raise ConfigError(
                f"--nnodes MIN:MAX needs 1 <= MIN <= MAX, got {self.min_nnodes}:{self.nnodes}."
            )
        if self.min_nnodes is not None and self.node_rank != 0:
            raise ConfigError(
                "--node-rank is not given in an elastic job (--nnodes MIN:MAX): the rendezvous "
                "numbers the machines as they join; drop --node-rank."
            )
        if self.max_restarts < 0:
            raise ConfigError(f"--max-restarts must be >= 0, got {self.max_restarts}.")
        if self.last_call_s < 1:
            raise ConfigError(
                f"--last-call must be a whole number of seconds, at least 1, got "
                f"{self.last_call_s}."
            )
        if self.precision not in PRECISIONS:
            raise ConfigError(
                f"Unknown --precision '{self.precision}'; choose one of {', '.join(PRECISIONS)}."
            )
        if self.activation_checkpointing not in ACTIVATION_CHECKPOINTING:
            raise ConfigError(
                f"Unknown --activation-checkpointing '{self.activation_checkpointing}'; choose "
                f"one of {', '.join(ACTIVATION_CHECKPOINTING)}."
            )
        self._validate_grad_compression()
        if not 0 < self.timeout_s <= MAX_TIMEOUT_S:  # false for nan too
            raise ConfigError(
                f"--timeout must be a number of seconds above 0 and at most {MAX_TIMEOUT_S} "
                f"(a week), got {self.timeout_s:g}; the default is 600."
            )
        if self.seed is not None and not 0 <= self.seed < 2**64:
            raise ConfigError(
                f"--seed must lie in [0, 2**64), the seeds torch accepts, got {self.seed}; "
                "pick a seed such as 0."
            )
        if self.log_every < 1:
            raise ConfigError(f"--log-every must be at least 1, got {self.log_every}.")
        if self.clip_grad_norm is not None and not self.clip_grad_norm > 0:
            raise ConfigError(
                f"--clip-grad-norm must be positive, got {self.clip_grad_norm}; use a bound such "
                "as 1.0, or drop the flag to train without clipping."
            )
        step_window(self.trace_steps)
        self._validate_output_names()
        unknown = sorted(set(self.logger or ()) - set(LOGGERS))
        if unknown:
            raise ConfigError(
                f"Unknown --logger {', '.join(unknown)}; choose from {', '.join(LOGGERS)} "
                "(comma-separated for both)."
            )
        if self.checkpoint_format not in CHECKPOINT_FORMATS:
            raise ConfigError(
                f"Unknown --checkpoint-format '{self.checkpoint_format}'; choose one of "
                f"{', '.join(CHECKPOINT_FORMATS)}."
            )
        if self.async_checkpoint and self.checkpoint_format != "sharded":
            raise ConfigError(
                "--async-checkpoint writes sharded checkpoints in the background; add "
                "--checkpoint-format sharded, or drop --async-checkpoint."
            )
        if self.towers is not None and self.strategy != "towers":
            raise ConfigError(
                f"--towers sets the replicas of --strategy towers, which --strategy "
                f"{self.strategy} does not use; drop --towers, or use --strategy towers."
            )
        if self.master is not None and self.nnodes == 1:
            raise ConfigError(
                "--master names node 0's rendezvous for a multi-node job, but --nnodes is 1 "
                "(one machine picks a free local port itself); drop --master, or give --nnodes."
            )
        if self.hierarchical and self.strategy != "ddp":
            raise ConfigError(
                f"--hierarchical arranges ddp's gradient all-reduce by machine, which "
                f"--strategy {self.strategy} does not run; use --strategy ddp (or hsdp, which "
                "shards inside a machine and replicates across), or drop --hierarchical."
            )
        if self.shard_size is not None and self.strategy != "hsdp":
            raise ConfigError(
                f"--shard-size sets the shard groups of --strategy hsdp, which --strategy "
                f"{self.strategy} does not use; use --strategy hsdp, or drop --shard-size."
            )
        self._validate_ps()
        self._validate_local_sgd()
        self._validate_model_parallel()

    def _validate_grad_compression(self) -> None:
        """A known --grad-compression, under a strategy whose gradient exchange it compresses."""
        kind, _ = grad_compression(self.grad_compression)
        if kind == "none":
            return
        flag = f"--grad-compression {self.grad_compression}"
        if self.strategy in ("single", "towers"):
            raise ConfigError(
                f"{flag} compresses the gradients processes send each other, and --strategy "
                f"{self.strategy} runs in one process, which sends none; drop the flag, or use "
                "--strategy ddp with --nproc 2 or more."
            )
        allowed = COMPRESSES_POWERSGD if kind == "powersgd" else COMPRESSES_CAST
        if self.strategy not in allowed:
            why = POWERSGD_NOT_FSDP if self.strategy == "hsdp" else ""
            raise ConfigError(
                f"{flag} compresses the gradient all-reduce of --strategy "
                f"{', '.join(allowed[:-1])} or {allowed[-1]}, not {self.strategy}{why}; use one "
                "of those strategies, or drop the flag."
            )
        if kind == "powersgd" and self.hierarchical:
            raise ConfigError(
                f"{flag} cannot run with --hierarchical: PowerSGD issues its all-reduces "
                "from callbacks, while the hierarchical hook must issue every bucket's reduce "
                "and broadcast inside a machine in bucket order on every rank. Use "
                "--grad-compression fp16 or bf16 with --hierarchical, or drop --hierarchical."
            )
        if kind == "powersgd" and self.precision == "fp16-mixed":
            raise ConfigError(
                f"{flag} keeps each step's approximation error to add to the next step, and "
                "under --precision fp16-mixed a step whose gradients overflow would carry its "
                "inf into every later one (and the loss scale changes the error's units); use "
                "--precision bf16-mixed or fp32 with PowerSGD, or --grad-compression fp16."
            )

    def _validate_output_names(self) -> None:
        """An empty path would quietly fall back to the default (--out) or to the current
        directory; refuse it by name."""
        for flag, value, example in (
            ("--out", self.out, "runs/exp1"),
            ("--metrics-json", self.metrics_json, "runs/exp1/metrics.json"),
            ("--trace", self.trace, "runs/exp1/trace.json"),
        ):
            if value is not None and not value.strip():
                raise ConfigError(
                    f"{flag} names no path (it is {value!r}); give one such as {example}, or "
                    f"drop {flag}."
                )

    def _validate_ps(self) -> None:
        if self.strategy != "ps":
            given = [
                flag
                for flag, value in (
                    ("--servers", self.servers != 1),
                    ("--ps-mode", self.ps_mode != "sync"),
                    ("--staleness", self.staleness is not None),
                    ("--backup-workers", self.backup_workers != 0),
                    ("--staleness-aware-lr", self.staleness_lr),
                )
                if value
            ]
            if given:
                raise ConfigError(
                    f"{', '.join(given)} configure parameter servers, which --strategy "
                    f"{self.strategy} does not use; use --strategy ps, or drop "
                    f"{', '.join(given)}."
                )
        if self.ps_mode not in PS_MODES:
            raise ConfigError(
                f"--ps-mode must be one of {', '.join(PS_MODES)}, got {self.ps_mode!r}."
            )
        if self.staleness is not None and self.ps_mode != "ssp":
            raise ConfigError(
                f"--staleness bounds how far workers drift apart in --ps-mode ssp, but the mode "
                f"is {self.ps_mode}; add --ps-mode ssp, or drop --staleness."
            )
        if self.staleness is not None and self.staleness < 0:
            raise ConfigError(f"--staleness must be >= 0, got {self.staleness}.")
        if self.backup_workers and self.ps_mode != "sync":
            raise ConfigError(
                "--backup-workers applies to --ps-mode sync (a round takes the first "
                "gradients); drop it, or use --ps-mode sync."
            )
        if not 0 <= self.backup_workers < self.nproc:
            raise ConfigError(
                f"--backup-workers must lie in [0, --nproc) so every round keeps at least one "
                f"gradient; got {self.backup_workers} with --nproc {self.nproc} workers. Lower "
                "--backup-workers or add workers."
            )
        if self.strategy == "ps" and self.servers < 1:
            raise ConfigError(
                f"--strategy ps needs at least one server, got --servers {self.servers}; use "
                "--servers 1 or more."
            )
        if self.staleness_lr and self.ps_mode == "sync":
            raise ConfigError(
                "--staleness-aware-lr scales the gradients of --ps-mode async or ssp; sync "
                "gradients are never stale. Drop the flag, or pick async or ssp."
            )

    def _validate_local_sgd(self) -> None:
        given = [
            flag
            for flag, value in (
                ("--sync-every", self.sync_every is not None),
                ("--outer-optimizer", self.outer_optimizer != "none"),
                ("--outer-lr", self.outer_lr is not None),
                ("--outer-momentum", self.outer_momentum is not None),
            )
            if value
        ]
        if given and self.strategy != "local-sgd":
            raise ConfigError(
                f"{', '.join(given)}: options of the syncs of --strategy local-sgd, which "
                f"--strategy {self.strategy} does not run; use --strategy local-sgd, or drop "
                f"{', '.join(given)}."
            )
        if self.sync_every is not None and self.sync_every < 1:
            raise ConfigError(
                f"--sync-every must be at least 1 (optimizer steps between two syncs), got "
                f"{self.sync_every}."
            )
        if self.outer_optimizer not in OUTER_OPTIMIZERS:
            raise ConfigError(
                f"Unknown --outer-optimizer '{self.outer_optimizer}'; choose one of "
                f"{', '.join(OUTER_OPTIMIZERS)}."
            )
        outer = [flag for flag in given if flag in ("--outer-lr", "--outer-momentum")]
        if outer and self.outer_optimizer == "none":
            raise ConfigError(
                f"{', '.join(outer)}: options of DiLoCo's outer optimizer, which plain "
                "averaging (--outer-optimizer none) does not have; add --outer-optimizer sgd "
                f"or nesterov, or drop {', '.join(outer)}."
            )
        if self.outer_lr is not None and not 0 < self.outer_lr < math.inf:  # false for nan
            raise ConfigError(
                f"--outer-lr must be a positive number, got {self.outer_lr}; DiLoCo uses 0.7 "
                "with nesterov, and 1.0 with sgd equals plain averaging."
            )
        if self.outer_momentum is not None and not 0 <= self.outer_momentum < 1:
            raise ConfigError(
                f"--outer-momentum must lie in [0, 1), got {self.outer_momentum}; DiLoCo uses "
                "0.9."
            )
        if self.outer_optimizer == "nesterov" and self.outer_momentum == 0:
            raise ConfigError(
                "--outer-optimizer nesterov needs a momentum above 0; drop --outer-momentum 0 "
                "(default 0.9), or use --outer-optimizer sgd."
            )

    def _validate_model_parallel(self) -> None:
        if self.strategy not in ("pipeline", "tensor", "hybrid"):
            options = (
                ("--pp", self.pp),
                ("--tp", self.tp),
                ("--dp", self.dp),
                ("--microbatches", self.microbatches),
                ("--virtual-stages", self.virtual_stages),
                ("--split-points", self.split_points),
                ("--schedule", None if self.schedule == "1f1b" else self.schedule),
                ("--dp-mode", None if self.dp_mode == "ddp" else self.dp_mode),
            )
            given = [flag for flag, value in options if value is not None]
            if given:
                raise ConfigError(
                    f"{', '.join(given)} shape model parallelism, which --strategy "
                    f"{self.strategy} does not do; use --strategy pipeline, tensor or hybrid, "
                    f"or drop {', '.join(given)}."
                )
        if self.schedule not in SCHEDULES:
            raise ConfigError(
                f"Unknown --schedule '{self.schedule}'; choose one of {', '.join(SCHEDULES)}."
            )
        if self.dp_mode not in DP_MODES:
            raise ConfigError(
                f"Unknown --dp-mode '{self.dp_mode}'; choose one of {', '.join(DP_MODES)}."
            )
        if self.microbatches is not None and self.microbatches < 1:
            raise ConfigError(f"--microbatches must be at least 1, got {self.microbatches}.")
        if self.virtual_stages is not None:
            if self.schedule != "interleaved":
                raise ConfigError(
                    "--virtual-stages places several stages on each pipeline rank, which only "
                    "--schedule interleaved runs; add it, or drop --virtual-stages."
                )
            if self.virtual_stages < 2:
                raise ConfigError(
                    f"--virtual-stages must be at least 2, got {self.virtual_stages}."
                )

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


def grad_compression(text: str) -> tuple[str, int]:
    """(kind, PowerSGD rank) of ``--grad-compression``: ``powersgd:4`` is ("powersgd", 4),
    ``powersgd`` rank 1, the others rank 0 (unused); a ConfigError listing the choices."""
    kind, colon, rank = text.partition(":")
    if kind not in GRAD_COMPRESSIONS or (colon and kind != "powersgd"):
        raise ConfigError(
            f"Unknown --grad-compression '{text}'; choose one of none, fp16, bf16, powersgd or "
            "powersgd:RANK (for example powersgd:4)."
        )
    if kind != "powersgd":
        return kind, 0
    if not colon:
        return kind, 1
    if not (rank.isascii() and rank.isdigit()) or int(rank) < 1:
        raise ConfigError(
            f"--grad-compression powersgd:RANK needs a whole RANK of at least 1, got '{rank}'; "
            "for example powersgd:4 (powersgd alone is rank 1)."
        )
    return kind, int(rank)


def step_window(text: str) -> tuple[int, int]:
    """(A, B) of ``--trace-steps A:B``: optimizer steps A to B-1; a ConfigError otherwise."""
    first, colon, last = text.partition(":")
    try:
        window = int(first), int(last)
    except ValueError:
        window = (-1, -1)
    if not colon or window[0] < 0 or window[1] <= window[0]:
        raise ConfigError(
            f"--trace-steps must be A:B with 0 <= A < B (steps A to B-1), got '{text}'; for "
            "example --trace-steps 10:30."
        )
    return window
