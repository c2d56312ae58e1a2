"""The replicas of a Keras model: the original and copies on other devices, kept equal to
the original's weights, each computing on its slice of a batch.

How the gradient comes out whole: the replicas' outputs are concatenated on the
original's device (the parameter device) and the loss is computed once over the whole
batch, as TensorFlow's ``multi_gpu_model`` did. Backward then sends every replica the
gradient of that full-batch loss with respect to its own slice; summed per variable over
the replicas, it is exactly the full-batch gradient, which the optimizer applies once to
the original's variables.
"""

from __future__ import annotations

from typing import Any

import torch

from dtrain.errors import ConfigError
from dtrain.keras.backend import keras
from dtrain.step.batches import split


def device_name(device: torch.device) -> str:
    """`device` as the string `keras.device` takes ("cpu", "cuda:1").

    The CPU is always "cpu": under "cpu:0" Keras 3.15 creates variables as copies of
    their parameters (tensors on "cpu" do not count as on "cpu:0"), whose gradients
    never reach the variable.
    """
    return "cpu" if device.type == "cpu" else str(device)


class Replicas:
    """`original` and one copy per further device of `devices`, on those devices.

    A replica on the original's own device is the original itself (its first one, as in
    ``nn.DataParallel`` and dtrain's towers), so on a machine whose GPUs hold the
    variables one replica needs no copy. The copies are plain attributes here, not
    tracked by any Keras model, so their variables never reach an optimizer or a file.
    """

    def __init__(self, original: Any, devices: list[torch.device]) -> None:
        self.original = original
        self.devices = devices
        self.param_device = original.weights[0].value.device
        self.models: list[Any] = []
        for device in devices:
            if device == self.param_device and not any(m is original for m in self.models):
                self.models.append(original)
            else:
                self.models.append(self._copy(device))
        # Per original weight, the same weight in every copy (not in the original itself).
        self._copies: dict[int, list[Any]] = {id(w): [] for w in original.weights}
        for model in self.models:
            if model is not original:
                for source, copy in zip(original.weights, model.weights, strict=True):
                    self._copies[id(source)].append(copy)
        self.shares = [1 / len(devices)] * len(devices)
        """Each replica's fraction of the last batch; replicas past its end have none."""

    def _copy(self, device: torch.device) -> Any:
        try:
            with keras.device(device_name(device)):
                copy = keras.models.clone_model(self.original)
        except Exception as error:
            raise ConfigError(
                f"multi_gpu_model copies the model with keras.models.clone_model, which "
                f"failed on {type(self.original).__name__}: {error}. Give a Model subclass "
                "a get_config() that returns its constructor arguments, or build the model "
                "with keras.Sequential or the functional API."
            ) from error
        shapes = [tuple(w.shape) for w in self.original.weights]
        if [tuple(w.shape) for w in copy.weights] != shapes:
            raise ConfigError(
                f"keras.models.clone_model gave a copy of {type(self.original).__name__} "
                "whose weights differ from the original's, so the replicas could not be "
                "kept equal to it. Give the model's layers their shapes when it is built "
                "(a keras.Input, or model.build(input_shape)) and build the model with "
                "keras.Sequential or the functional API."
            )
        return copy

    @torch.no_grad()
    def refresh(self) -> None:
        """Copy every weight of the original (trainable or not) into every copy."""
        for source in self.original.weights:
            value = source.value
            for copy in self._copies[id(source)]:
                copy.trainable = source.trainable
                copy.value.copy_(value, non_blocking=True)

    def forward(self, x: Any, training: bool) -> Any:
        """The outputs for batch `x`, computed by the replicas on its slices along dim 0
        and concatenated on the parameter device.

        A batch smaller than the number of replicas (the last batch of an epoch) uses one
        replica per sample, so every replica that runs has at least one.
        """
        x = keras.tree.map_structure(_as_tensor, x)
        samples = next(t for t in keras.tree.flatten(x) if t is not None).shape[0]
        parts = split(x, min(len(self.models), samples))
        sizes = [next(t for t in keras.tree.flatten(p) if t is not None).shape[0] for p in parts]
        self.shares = [size / samples for size in sizes]
        outputs = []
        for model, device, part in zip(self.models, self.devices, parts, strict=False):
            with keras.device(device_name(device)):
                outputs.append(model(part, training=training))
        return keras.tree.map_structure(self._concatenate, *outputs)

    def _concatenate(self, *parts: torch.Tensor) -> torch.Tensor:
        return torch.cat([part.to(self.param_device) for part in parts], dim=0)

    def losses(self) -> list[torch.Tensor]:
        """The replicas' own losses (regularizers, `add_loss`) of the last forward, each
        weighted by its replica's share of the batch.

        Keras normalises activity regularizers by the batch size, so the share-weighted
        sum equals the full batch's; a weight regularizer, the same on every replica,
        sums to its own value once, with its gradient spread over the replicas' copies.
        """
        return [
            loss * share
            for model, share in zip(self.models, self.shares, strict=False)
            for loss in model.losses
        ]

    @torch.no_grad()
    def gradients(self, variables: list[Any]) -> list[torch.Tensor | None]:
        """The gradient of each of the original's `variables`: the sum of every replica's
        gradient, on the parameter device (None where no replica has one). The copies'
        gradients are released, ready for the next step."""
        gradients = []
        for variable in variables:
            total = variable.value.grad
            for copy in self._copies[id(variable)]:
                grad = copy.value.grad
                if grad is None:
                    continue
                # Blocking: a non-blocking copy to the CPU may be read before it lands.
                grad = grad.to(self.param_device)
                total = grad if total is None else total + grad
                copy.value.grad = None
            gradients.append(total)
        return gradients

    @torch.no_grad()
    def keep_first_state(self) -> None:
        """Non-trainable state (BatchNorm's moving statistics) follows the first replica,
        as in ``nn.DataParallel``; copy it back when that replica is a copy."""
        first = self.models[0]
        if first is self.original:
            return
        for source, copy in zip(self.original.weights, first.weights, strict=True):
            if not source.trainable:
                source.value.copy_(copy.value)


def _as_tensor(value: Any) -> Any:
    """`value` as a tensor (`train_on_batch` passes NumPy arrays through); tensors stay
    where they are, to be copied straight to their replica's device, and None stays."""
    if value is None or isinstance(value, torch.Tensor):
        return value
    return keras.ops.convert_to_tensor(value)
