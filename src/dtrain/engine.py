"""The Engine users hold: setup, dataloader, train_step, evaluate, save/load.

The training loop is written once against the Engine; the strategy behind it decides how
the model is wrapped and how gradients are synchronised. Loop mechanics that every
strategy shares (moving batches, micro-batching, loss checks, stepping, counting) live
here, so strategies only say what differs.
"""

from __future__ import annotations

import builtins
import contextlib
import gc
import math
import weakref
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset

from dtrain import checkpoint, rng
from dtrain.checkpoint.optimizer_state import load_by_name
from dtrain.config import Config
from dtrain.data import ShardedBatchSampler
from dtrain.errors import CheckpointError, NonFiniteLossError, SetupError
from dtrain.observe.logs import LOGGER, log_to_file
from dtrain.observe.progress import Throughput, track
from dtrain.strategies import Strategy
from dtrain.topology import Topology

Batch = tuple[torch.Tensor, torch.Tensor]
LossFn = Callable[[Any, torch.Tensor], torch.Tensor]


class Engine:
    """One process's handle on the job. Build it with :func:`dtrain.init`."""

    def __init__(self, config: Config, topology: Topology, strategy: Strategy) -> None:
        self.config = config
        self.topology = topology
        self.strategy = strategy
        self.model: nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.step = 0
        """Optimizer steps taken (restored by `load`)."""
        self.epoch = 0
        self.throughput = Throughput()
        self._samples_in_epoch = 0
        """Samples of the current epoch already trained (the data position)."""
        self._samples_per_step = 0
        self._resume_at: tuple[int, int] | None = None
        self._last_loss: float | None = None

    # -- who am I -------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        """Global rank of this process."""
        return self.topology.rank

    @property
    def world_size(self) -> int:
        """Processes in the job."""
        return self.topology.world_size

    @property
    def is_main(self) -> bool:
        """True on rank 0, which prints and writes checkpoints."""
        return self.topology.is_main

    @property
    def device(self) -> torch.device:
        """Where batches go before the model sees them."""
        return self.strategy.input_device

    @property
    def dp_size(self) -> int:
        """Data-parallel processes: the global batch is the per-worker batch times this."""
        return self.strategy.dp_size

    @property
    def module(self) -> nn.Module:
        """The user's unwrapped model (canonical parameter names)."""
        self._require_setup("engine.module")
        return self.strategy.unwrap()

    def print(self, *args: Any, **kwargs: Any) -> None:
        """`print` on the main rank only."""
        if self.is_main:
            builtins.print(*args, **kwargs, flush=True)

    def log_to(self, directory: str | Path) -> Path:
        """Write this rank's log to ``directory/rank{R}.log``; return its path."""
        return log_to_file(Path(directory), self.rank)

    # -- setup ----------------------------------------------------------------------------
    def setup(
        self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None
    ) -> tuple[nn.Module, torch.optim.Optimizer | None]:
        """Place and wrap `model` for the strategy; return (model to call, optimizer).

        Build `optimizer` from ``model.parameters()`` before calling this.
        """
        if self.model is not None:
            raise SetupError("engine.setup was called twice; call it once per Engine.")
        self.model, optimizer = self.strategy.setup(model, optimizer)
        self.optimizer = optimizer
        if optimizer is not None:
            optimizer.register_step_post_hook(self._count_step)
        LOGGER.info(
            "setup strategy=%s world_size=%d device=%s",
            self.strategy.name,
            self.world_size,
            self.device,
        )
        return self.model, optimizer

    def _count_step(self, *_: Any) -> None:
        self.step += 1
        self._samples_in_epoch += self._samples_per_step

    def _require_setup(self, what: str) -> None:
        if self.model is None:
            raise SetupError(
                f"{what} was used before engine.setup(model, optimizer); call setup first."
            )

    # -- data -----------------------------------------------------------------------------
    def dataloader(
        self,
        dataset: Dataset,
        batch_size: int,
        shuffle: bool = True,
        drop_last: bool = True,
        **loader_kwargs: Any,
    ) -> DataLoader:
        """A loader giving this worker its share of each global batch.

        Args:
            dataset: a map-style dataset of (input, target) samples.
            batch_size: samples per worker per step; the global batch is this times
                `engine.dp_size`.
            shuffle: one shuffle per epoch, shared by all workers.
            drop_last: drop the epoch's last incomplete global batch (keep True for
                training; use False for evaluation).
            loader_kwargs: passed to `torch.utils.data.DataLoader` (num_workers, ...).
        """
        sampler = ShardedBatchSampler(
            len(dataset),  # type: ignore[arg-type]
            batch_size,
            self.dp_size,
            self.strategy.dp_rank,
            shuffle=shuffle,
            seed=self.config.seed,
            drop_last=drop_last,
        )
        loader_kwargs.setdefault("pin_memory", self.device.type == "cuda")
        return DataLoader(dataset, batch_sampler=sampler, **loader_kwargs)

    def progress(
        self, loader: DataLoader, epoch: int = 0, desc: str | None = None
    ) -> Iterator[Any]:
        """Iterate `loader` for `epoch`, with a progress bar on the main rank.

        Selects the epoch's shuffle, and after `load` skips what the checkpoint had
        already trained (whole epochs, then the batches of the epoch it stopped in).
        """
        sampler = loader.batch_sampler
        skip = 0
        if self._resume_at is not None:
            resume_epoch, resume_samples = self._resume_at
            if epoch < resume_epoch:
                return
            if epoch == resume_epoch and isinstance(sampler, ShardedBatchSampler):
                skip = resume_samples // sampler.global_batch_size
            self._resume_at = None
        per_step = (loader.batch_size or 0) * self.dp_size
        if isinstance(sampler, ShardedBatchSampler):
            sampler.set_epoch(epoch, skip=skip)
            per_step = sampler.global_batch_size
        self.epoch = epoch
        batches = len(loader) - skip
        self._samples_in_epoch = skip * per_step
        self._samples_per_step = per_step
        yield from track(
            loader,
            total=batches,
            samples_per_item=per_step,
            throughput=self.throughput,
            loss=lambda: self._last_loss,
            desc=desc or f"epoch {epoch}",
            enabled=self.is_main,
        )

    # -- training -------------------------------------------------------------------------
    def to_device(self, batch: Any) -> Any:
        """Move a batch (tensors, or tuples/lists/dicts of them) to `engine.device`."""
        if isinstance(batch, torch.Tensor):
            return batch.to(self.device, non_blocking=True)
        if isinstance(batch, (tuple, list)):
            return type(batch)(self.to_device(b) for b in batch)
        if isinstance(batch, dict):
            return {k: self.to_device(v) for k, v in batch.items()}
        return batch

    def train_step(self, batch: Batch, loss_fn: LossFn) -> torch.Tensor:
        """Forward, backward, gradient sync and optimizer step on one batch.

        `loss_fn(model(inputs), targets)` must return the mean loss of its samples. With
        ``grad_accumulation=k`` the batch is cut into k micro-batches whose gradients are
        accumulated locally and synchronised once. Returns the batch's mean loss (detached).
        """
        self._require_setup("engine.train_step")
        if self.optimizer is None:
            raise SetupError("engine.train_step needs an optimizer; pass it to engine.setup.")
        inputs, targets = self.to_device(batch)
        k = self.config.grad_accumulation
        total = inputs.shape[0]
        if total < k:
            raise SetupError(
                f"A batch of {total} sample(s) cannot be cut into --grad-accumulation {k} "
                "micro-batches; use a larger batch or fewer micro-batches."
            )
        assert self.model is not None
        mean = 0.0
        parts = zip(torch.tensor_split(inputs, k), torch.tensor_split(targets, k), strict=True)
        for i, (x, y) in enumerate(parts):
            sync = contextlib.nullcontext() if i == k - 1 else self.strategy.no_sync()
            with sync:
                mean += self._backward(loss_fn(self.model(x), y) * (x.shape[0] / total))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self._last_loss = mean
        return torch.tensor(mean)

    def backward(self, loss: torch.Tensor) -> None:
        """Back-propagate `loss` and synchronise gradients as the strategy requires."""
        self._require_setup("engine.backward")
        self._backward(loss)

    def _backward(self, loss: torch.Tensor) -> float:
        value = loss.item()
        if not math.isfinite(value):
            raise NonFiniteLossError(self.step + 1, value)
        self._last_loss = value
        self.strategy.backward(loss)
        return value

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """Inside this block, backward accumulates gradients without synchronising."""
        self._require_setup("engine.no_sync")
        return self.strategy.no_sync()

    # -- evaluation -----------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self, loader: Iterable[Batch], loss_fn: LossFn | None = None) -> dict[str, float]:
        """Mean loss (and accuracy for classifiers) over `loader`, reduced over workers.

        The model is switched to eval mode (batch norm, dropout) and back. Accuracy is
        reported when the outputs are (N, C) logits and the targets (N,) class indices.
        """
        self._require_setup("engine.evaluate")
        model = self.strategy.eval_module()
        was_training = model.training
        model.eval()
        totals = torch.zeros(3, dtype=torch.float64, device=self.topology.device)
        classifier = True
        try:
            for batch in loader:
                inputs, targets = self.to_device(batch)
                outputs = model(inputs)
                n = targets.shape[0]
                if loss_fn is not None:
                    totals[0] += float(loss_fn(outputs, targets)) * n
                if (
                    classifier
                    and outputs.dim() == 2
                    and targets.dim() == 1
                    and not targets.is_floating_point()
                ):
                    totals[1] += (outputs.argmax(dim=1) == targets).sum().item()
                else:
                    classifier = False
                totals[2] += n
        finally:
            model.train(was_training)
        if self.strategy.multiprocess and dist.is_initialized():
            dist.all_reduce(totals, group=self.strategy.dp_group)
        loss_sum, correct, count = totals.tolist()
        result = {"samples": count}
        if count and loss_fn is not None:
            result["loss"] = loss_sum / count
        if count and classifier:
            result["accuracy"] = correct / count
        return result

    # -- checkpoints ----------------------------------------------------------------------
    def save(
        self, path: str | Path, epoch: int | None = None, extra: dict[str, Any] | None = None
    ) -> None:
        """Write a checkpoint directory at `path` (rank 0 writes, all ranks wait).

        Args:
            path: the checkpoint directory; replaced atomically if it exists.
            epoch: the epoch to record (default: the one `progress` is in).
            extra: more manifest fields (JSON values).
        """
        self._require_setup("engine.save")
        self.strategy.gather_state()
        if self.is_main:
            trainer = {
                "step": self.step,
                "epoch": self.epoch if epoch is None else epoch,
                "samples_in_epoch": self._samples_in_epoch,
                "rng": rng.get_state(),
            }
            info = {
                "step": self.step,
                "epoch": trainer["epoch"],
                "samples_in_epoch": self._samples_in_epoch,
                "strategy": self.strategy.name,
                "world_size": self.world_size,
                "optimizer": type(self.optimizer).__name__ if self.optimizer else None,
                **(extra or {}),
            }
            checkpoint.write(Path(path), self.strategy.unwrap(), self.optimizer, trainer, info)
            LOGGER.info("saved checkpoint %s at step %d", path, self.step)
        self.barrier()

    def load(self, path: str | Path, strict: bool = True) -> dict[str, Any]:
        """Load a checkpoint written under any strategy and world size; return its manifest.

        Restores the model, the optimizer (if given to setup), the step count, the data
        position (the next `progress` calls skip what was trained) and the RNG state.
        """
        self._require_setup("engine.load")
        path = Path(path)
        manifest = checkpoint.read_manifest(path)
        skipped = checkpoint.load_model(self.strategy.unwrap(), checkpoint.read_model(path), strict)
        if skipped:
            LOGGER.warning("loaded %s partially; skipped %s", path, ", ".join(skipped))
        if self.optimizer is not None:
            saved = checkpoint.read_pt(path, "optimizer.pt")
            if saved is None:
                raise CheckpointError(
                    f"{path} holds no optimizer state; set up the Engine without an optimizer "
                    "to load the model alone."
                )
            load_by_name(self.optimizer, self.strategy.unwrap(), saved)
        self.strategy.after_load()
        trainer = checkpoint.read_pt(path, "trainer.pt") or {}
        self.step = int(trainer.get("step", manifest["step"]))
        self.epoch = int(trainer.get("epoch", manifest["epoch"]))
        self._resume_at = (self.epoch, int(trainer.get("samples_in_epoch", 0)))
        if "rng" in trainer:
            rng.set_state(trainer["rng"])
        LOGGER.info("loaded checkpoint %s (step %d, epoch %d)", path, self.step, self.epoch)
        return manifest

    # -- collectives and teardown ---------------------------------------------------------
    def barrier(self) -> None:
        """Wait for every process (no-op in a one-process job)."""
        group = self.strategy.dp_group
        if dist.is_initialized() and dist.get_world_size(group) > 1:
            dist.barrier(group=group)

    def all_reduce_mean(self, value: float) -> float:
        """The mean of `value` over the data-parallel processes."""
        if not (self.strategy.multiprocess and dist.is_initialized()):
            return value
        t = torch.tensor([value], dtype=torch.float64, device=self.topology.device)
        dist.all_reduce(t, group=self.strategy.dp_group)
        return t.item() / dist.get_world_size(self.strategy.dp_group)

    def close(self) -> None:
        """Release the strategy's wrappers, then leave the process group.

        The group is destroyed only once no wrapped model (DDP) is still referenced:
        destroying it under a live DDP object can abort the process on gloo, while
        leaving it to interpreter exit is safe.
        """
        wrapped = weakref.ref(self.model) if self.model is not None else None
        self.model = None
        self.strategy.close()
        gc.collect()
        if dist.is_initialized() and (wrapped is None or wrapped() is None):
            dist.destroy_process_group()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
