"""Bad input gets a clear message that names the problem and the fix."""

from __future__ import annotations

import pytest
import torch

import dtrain
from dtrain.config import Config
from dtrain.errors import ConfigError, NonFiniteLossError, SetupError
from dtrain.launcher.addressing import check_port_free
from dtrain.launcher.runner import check_devices
from dtrain.models.digits import DigitsMLP


def test_backward_before_setup() -> None:
    engine = dtrain.init(strategy="single")
    with pytest.raises(SetupError, match="before engine.setup"):
        engine.backward(torch.zeros((), requires_grad=True))


def test_setup_twice() -> None:
    engine = dtrain.init(strategy="single")
    engine.setup(DigitsMLP(hidden=4))
    with pytest.raises(SetupError, match="twice"):
        engine.setup(DigitsMLP(hidden=4))


def test_more_processes_than_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ConfigError, match="--nproc 4 asks for more processes than the 2 visible"):
        check_devices(Config(strategy="ddp", nproc=4))
    check_devices(Config(strategy="ddp", nproc=4, cpu=True))


def test_unknown_option_and_bad_values() -> None:
    with pytest.raises(ConfigError, match="Unknown option"):
        dtrain.init(strategy="single", warp_speed=9)
    with pytest.raises(ConfigError, match="--nproc must be at least 1"):
        Config(nproc=0)
    with pytest.raises(ConfigError, match="needs --master"):
        Config(nnodes=2, node_rank=1)


def test_a_port_in_use_is_named() -> None:
    import socket

    with socket.socket() as s:
        s.bind(("", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(ConfigError, match=f"Port {port} is already in use"):
            check_port_free(port)


def test_non_finite_loss_stops_before_the_update() -> None:
    engine = dtrain.init(strategy="single", log_every=1)
    model = DigitsMLP(hidden=4)
    model, optimizer = engine.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    before = [p.clone() for p in model.parameters()]
    batch = (torch.randn(4, 1, 8, 8), torch.zeros(4, dtype=torch.long))
    with pytest.raises(NonFiniteLossError, match="at step 1"):
        engine.train_step(batch, lambda out, y: out.sum() * float("nan"))
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_a_batch_smaller_than_the_towers() -> None:
    engine = dtrain.init(strategy="towers", towers=3)
    model = DigitsMLP(hidden=4)
    model, optimizer = engine.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    batch = (torch.randn(2, 1, 8, 8), torch.zeros(2, dtype=torch.long))
    with pytest.raises(ConfigError, match="cannot be split over 3 towers"):
        engine.train_step(batch, torch.nn.functional.cross_entropy)


def test_sync_batchnorm_outside_data_parallel_processes() -> None:
    with pytest.raises(ConfigError, match="no effect under strategy 'towers'"):
        dtrain.init(strategy="towers", sync_batchnorm=True)


def test_cpu_offload_needs_zero3_and_gpus() -> None:
    with pytest.raises(ConfigError, match="--cpu-offload works with --strategy zero3 only"):
        dtrain.init(strategy="ddp", cpu_offload=True)
    engine = dtrain.init(strategy="zero3", cpu_offload=True, cpu=True)
    with pytest.raises(ConfigError, match="nothing to offload"):
        engine.setup(DigitsMLP(hidden=4))
    engine.close()


def test_a_model_without_parameters_cannot_be_sharded() -> None:
    engine = dtrain.init(strategy="zero3")
    with pytest.raises(ConfigError, match="has none to train"):
        engine.setup(torch.nn.ReLU())
    engine.close()


def test_unknown_precision() -> None:
    with pytest.raises(ConfigError, match="Unknown --precision 'fp8'"):
        dtrain.init(strategy="single", precision="fp8")


def test_an_old_torch_is_refused_with_the_fix() -> None:
    from dtrain.process.torch_version import check_torch

    check_torch("2.13.0+cpu")
    check_torch("3.0.0")
    with pytest.raises(ImportError, match=r"needs PyTorch 2\.13 or newer, but torch 2\.4\.1"):
        check_torch("2.4.1")


def test_an_old_torch_can_be_allowed_with_a_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    from dtrain.process.torch_version import check_torch

    monkeypatch.setenv("DTRAIN_ALLOW_OLD_TORCH", "1")
    with pytest.warns(UserWarning, match="Going on: DTRAIN_ALLOW_OLD_TORCH=1"):
        check_torch("2.11.0+cu130")
