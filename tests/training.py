"""Small real jobs run identically under any strategy, so tests can compare parameters
after K steps with the single-process result: the digits with a tiny MLP and SGD with
momentum ("mlp"), and byte-level text with the tiny GPT and AdamW ("gpt")."""

from __future__ import annotations

import gc
from typing import Any

import torch
import torch.nn.functional as F

import dtrain
from dtrain.datasets import load_digits, load_text
from dtrain.models import build
from dtrain.models.digits import DigitsMLP
from dtrain.models.gpt import GPT, SIZES, lm_loss

GLOBAL_BATCH = 12  # divides over 1, 2, 3 workers, 2 or 3 towers, 2 micro-batches

CLOSE = {"rtol": 1e-4, "atol": 1e-4}
"""How close float32 parameters after a few steps must be to `single`'s. Summing the
gradients of 2 or 3 workers in another order moves a weight near zero by about 1e-5 after
10 SGD steps on some CPUs (1.08e-5 was seen); a strategy that trains anything else moves
the parameters by orders of magnitude more (a lost hook, a skipped layer: 1e-3 and up)."""

OPTIMIZERS: dict[str, Any] = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-2),
    "adam": lambda p: torch.optim.Adam(p, lr=3e-3),
    "adamw": lambda p: torch.optim.AdamW(p, lr=3e-3, weight_decay=0.1),
    # RMSprop divides by the root of its running mean square: with torch's eps 1e-8 a
    # weight whose gradient is near zero moves by ~lr whatever the gradient's last digits,
    # so a reduction in another order (tensor parallel) flips it. A larger eps keeps the
    # comparison about the strategy, not about rounding.
    "rmsprop": lambda p: torch.optim.RMSprop(p, lr=1e-3, momentum=0.5, eps=1e-4),
    "adagrad": lambda p: torch.optim.Adagrad(p, lr=1e-2, eps=1e-4),
    "adamax": lambda p: torch.optim.Adamax(p, lr=2e-3),
}
"""Optimizers every strategy must run as one process does (`train(optimizer_name=...)`)."""


def train(
    steps: int = 10,
    checkpoint_in: str | None = None,
    checkpoint_out: str | None = None,
    close: bool = True,
    model_name: str = "mlp",
    with_report: bool = False,
    manual: bool = False,
    optimizer_name: str | None = None,
    scheduler: bool = False,
    torch_clip: float | None = None,
    **options: Any,
) -> Any:
    """Train `steps` steps under `options` (given to dtrain.init); return the parameters
    (on the main rank; None on the others). `model_name`: "mlp" (a small digits MLP),
    "gpt" (the tiny GPT), "gpt:SIZE" (a GPT of another bundled size), or "bundled:NAME" (a
    bundled digits model at its shipped size).

    With `with_report`, return (parameters, the strategy's figures) instead. With `manual`,
    step by hand (``engine.backward(loss); optimizer.step(); optimizer.zero_grad()``).
    `optimizer_name` picks one of OPTIMIZERS instead of the model's default. With
    `scheduler`, a StepLR halving the learning rate every step is built on the optimizer
    before `engine.setup` (as most scripts do) and stepped after each step. With
    `torch_clip` (and `manual`), torch's own ``clip_grad_norm_`` clips before each step.

    With `checkpoint_in`, first load that checkpoint (any strategy may have written it);
    with `checkpoint_out`, save one at the end. `close=False` keeps the process group for
    another run in the same processes.
    """
    engine = dtrain.init(seed=0, **options)
    if model_name.startswith("gpt"):
        model: torch.nn.Module = GPT(SIZES[model_name.partition(":")[2] or "tiny"])
        optimizer: torch.optim.Optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        train_set, _ = load_text(context=model.config.context)
        loss_fn = lm_loss
    else:
        model = DigitsMLP(hidden=32) if model_name == "mlp" else build(model_name.split(":")[1])
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        train_set, _ = load_digits()
        loss_fn = F.cross_entropy
    if optimizer_name is not None:
        optimizer = OPTIMIZERS[optimizer_name](model.parameters())
    halving = torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.5) if scheduler else None
    model, optimizer = engine.setup(model, optimizer)
    if checkpoint_in:
        engine.load(checkpoint_in)
    loader = engine.dataloader(train_set, batch_size=GLOBAL_BATCH // engine.dp_size)
    epoch = engine.epoch
    target = engine.step + steps
    while engine.step < target:
        for batch in engine.progress(loader, epoch=epoch):
            if manual:
                inputs, targets = engine.to_device(batch)
                engine.backward(loss_fn(model(inputs), targets))
                if torch_clip is not None:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), torch_clip)
                optimizer.step()
                optimizer.zero_grad()
            else:
                engine.train_step(batch, loss_fn)
            if halving is not None:
                halving.step()
            if engine.step == target:
                break
        epoch += 1
    if checkpoint_out:
        engine.save(checkpoint_out)
    report = engine.strategy.figures() if with_report else None
    del model, optimizer
    params = finish(engine, close)
    return (params, report) if with_report else params


def finish(engine: dtrain.Engine, close: bool) -> dict[str, torch.Tensor] | None:
    """The trained parameters (main rank); then close the engine, or with `close=False`
    only its strategy, keeping the process group for another run. Drop the caller's
    references to the model and optimizer first (a live DDP object at teardown can abort
    the process)."""
    params = engine.state_dict()
    gc.collect()
    if close:
        engine.close()
    else:
        engine.strategy.close()
    return params


def train_variants(variants: list[dict[str, Any]]) -> list[dict[str, torch.Tensor]]:
    """Run several `train` configurations one after the other in this process group."""
    last = len(variants) - 1
    return [train(close=i == last, **variant) for i, variant in enumerate(variants)]
