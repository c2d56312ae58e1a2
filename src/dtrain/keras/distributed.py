"""`distribute` and `shard`: a Keras script data-parallel across the processes of
``dtrain run --strategy ddp --nproc N`` (one process per GPU, or N CPU processes; the
multi-machine case too, with ``--nnodes``).

Each process trains the whole model on its share of every global batch. The model's
forward runs through PyTorch DistributedDataParallel, whose hooks average the gradients
over the processes during backward (bucketed all-reduce); Keras's optimizer then applies
the same averaged gradient on every process, so the replicas stay equal. With `shard`'s
strided shares, step t of process r sees rows ``r, r + N, r + 2N, ...`` of global batch
t, so N processes at batch size B train exactly as one process at batch size N x B.
"""

from __future__ import annotations

from typing import Any

import torch

from dtrain.engine import Engine
from dtrain.errors import ConfigError
from dtrain.keras.backend import keras, require_torch_backend
from dtrain.keras.steps import track_loss
from dtrain.parallel.data_parallel import apply_ddp

STRATEGIES = ("ddp", "single")
"""The strategies a Keras model can run under (`single`: one process, nothing to do)."""


class DistributedModel(keras.Model):
    """Trains `original` with its forward run through `ddp` (DistributedDataParallel).

    Keras's torch trainer calls the model itself in `train_step`; this step calls it
    through DDP instead, so backward averages the gradients over the processes. The
    weights, the saved file and evaluation are the original's.
    """

    def __init__(self, original: Any, ddp: torch.nn.parallel.DistributedDataParallel) -> None:
        super().__init__(name=f"{original.name}_distributed")
        self.original = original
        # Past Keras's and torch's attribute hooks: tracked, DDP's copy of the module
        # tree would count every weight twice.
        object.__setattr__(self, "_ddp", ddp)
        self.built = True

    def call(self, inputs: Any, training: bool | None = None) -> Any:
        """The original model on `inputs` (evaluation, prediction and direct calls)."""
        return self.original(inputs, training=training)

    def train_step(self, data: Any) -> dict[str, Any]:
        """One optimizer step on this process's batch, gradients averaged by DDP."""
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        self.zero_grad()
        y_pred = self._ddp(x, training=True)
        loss = self.compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight)
        track_loss(self, loss, y_pred)
        self.optimizer.scale_loss(loss).backward()
        variables = self.trainable_weights
        with torch.no_grad():
            self.optimizer.apply([v.value.grad for v in variables], variables)
        return self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)

    def save(self, *args: Any, **kwargs: Any) -> None:
        """Refused: the original model holds the trained weights; save it instead."""
        raise ConfigError(
            f"Save the original model, which holds the trained weights: call save(path) on "
            f"the model you passed to distribute ({self.original.name}), on rank 0 only "
            "(if engine.is_main)."
        )


def distribute(model: Any, engine: Engine) -> Any:
    """`model` ready to train data-parallel over the processes of `engine`'s job.

    Under ``dtrain run --strategy ddp`` (or ``--nproc N``) it returns a model whose `fit`
    averages the gradients over the processes; in a one-process job (``python
    script.py``) it returns `model` itself, so the same script runs both ways. Compile
    and fit what it returns; give each process its share of the data with `shard`. Build
    `model` after ``dtrain.init()``: on GPUs that makes this process's GPU Keras's
    default device.

    Raises ConfigError for another Keras backend than torch, a strategy other than ddp
    or single, or a model on another device than this process's.
    """
    require_torch_backend()
    name = engine.strategy.name
    if name not in STRATEGIES:
        raise ConfigError(
            f"dtrain.keras.distribute runs Keras models under --strategy ddp, not "
            f"'{name}'; launch with dtrain run --strategy ddp --nproc N (for one machine's "
            "GPUs in one process, multi_gpu_model also works)."
        )
    if not isinstance(model, keras.Model) or not model.weights:
        raise ConfigError(
            "distribute takes a built keras.Model (one with weights); start it with "
            "keras.Input(shape=...) or call model.build(input_shape), then pass it."
        )
    device = model.weights[0].value.device
    if device.type != engine.device.type or (device.index or 0) != (engine.device.index or 0):
        raise ConfigError(
            f"The model's weights are on {device}, but this process computes on "
            f"{engine.device}; build the model after dtrain.init(), which makes this "
            "process's GPU the default one."
        )
    if not engine.strategy.spec.multiprocess:
        return model
    group = engine.strategy.placement.dp_group
    return DistributedModel(model, apply_ddp(model, group, engine.device))


def shard(data: Any, engine: Engine) -> Any:
    """This process's rows of `data` (arrays, or a tuple, list or dict of them with the
    same number of rows): rows ``rank, rank + N, rank + 2N, ...`` of the first
    ``N x (rows // N)``, N the data-parallel processes.

    Every process gets the same number of rows, so all take the same number of steps
    (an uneven last step would leave the others waiting in the all-reduce); the last
    ``rows % N`` rows are dropped. One process keeps every row.
    """
    size, rank = engine.dp_size, engine.strategy.placement.dp_rank

    def rows(array: Any) -> Any:
        usable = len(array) // size * size
        return array[rank:usable:size]

    return keras.tree.map_structure(rows, data)
