"""What any user's code meets at the edges: batches whose parts disagree, a model that
returns no loss, an optimizer that cannot be split, and L-BFGS in
a hand-written loop, which equals plain PyTorch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.testing import assert_close

import dtrain
from dtrain.errors import ConfigError, SetupError
from dtrain.step.batches import batch_size, forward_loss, split, to_device
from dtrain.step.optimizers import check_split


def test_a_nested_batch_is_cut_along_its_first_dimension() -> None:
    batch = {"x": torch.arange(6).reshape(6, 1), "pair": (torch.zeros(6), [torch.ones(6, 2)])}
    batch["scale"] = torch.tensor(2.0)  # 0-d: goes whole to every part
    parts = split(batch, 4)
    assert [batch_size(p) for p in parts] == [2, 2, 1, 1]
    assert all(p["scale"] is batch["scale"] for p in parts)
    assert torch.cat([p["x"] for p in parts]).flatten().tolist() == list(range(6))
    moved = to_device(batch, torch.device("cpu"))
    assert moved["pair"][1][0].shape == (6, 2)


def test_parts_that_disagree_are_named() -> None:
    with pytest.raises(SetupError, match=r"\['input_ids'\] has 4, \['labels'\] has 3"):
        batch_size({"input_ids": torch.zeros(4, 8), "labels": torch.zeros(3)})
    with pytest.raises(SetupError, match="holds no tensor"):
        batch_size({"name": "x"})


def test_the_loss_comes_from_loss_fn_or_from_the_model() -> None:
    model = nn.Linear(3, 2)
    x, y = torch.randn(4, 3), torch.tensor([0, 1, 1, 0])
    _, loss = forward_loss(model, (x, y), F.cross_entropy)
    assert_close(loss, F.cross_entropy(model(x), y))
    with pytest.raises(SetupError, match="needs a loss_fn"):
        forward_loss(model, (x, y), None)
    with pytest.raises(SetupError, match="has no 'loss' tensor"):
        forward_loss(lambda **kw: {"logits": kw["x"]}, {"x": x}, None)  # type: ignore[arg-type]


def test_an_optimizer_that_needs_a_closure_is_refused_where_the_model_is_split() -> None:
    lbfgs = torch.optim.LBFGS(nn.Linear(2, 2).parameters())
    for strategy in ("zero1", "zero3", "pipeline", "tensor", "ps"):
        with pytest.raises(ConfigError, match="LBFGS keeps its state over the whole model"):
            check_split(lbfgs, strategy, splits=True)
    check_split(lbfgs, "ddp", splits=False)
    check_split(torch.optim.Adagrad(nn.Linear(2, 2).parameters()), "zero3", splits=True)


def test_lbfgs_in_a_hand_written_loop_equals_plain_pytorch() -> None:
    data = torch.randn(16, 3), torch.randn(16, 1)

    def run(engine: dtrain.Engine | None) -> dict[str, torch.Tensor]:
        torch.manual_seed(0)
        model = nn.Linear(3, 1)
        optimizer = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=4)
        if engine is not None:
            model, optimizer = engine.setup(model, optimizer)
            with pytest.raises(SetupError, match="LBFGS.step needs a closure"):
                engine.train_step(data, F.mse_loss)

        def closure() -> torch.Tensor:
            optimizer.zero_grad()
            loss = F.mse_loss(model(data[0]), data[1])
            engine.backward(loss) if engine is not None else loss.backward()
            return loss

        for _ in range(3):
            optimizer.step(closure)
        return {k: v.detach().clone() for k, v in model.state_dict().items()}

    with dtrain.init(strategy="single") as engine:
        assert_close(run(engine), run(None))


def test_a_plan_that_splits_a_layer_torch_cannot_split_is_refused() -> None:
    from dtrain.parallel.tensor_plan import plan_of

    model = nn.Sequential(nn.Conv1d(2, 4, 1), nn.Linear(4, 4))
    model.tensor_parallel_plan = lambda degree: {"0": "colwise"}  # type: ignore[method-assign]
    with pytest.raises(ConfigError, match="0, a Conv1d, but the colwise and rowwise styles"):
        plan_of(model, 2)
