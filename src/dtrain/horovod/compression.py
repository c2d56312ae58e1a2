"""Gradient compression for all-reduce, as Horovod offers it: `Compression.none` sends
tensors as they are, `Compression.fp16` sends floating-point tensors as float16 (half the
bytes) and restores their dtype afterwards."""

from __future__ import annotations

from typing import Any

import torch


class Compressor:
    """Turns a tensor into what goes over the wire and back; subclass it for your own."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """(tensor to send, context `decompress` needs to restore it)."""
        raise NotImplementedError

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        """The received `tensor` restored with the `ctx` that `compress` returned."""
        raise NotImplementedError


class NoneCompressor(Compressor):
    """Sends tensors unchanged."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """`tensor` itself; no context."""
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        """`tensor` itself."""
        return tensor


class FP16Compressor(Compressor):
    """Sends floating-point tensors as float16; other dtypes unchanged."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """`tensor` in float16 if it is floating point; the context is its dtype."""
        dtype = tensor.dtype
        if dtype.is_floating_point and dtype != torch.float16:
            return tensor.to(torch.float16), dtype
        return tensor, dtype

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        """`tensor` back in the dtype it had before `compress`."""
        return tensor if tensor.dtype == ctx else tensor.to(ctx)


class Compression:
    """The compressors by name: ``Compression.none``, ``Compression.fp16``."""

    none = NoneCompressor
    fp16 = FP16Compressor
