"""Keras 3 models on many devices, on Keras's torch backend.

One process, the batch split over replicas (TensorFlow's removed multi_gpu_model)::

    from dtrain.keras import multi_gpu_model
    parallel = multi_gpu_model(model, gpus=2)     # every batch split over 2 replicas
    parallel.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    parallel.fit(x, y, batch_size=64, epochs=10)
    model.save("model.keras")                      # the original holds the weights

Many processes (``dtrain run --strategy ddp --nproc N script.py``)::

    engine = dtrain.init()
    parallel = distribute(model, engine)           # gradients averaged by DDP
    parallel.fit(*shard((x, y), engine), batch_size=64 // engine.dp_size)

Importing this package before Keras selects the torch backend unless KERAS_BACKEND names
another; the Keras extra installs it: ``pip install 'dtrain[keras]'``.

A product: it enters the core through the public API, the Engine, batches and the
data-parallel wrappers.
"""

from dtrain.keras.backend import require_torch_backend
from dtrain.keras.devices import replica_devices
from dtrain.keras.distributed import DistributedModel, distribute, shard
from dtrain.keras.parallel import ParallelModel, multi_gpu_model

__all__ = [
    "DistributedModel",
    "ParallelModel",
    "distribute",
    "multi_gpu_model",
    "replica_devices",
    "require_torch_backend",
    "shard",
]
