"""dtrain.keras: Keras 3 models on many devices, on the torch backend.

On a machine without GPUs multi_gpu_model's replicas run on the CPU, so every path here
runs in CI: training equals a plain `fit` on the same batches, a digits classifier
learns, evaluate and predict agree with the original model, `distribute` on 2 gloo
processes equals one process on the global batch, and bad input gets a message naming
the fix.
"""

from __future__ import annotations

import importlib
import os
import runpy
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

os.environ["KERAS_BACKEND"] = "torch"

import keras  # noqa: E402 - after the backend is chosen

import dtrain  # noqa: E402
from dtrain.datasets import load_digits  # noqa: E402
from dtrain.errors import ConfigError  # noqa: E402
from dtrain.keras import (  # noqa: E402
    ParallelModel,
    distribute,
    multi_gpu_model,
    replica_devices,
    shard,
)

# Keras 3.15 turns tensors into NumPy arrays the way NumPy 2 deprecates; not ours to fix.
pytestmark = pytest.mark.filterwarnings("ignore:__array__ implementation:DeprecationWarning")

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "keras_digits.py"


def dense_model(seed: int = 0) -> keras.Model:
    """A small classifier with a weight regularizer (its loss is added to the batch's)."""
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [
            keras.Input((5,)),
            keras.layers.Dense(16, activation="tanh", kernel_regularizer="l2"),
            keras.layers.Dense(3),
        ]
    )


def compile_dense(model: keras.Model) -> None:
    model.compile(
        optimizer=keras.optimizers.Adam(0.01),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )


def toy_data(samples: int = 70) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return rng.normal(size=(samples, 5)).astype("float32"), rng.integers(0, 3, samples)


def assert_same_weights(a: keras.Model, b: keras.Model) -> None:
    for mine, theirs in zip(a.weights, b.weights, strict=True):
        np.testing.assert_allclose(mine.numpy(), theirs.numpy(), atol=1e-4, rtol=0)


def digits() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """dtrain's digits as flat NumPy arrays: (train x, train y, test x, test y)."""
    train, test = load_digits()
    x_train, y_train = (t.numpy() for t in train.tensors)
    x_test, y_test = (t.numpy() for t in test.tensors)
    return x_train.reshape(len(x_train), -1), y_train, x_test.reshape(len(x_test), -1), y_test


# Replicas on the variables' own device (the first is the original itself, as on one GPU
# holding the variables), on 3 replicas with uneven slices, and all on another device
# than the variables (torch counts cpu:0 apart from cpu), as a CPU template model with
# its replicas on GPUs.
LAYOUTS = {
    "gpus=2": lambda model: multi_gpu_model(model, gpus=2),
    "gpus=3": lambda model: multi_gpu_model(model, gpus=3),
    "variables-apart": lambda model: ParallelModel(model, [torch.device("cpu", 0)] * 2),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_fit_equals_a_plain_fit_on_the_same_batches(layout: str) -> None:
    x, y = toy_data()  # 70 samples in batches of 16: the last batch has 6
    plain, template = dense_model(), dense_model()
    assert_same_weights(plain, template)
    compile_dense(plain)
    expected = plain.fit(x, y, batch_size=16, epochs=3, shuffle=False, verbose=0)

    parallel = LAYOUTS[layout](template)
    compile_dense(parallel)
    got = parallel.fit(x, y, batch_size=16, epochs=3, shuffle=False, verbose=0)

    assert_same_weights(template, plain)
    np.testing.assert_allclose(got.history["loss"], expected.history["loss"], atol=1e-4)
    assert got.history["accuracy"] == expected.history["accuracy"]


def test_dict_inputs_several_outputs_and_activity_regularizers_equal_a_plain_fit() -> None:
    def build() -> keras.Model:
        keras.utils.set_random_seed(1)
        a, b = keras.Input((5,), name="a"), keras.Input((2,), name="b")
        hidden = keras.layers.Dense(
            8, activation="tanh", activity_regularizer=keras.regularizers.L1(0.05)
        )(keras.layers.Concatenate()([a, b]))
        outputs = {
            "cls": keras.layers.Dense(3, name="cls")(hidden),
            "reg": keras.layers.Dense(1, name="reg")(hidden),
        }
        return keras.Model({"a": a, "b": b}, outputs)

    def compile_two_heads(model: keras.Model) -> None:
        model.compile(
            optimizer=keras.optimizers.SGD(0.1, momentum=0.9),
            loss={
                "cls": keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                "reg": "mse",
            },
        )

    rng = np.random.default_rng(1)
    x = {"a": rng.normal(size=(45, 5)).astype("float32"), "b": rng.normal(size=(45, 2))}
    y = {"cls": rng.integers(0, 3, 45), "reg": rng.normal(size=(45, 1)).astype("float32")}
    weights = rng.uniform(size=45).astype("float32")
    plain, template = build(), build()
    compile_two_heads(plain)
    plain.fit(x, y, sample_weight=weights, batch_size=15, epochs=2, shuffle=False, verbose=0)
    parallel = multi_gpu_model(template, gpus=2)
    compile_two_heads(parallel)
    parallel.fit(x, y, sample_weight=weights, batch_size=15, epochs=2, shuffle=False, verbose=0)
    assert_same_weights(template, plain)


def test_batches_smaller_than_the_replicas_and_numpy_train_on_batch() -> None:
    x, y = toy_data(7)
    plain, template = dense_model(), dense_model()
    compile_dense(plain)
    parallel = multi_gpu_model(template, gpus=3)
    compile_dense(parallel)
    for size in (7, 2, 1):  # 1 sample runs on 1 of the 3 replicas
        expected = plain.train_on_batch(x[:size], y[:size])
        got = parallel.train_on_batch(x[:size], y[:size])
        np.testing.assert_allclose(got, expected, atol=1e-4)
    assert_same_weights(template, plain)


def test_a_digits_classifier_learns_and_evaluate_predict_agree_with_the_original() -> None:
    x_train, y_train, x_test, y_test = digits()
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((64,)),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(10, activation="softmax"),
        ]
    )
    parallel = multi_gpu_model(model, gpus=2)
    parallel.compile(
        optimizer=keras.optimizers.Adam(3e-3),
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
    )
    parallel.fit(x_train, y_train, batch_size=64, epochs=20, verbose=0)

    loss, accuracy = parallel.evaluate(x_test, y_test, batch_size=61, verbose=0)
    assert accuracy >= 0.95
    model.compile(loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    original_loss, original_accuracy = model.evaluate(x_test, y_test, verbose=0)
    assert accuracy == pytest.approx(original_accuracy, abs=1e-6)
    assert loss == pytest.approx(original_loss, abs=1e-5)
    np.testing.assert_allclose(
        parallel.predict(x_test, batch_size=61, verbose=0),
        model.predict(x_test, verbose=0),
        atol=1e-5,
    )


def test_batchnorm_statistics_follow_the_first_replica() -> None:
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((5,)), keras.layers.BatchNormalization(), keras.layers.Dense(3)]
    )
    parallel = ParallelModel(model, [torch.device("cpu", 0)] * 2)
    compile_dense(parallel)
    x, y = toy_data()
    parallel.fit(x, y, batch_size=16, epochs=1, verbose=0)
    first = parallel.replicas[0]
    assert first is not model
    mean = model.layers[0].moving_mean.numpy()
    assert np.abs(mean).max() > 0
    np.testing.assert_array_equal(mean, first.layers[0].moving_mean.numpy())


def test_the_example_trains_and_saves_the_original_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(sys, "argv", [str(EXAMPLE), "--epochs", "2", "--out", str(tmp_path)])
    runpy.run_path(str(EXAMPLE), run_name="__main__")
    saved = keras.models.load_model(tmp_path / "digits.keras")
    assert [w.shape for w in saved.weights]
    assert "test accuracy" in capsys.readouterr().out


def _train_distributed(x: np.ndarray, y: np.ndarray) -> tuple[int, list[np.ndarray]]:
    """One rank of a ddp job: its shard of (x, y), per-process batches of 8."""
    engine = dtrain.init()
    template = dense_model(seed=engine.rank)  # unequal starts: DDP broadcasts rank 0's
    parallel = distribute(template, engine)
    compile_dense(parallel)
    x_mine, y_mine = shard((x, y), engine)
    parallel.fit(x_mine, y_mine, batch_size=8, epochs=2, shuffle=False, verbose=0)
    return len(x_mine), [w.numpy() for w in template.weights]


def test_distribute_under_ddp_equals_one_process_on_the_global_batch() -> None:
    x, y = toy_data(71)  # 2 shards of 35 rows; the 71st row is dropped
    results = dtrain.launch(_train_distributed, x, y, nproc=2, strategy="ddp", timeout=120)
    plain = dense_model(seed=0)
    compile_dense(plain)
    plain.fit(x[:70], y[:70], batch_size=16, epochs=2, shuffle=False, verbose=0)
    for rows, weights in results:
        assert rows == 35
        for got, expected in zip(weights, plain.weights, strict=True):
            np.testing.assert_allclose(got, expected.numpy(), atol=1e-4, rtol=0)


def test_distribute_in_one_process_is_the_model_itself_and_refuses_what_it_cannot_run() -> None:
    model = dense_model()
    x, y = toy_data()
    with dtrain.init() as engine:
        assert distribute(model, engine) is model
        np.testing.assert_array_equal(shard((x, y), engine)[0], x)
        with pytest.raises(ConfigError, match="built keras.Model"):
            distribute(keras.Sequential([keras.layers.Dense(3)]), engine)
    towers = dtrain.init(strategy="towers")
    with towers, pytest.raises(ConfigError, match="--strategy ddp"):
        distribute(model, towers)


# Bad input: each error names the problem and the fix.


@pytest.mark.parametrize(
    ("gpus", "visible", "says"),
    [
        (1, 0, "use the model directly"),
        (1, 4, "use the model directly"),
        ([2], 4, "use the model directly"),
        (0, 0, "at least 2"),
        (3, 2, "more GPUs than the 2 visible"),
        ([0, 5], 2, "only ids 0 to 1 are visible"),
        ([0, 0], 2, "more than once"),
        ([0, 1], 0, "pass gpus=2 to run 2 replicas on the CPU"),
        (True, 2, "a number of GPUs of at least 2"),
        ("2", 2, "a number of GPUs of at least 2"),
    ],
)
def test_bad_gpus_are_refused_with_the_fix(gpus: object, visible: int, says: str) -> None:
    with pytest.raises(ConfigError, match=says):
        replica_devices(gpus, visible=visible)  # type: ignore[arg-type]


def test_gpus_none_means_every_gpu_or_two_cpu_replicas() -> None:
    assert replica_devices(None, visible=0) == [torch.device("cpu")] * 2
    assert replica_devices(None, visible=3) == [torch.device("cuda", i) for i in range(3)]
    assert replica_devices(4, visible=0) == [torch.device("cpu")] * 4
    assert replica_devices([2, 0], visible=3) == [torch.device("cuda", 2), torch.device("cuda", 0)]
    if not torch.cuda.is_available():
        assert multi_gpu_model(dense_model()).devices == [torch.device("cpu")] * 2


def test_one_gpu_found_by_gpus_none_warns(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("dtrain.keras.parallel.replica_devices", lambda gpus: [torch.device("cpu")])
    with pytest.warns(UserWarning, match="make more GPUs visible"):
        parallel = multi_gpu_model(dense_model())
    assert parallel.replicas[0] is parallel.original


def test_another_keras_backend_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(keras.backend, "backend", lambda: "jax")
    with pytest.raises(ConfigError, match="Set KERAS_BACKEND=torch"):
        multi_gpu_model(dense_model(), gpus=2)


def test_a_backend_keras_cannot_load_names_the_torch_backend(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A stand-in for Keras with KERAS_BACKEND=jax and no JAX installed.
    (tmp_path / "keras.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'jax'\", name='jax')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("KERAS_BACKEND", "jax")
    monkeypatch.delitem(sys.modules, "keras")
    monkeypatch.delitem(sys.modules, "dtrain.keras.backend")
    with pytest.raises(ImportError, match="'jax' backend .* set KERAS_BACKEND=torch"):
        importlib.import_module("dtrain.keras.backend")


def test_missing_keras_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "keras", None)  # what `import keras` sees uninstalled
    monkeypatch.delitem(sys.modules, "dtrain.keras.backend")
    with pytest.raises(ImportError, match=r"pip install 'dtrain\[keras\]'"):
        importlib.import_module("dtrain.keras.backend")


def test_models_multi_gpu_model_cannot_take_are_refused() -> None:
    with pytest.raises(ConfigError, match="build it first"):
        multi_gpu_model(keras.Sequential([keras.layers.Dense(3)]), gpus=2)
    with pytest.raises(ConfigError, match="takes a keras.Model"):
        multi_gpu_model(torch.nn.Linear(2, 2), gpus=2)


def test_saving_the_parallel_model_points_to_the_original(tmp_path: Path) -> None:
    parallel = multi_gpu_model(dense_model(), gpus=2)
    with pytest.raises(ConfigError, match="Save the original model"):
        parallel.save(tmp_path / "parallel.keras")
