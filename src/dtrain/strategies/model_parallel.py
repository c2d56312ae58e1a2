"""`pipeline`, `tensor` and `hybrid`: model parallelism presets over the mesh strategies.

- tensor (``--tp T``): the model's plan shards its layers over T ranks (DTensor
  `parallelize_module`); every rank sees the whole batch.
- pipeline (``--pp P``): the model's chain of layers is cut into P stages (or P x V with
  ``--schedule interleaved``) run by a `torch.distributed.pipelining` schedule over
  ``--microbatches M``.
- hybrid: both, with ``dp = nproc / (pp x tp)`` data-parallel ranks of the whole
  arrangement, replicated like ddp or sharded like zero2/zero3 (``--dp-mode``).

How they are applied is `dtrain.parallel.parallelize`; checkpoints hold the whole model
under canonical names, gathered from every stage.
"""

from __future__ import annotations

from dtrain.config import Config
from dtrain.errors import ConfigError
from dtrain.parallel.degrees import Degrees, degrees_for
from dtrain.parallel.parallelize import microbatches
from dtrain.parallel.pipeline import check_schedule
from dtrain.strategies.base import register
from dtrain.strategies.mesh import MeshStrategy


class ModelParallel(MeshStrategy):
    """Shared by pipeline, tensor and hybrid; they differ in which degrees they take."""

    @classmethod
    def dp_mode(cls, config: Config) -> str:
        return config.dp_mode

    @classmethod
    def offloads(cls, config: Config) -> bool:
        return config.dp_mode == "zero3"

    @classmethod
    def layout(cls, config: Config, world_size: int) -> Degrees:
        degrees = degrees_for(cls.name, world_size, config.dp, config.pp, config.tp, config.dp_mode)
        if degrees.dp == 1 and config.dp_mode != "ddp":
            raise ConfigError(
                f"--dp-mode {config.dp_mode} shards over data-parallel replicas, but this "
                f"layout has one ({degrees.describe()}); use --strategy hybrid with room "
                "for dp > 1 in --nproc, or drop --dp-mode."
            )
        if not degrees.pp_enabled:
            given = [
                flag
                for flag, value in (
                    ("--microbatches", config.microbatches),
                    ("--split-points", config.split_points),
                    ("--virtual-stages", config.virtual_stages),
                    ("--schedule", None if config.schedule == "1f1b" else config.schedule),
                )
                if value
            ]
            if given:
                fix = "--strategy hybrid with --pp" if cls.name == "tensor" else "--pp"
                raise ConfigError(
                    f"{', '.join(given)} shape a pipeline, but this layout has one stage "
                    f"({degrees.describe()}); add {fix}, or drop {', '.join(given)}."
                )
            return degrees
        if config.grad_accumulation > 1:
            raise ConfigError(
                "A pipeline already accumulates gradients over its micro-batches; instead of "
                f"--grad-accumulation {config.grad_accumulation}, raise --microbatches."
            )
        check_schedule(config.schedule, microbatches(config, degrees.pp), degrees.pp)
        return degrees


@register
class PipelineParallel(ModelParallel):
    """Layers cut into --pp stages, micro-batches pipelined through them."""

    name = "pipeline"
    order = 40
    supports_sync_batchnorm = False  # no data-parallel ranks to normalise over


@register
class TensorParallel(ModelParallel):
    """Each layer's weight matrices split over --tp ranks (Megatron-style)."""

    name = "tensor"
    order = 41
    supports_sync_batchnorm = False  # no data-parallel ranks to normalise over


@register
class Hybrid(ModelParallel):
    """Data x pipeline x tensor parallelism over one named DeviceMesh."""

    name = "hybrid"
    order = 42
