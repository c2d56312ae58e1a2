"""Decisions about checkpoints taken once, on the main rank, and shared with the others.

Which checkpoint is the newest intact one, whether its files are intact, whether a step
is already saved: if every rank looked for itself, ranks could see different answers
(a file being written or deleted meanwhile) and part of them would skip a collective the
others enter. The main rank looks, and broadcasts what it found, or the error it met.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch.distributed as dist

from dtrain.errors import CheckpointError, DtrainError

T = TypeVar("T")


def decided_by_main(decide: Callable[[], T], group: dist.ProcessGroup | None, main: bool) -> T:
    """`decide()` as run on the main rank (global rank 0), on every rank of `group`.

    Collective over `group` (the main rank must be in it). If `decide` raises on the main
    rank, every rank raises: the main rank its own error, the others a CheckpointError
    (or the same DtrainError) with its message.
    """
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return decide()
    box: list[object] = [None]
    failure: BaseException | None = None
    if main:
        try:
            box[0] = ("ok", decide())
        except Exception as e:  # noqa: BLE001 - shared with the other ranks, then re-raised
            failure = e
            kept = (
                e
                if isinstance(e, DtrainError)
                else CheckpointError(
                    f"The main rank failed while reading checkpoints ({type(e).__name__}: {e}); "
                    "its log has the details."
                )
            )
            box[0] = ("error", kept)
    dist.broadcast_object_list(box, src=0, group=group)
    if failure is not None:
        raise failure
    kind, value = box[0]  # type: ignore[misc]
    if kind == "error":
        raise value  # type: ignore[misc]
    return value  # type: ignore[return-value]
