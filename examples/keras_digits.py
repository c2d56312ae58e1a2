"""A Keras 3 classifier of the handwritten digits, trained with multi_gpu_model: every
batch is split over 2 replicas (2 GPUs, or 2 CPU replicas on a machine without GPUs),
the replicas' gradients are summed and applied once to the original model, which is then
saved, as with TensorFlow's multi_gpu_model.

    pip install 'dtrain[keras]'
    KERAS_BACKEND=torch python examples/keras_digits.py --gpus 2
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras  # noqa: E402

from dtrain.datasets import load_digits  # noqa: E402
from dtrain.keras import multi_gpu_model  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpus", type=int, default=2, help="replicas (GPUs, or CPU replicas)")
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--out", type=Path, default=Path("runs/keras_digits"))
    args = parser.parse_args()

    train, test = load_digits()  # torch datasets of (N, 1, 8, 8) images and labels
    x_train, y_train = (t.numpy() for t in train.tensors)
    x_test, y_test = (t.numpy() for t in test.tensors)
    x_train, x_test = x_train.reshape(len(x_train), 64), x_test.reshape(len(x_test), 64)

    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((64,)),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(10, activation="softmax"),
        ]
    )
    parallel = multi_gpu_model(model, gpus=args.gpus)
    parallel.compile(
        optimizer=keras.optimizers.Adam(3e-3),
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
    )
    parallel.fit(x_train, y_train, batch_size=64, epochs=args.epochs, verbose=2)
    _, accuracy = parallel.evaluate(x_test, y_test, verbose=0)
    print(f"test accuracy {accuracy:.3f} over {len(parallel.devices)} replicas")

    args.out.mkdir(parents=True, exist_ok=True)
    model.save(args.out / "digits.keras")  # the original holds the trained weights
    print(f"saved the model to {args.out / 'digits.keras'}")


if __name__ == "__main__":
    main()
