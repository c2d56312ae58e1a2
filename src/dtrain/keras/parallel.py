"""`multi_gpu_model`: a Keras model whose `fit`, `evaluate` and `predict` split every batch
over replicas of the original model, as TensorFlow's removed ``keras.utils.multi_gpu_model``
did, on Keras 3's torch backend.

Keras's torch trainer runs `train_step`, `test_step` and `predict_step` once per batch;
`ParallelModel` overrides those three and nothing else of the training loop, so
callbacks, metrics, validation, class and sample weights work as in a plain `fit`.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from dtrain.errors import ConfigError
from dtrain.keras.backend import keras, require_torch_backend
from dtrain.keras.devices import Gpus, replica_devices
from dtrain.keras.replicas import Replicas, device_name
from dtrain.keras.steps import track_loss


class ParallelModel(keras.Model):
    """Trains `original` data-parallel over replicas on `devices`.

    Each step copies the original's weights into the replicas, runs each replica on its
    slice of the batch, concatenates the outputs on the original's device, computes the
    loss over the whole batch, sums the replicas' gradients per variable and applies them
    once with this model's optimizer to the original's variables. `weights` and
    `trainable_weights` are the original's; calling the model directly (``parallel(x)``)
    runs the original on the whole batch.
    """

    def __init__(self, original: Any, devices: list[torch.device]) -> None:
        super().__init__(name=f"{original.name}_parallel")
        self.original = original
        # A plain object, so Keras tracks the original's variables only, not the copies'.
        self._replicas = Replicas(original, devices)
        self.built = True

    @property
    def devices(self) -> list[torch.device]:
        """The replicas' devices, one per replica."""
        return list(self._replicas.devices)

    @property
    def replicas(self) -> list[Any]:
        """The replica models, one per device; a replica on the original's device is the
        original itself."""
        return list(self._replicas.models)

    def call(self, inputs: Any, training: bool | None = None) -> Any:
        """The original model on `inputs` (Keras's build and direct calls; the steps split)."""
        return self.original(inputs, training=training)

    @property
    def losses(self) -> list[torch.Tensor]:
        """The replicas' own losses of the last step, weighted by their share of the batch,
        so `compute_loss` adds them as a plain `fit` on the whole batch would."""
        return self._replicas.losses()

    def train_step(self, data: Any) -> dict[str, Any]:
        """One optimizer step on the batch `data`, split over the replicas."""
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        self.zero_grad()
        self._replicas.refresh()
        y_pred = self._replicas.forward(x, training=True)
        with keras.device(device_name(self._replicas.param_device)):
            loss = self.compute_loss(
                x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True
            )
            track_loss(self, loss, y_pred)
        variables = self.trainable_weights
        if variables:
            self.optimizer.scale_loss(loss).backward()
            gradients = self._replicas.gradients(variables)
            with torch.no_grad():
                self.optimizer.apply(gradients, variables)
        else:
            warnings.warn(
                f"{self.original.name} has no trainable weights, so fit() changes nothing; "
                "set trainable=True on the layers to train.",
                stacklevel=2,
            )
        self._replicas.keep_first_state()
        with keras.device(device_name(self._replicas.param_device)):
            return self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)

    def test_step(self, data: Any) -> dict[str, Any]:
        """Loss and metrics of the batch `data`, computed by the replicas on its slices."""
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        self._replicas.refresh()
        y_pred = self._replicas.forward(x, training=False)
        with keras.device(device_name(self._replicas.param_device)):
            loss = self.compute_loss(
                x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=False
            )
            track_loss(self, loss, y_pred)
            return self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)

    def predict_step(self, data: Any) -> Any:
        """The outputs for the batch `data`, computed by the replicas on its slices."""
        x, _, _ = keras.utils.unpack_x_y_sample_weight(data)
        self._replicas.refresh()
        return self._replicas.forward(x, training=False)

    def save(self, *args: Any, **kwargs: Any) -> None:
        """Refused: the original model holds the trained weights; save it instead."""
        raise ConfigError(
            "Save the original model, which holds the trained weights: call save(path) on "
            f"the model you passed to multi_gpu_model ({self.original.name}), as with "
            "TensorFlow's multi_gpu_model."
        )


def multi_gpu_model(model: Any, gpus: Gpus = None) -> ParallelModel:
    """A model that trains `model` data-parallel over replicas, one per GPU of `gpus`.

    `gpus`: None for every visible GPU, an integer N >= 2 for the first N, or a list of
    GPU ids. On a machine without GPUs the replicas run on the CPU, one after another:
    N of them for ``gpus=N`` and 2 for ``gpus=None``.

    Compile, fit, evaluate and predict the returned model as the original. Every batch is
    split evenly over the replicas (``torch.tensor_split`` sizes); training equals a
    plain `fit` of `model` on the same batches (BatchNorm aside, which normalises each
    replica's slice by its own statistics). `model` keeps the trained weights: save it.

    Raises ConfigError for another Keras backend than torch, one GPU, more GPUs than are
    visible, a model that is not a built keras.Model, or one that cannot be copied.
    """
    require_torch_backend()
    if not isinstance(model, keras.Model):
        raise ConfigError(
            f"multi_gpu_model takes a keras.Model, not a {type(model).__name__}; pass the "
            "Keras model to train (a torch.nn.Module trains under dtrain's towers strategy: "
            "dtrain run --strategy towers)."
        )
    if not model.weights:
        raise ConfigError(
            f"The model {model.name} has no weights yet, so there is nothing to copy to the "
            "replicas; build it first: start it with keras.Input(shape=...), call "
            "model.build(input_shape), or call it once on a batch."
        )
    devices = replica_devices(gpus)
    if len(devices) == 1:
        warnings.warn(
            "multi_gpu_model(gpus=None) found one GPU, so every batch runs on it unsplit; "
            "make more GPUs visible (CUDA_VISIBLE_DEVICES) to split the batches.",
            stacklevel=2,
        )
    return ParallelModel(model, devices)
