"""Tokens per second and model FLOPs utilisation (MFU) of a GPT.

Training a transformer costs about 6 FLOPs per parameter per token (2 in forward, 4 in
backward), plus attention's 12 x layers x width x context per token (Chowdhery et al.,
PaLM, appendix B). MFU is the FLOPs those tokens needed, per second, over the devices'
peak: a measure of the model's arithmetic, not of recomputation or padding.
"""

from __future__ import annotations

from typing import Protocol

import torch


class TransformerShape(Protocol):
    """What the FLOPs count needs of a transformer's configuration (the bundled GPT's
    `GPTConfig` is one)."""

    layers: int
    dim: int
    context: int


PEAK_TFLOPS: dict[str, dict[str, float]] = {
    # Dense peaks from the vendors' data sheets, TFLOP/s: fp32 (no tensor cores), tf32,
    # bf16 and fp16 tensor cores (fp16 runs at bf16's rate where both exist). H200 has
    # H100's compute. V100 and T4 have fp16 tensor cores only: fp32 matmuls run without
    # tensor cores whatever torch's tf32 setting says.
    "H100": {"fp32": 66.9, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4},
    "H200": {"fp32": 66.9, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4},
    "A100": {"fp32": 19.5, "tf32": 156.0, "bf16": 312.0, "fp16": 312.0},
    "L4": {"fp32": 30.3, "tf32": 60.0, "bf16": 121.0, "fp16": 121.0},
    "V100": {"fp32": 15.7, "tf32": 15.7, "fp16": 125.0},
    "T4": {"fp32": 8.1, "tf32": 8.1, "fp16": 65.0},
}
KINDS = {"bf16-mixed": "bf16", "fp16-mixed": "fp16"}
"""The tensor-core kind of each mixed --precision."""


def flops_per_token(config: TransformerShape, parameters: int) -> float:
    """Training FLOPs per token: 6 N + 12 L d T."""
    return 6.0 * parameters + 12.0 * config.layers * config.dim * config.context


def peak_flops(device: torch.device, precision: str) -> float | None:
    """The device's dense peak FLOP/s for `precision` (a --precision value); None on the
    CPU, on a GPU not in `PEAK_TFLOPS`, or for a precision the GPU lacks."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    peaks = next((v for k, v in PEAK_TFLOPS.items() if k in name), None)
    if peaks is None:
        return None
    kind = KINDS.get(precision)
    if kind is None:
        kind = "fp32" if torch.get_float32_matmul_precision() == "highest" else "tf32"
    peak = peaks.get(kind)
    return peak * 1e12 if peak is not None else None


def gpt_throughput(
    config: TransformerShape,
    parameters: int,
    samples_per_second: float,
    devices: int,
    device: torch.device,
    precision: str,
) -> dict[str, float | None]:
    """``tokens_per_second`` and ``model_flops_utilisation`` (None where the device's peak
    is not known) of a run at `samples_per_second` over `devices` devices."""
    tokens = samples_per_second * config.context
    peak = peak_flops(device, precision)
    mfu = tokens * flops_per_token(config, parameters) / (peak * devices) if peak else None
    return {"tokens_per_second": tokens, "model_flops_utilisation": mfu}
