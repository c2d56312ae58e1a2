"""Which devices `multi_gpu_model` puts its replicas on, from its `gpus` argument.

The semantics of TensorFlow's removed ``keras.utils.multi_gpu_model``: ``gpus=None`` is
every visible GPU, an integer N >= 2 the first N GPUs, a list the GPUs with those ids;
one GPU is refused (the model itself does that job). On a machine without GPUs the
replicas run on the CPU, as dtrain's ``towers`` do: ``gpus=N`` gives N CPU replicas and
``gpus=None`` gives 2, so a script written for a GPU machine also runs, and is tested,
on a laptop.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dtrain.errors import ConfigError

CPU_REPLICAS = 2
"""Replicas that ``gpus=None`` means on a machine without GPUs (the towers' default)."""

Gpus = int | Sequence[int] | None
"""What ``multi_gpu_model(model, gpus=...)`` accepts."""


def replica_devices(gpus: Gpus, visible: int | None = None) -> list[torch.device]:
    """One device per replica for `gpus`, given `visible` GPUs (default: CUDA's count).

    Raises ConfigError naming the fix for one GPU, more GPUs than are visible, GPU ids
    that are not visible or repeat, and a value that is neither None, an int nor a list.
    """
    if visible is None:
        visible = torch.cuda.device_count()
    if gpus is None:
        if visible == 0:
            return [torch.device("cpu")] * CPU_REPLICAS
        return [torch.device("cuda", i) for i in range(visible)]
    if isinstance(gpus, bool) or not isinstance(gpus, (int, Sequence)) or isinstance(gpus, str):
        raise ConfigError(
            f"multi_gpu_model(gpus={gpus!r}) takes None (every visible GPU), a number of "
            "GPUs of at least 2, or a list of GPU ids such as [0, 1]; pass one of those."
        )
    if isinstance(gpus, int):
        return _count(gpus, visible)
    return _ids(list(gpus), visible)


def _count(gpus: int, visible: int) -> list[torch.device]:
    if gpus < 2:
        raise ConfigError(
            f"multi_gpu_model(gpus={gpus}) needs at least 2 replicas to split a batch over "
            "(TensorFlow's multi_gpu_model refused fewer too); to train on one device, use "
            "the model directly: model.compile(...) then model.fit(...)."
        )
    if visible == 0:
        return [torch.device("cpu")] * gpus
    if gpus > visible:
        raise ConfigError(
            f"multi_gpu_model(gpus={gpus}) asks for more GPUs than the {visible} visible; "
            f"pass gpus={visible} or fewer (or gpus=None for all of them), or check "
            "CUDA_VISIBLE_DEVICES."
        )
    return [torch.device("cuda", i) for i in range(gpus)]


def _ids(ids: list[int], visible: int) -> list[torch.device]:
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ConfigError(
            f"multi_gpu_model(gpus={ids!r}) takes a list of integer GPU ids such as [0, 1]; "
            "pass the ids of the GPUs to train on."
        )
    if len(ids) < 2:
        raise ConfigError(
            f"multi_gpu_model(gpus={ids!r}) names fewer than 2 GPUs, and a batch needs at "
            "least 2 replicas to be split over; name 2 or more GPUs, or use the model "
            "directly on one device: model.compile(...) then model.fit(...)."
        )
    if len(set(ids)) != len(ids):
        raise ConfigError(
            f"multi_gpu_model(gpus={ids!r}) names a GPU more than once; name each GPU once."
        )
    if visible == 0:
        raise ConfigError(
            f"multi_gpu_model(gpus={ids!r}) names GPUs, but no GPU is visible; pass "
            f"gpus={len(ids)} to run {len(ids)} replicas on the CPU, or run on a machine "
            "where torch.cuda.device_count() sees the GPUs."
        )
    unknown = [i for i in ids if not 0 <= i < visible]
    if unknown:
        raise ConfigError(
            f"multi_gpu_model(gpus={ids!r}) names GPU(s) {unknown}, but only ids 0 to "
            f"{visible - 1} are visible; name visible GPUs, or check CUDA_VISIBLE_DEVICES "
            "(it renumbers the GPUs it keeps from 0)."
        )
    return [torch.device("cuda", i) for i in ids]
