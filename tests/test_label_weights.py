"""A Hugging Face model's own loss is a mean over its labels that are not -100: shares of a
batch holding unequal counts of them weigh by those counts, as one device weighs them
(src/dtrain/step/batches.py). The strategies' equality with `single` on such
batches is held by the third-party matrix (tests/test_third_party.py, whose causal LM
batches mask prompts of 0 to 5 tokens); here, the counting and the weights themselves,
and the in-process paths: accumulation micro-batches and towers, in training and in
evaluation."""

from __future__ import annotations

import os
from typing import Any

import torch
from hf_training import build as build_classic
from third_party import GLOBAL_BATCH, CausalTokens, hf_lm
from torch.testing import assert_close
from training import CLOSE

import dtrain
from dtrain.models.digits import DigitsMLP
from dtrain.step.batches import LabelCounter, label_counter, share_weights, weigh

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def test_a_causal_lm_counts_its_labels_after_the_first_of_each_row() -> None:
    counter = label_counter(hf_lm("llama"))
    assert counter == LabelCounter(shifted=True)
    labels = torch.tensor([[5, -100, 7, 8], [-100, -100, 3, -100]])
    assert counter.count({"labels": labels}).item() == 3  # 7, 8 | 3
    shifted = torch.tensor([[1, 2, -100], [4, -100, -100]])
    assert counter.count({"labels": labels, "shift_labels": shifted}).item() == 3


def test_a_classifier_counts_every_label_and_other_models_count_samples() -> None:
    counter = label_counter(build_classic("bert"))
    assert counter == LabelCounter(shifted=False)
    assert counter.count({"labels": torch.tensor([2, -100, 0])}).item() == 2
    assert label_counter(DigitsMLP()) is None
    assert label_counter(torch.compile(hf_lm("qwen2"))) == LabelCounter(shifted=True)


def test_shares_weigh_by_samples_or_by_labels() -> None:
    counter = LabelCounter(shifted=False)
    pairs = [(torch.zeros(3, 2), torch.zeros(3)), (torch.zeros(1, 2), torch.zeros(1))]
    assert share_weights(pairs, torch.nn.functional.mse_loss, counter) == [0.75, 0.25]
    dicts = [{"labels": torch.tensor([1, -100, -100])}, {"labels": torch.tensor([4, 5, 6])}]
    assert_close(torch.stack(share_weights(dicts, None, counter)), torch.tensor([0.25, 0.75]))
    # A loss of the user's is a mean over samples, whatever the batch holds.
    assert share_weights(dicts, lambda out, batch: out, counter) == [0.5, 0.5]
    assert share_weights(dicts[:1], None, counter) == [1.0]  # one share: left as it is


def test_a_share_without_labels_adds_nothing() -> None:
    """Its mean over no labels is NaN; weighted 0 it must not turn the step's loss NaN."""
    counter = LabelCounter(shifted=False)
    dicts = [{"labels": torch.tensor([-100, -100])}, {"labels": torch.tensor([1, 2])}]
    weights = share_weights(dicts, None, counter)
    assert weigh(torch.tensor(float("nan")), weights[0]).item() == 0.0
    assert weigh(torch.tensor(2.0), weights[1]).item() == 2.0
    assert weigh(torch.tensor(float("nan")), 0.5).isnan()  # a NaN loss of a counted share stays


def run(kind: str, steps: int = 3, **options: Any) -> tuple[dict[str, torch.Tensor], float]:
    """`kind`'s parameters after `steps` AdamW steps on prompt-masked batches, and the
    evaluation loss over the token set after them."""
    engine = dtrain.init(seed=0, **options)
    model = hf_lm(kind)
    model, optimizer = engine.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    data = CausalTokens()
    for batch in engine.dataloader(data, global_batch_size=GLOBAL_BATCH):
        engine.train_step(batch)  # the model's own loss
        if engine.step == steps:
            break
    loss = engine.evaluate(engine.dataloader(data, batch_size=6, shuffle=False))["loss"]
    params = engine.state_dict()
    engine.close()
    return params, loss


def test_accumulation_and_towers_weigh_micro_batches_by_their_labels() -> None:
    """Micro-batches of 2 samples whose labels number 7 to 2: their means averaged alike
    would differ from `single` by 1e-2 and more after 3 steps."""
    params, loss = run("llama", strategy="single")
    for options in ({"grad_accumulation": 4}, {"strategy": "towers", "towers": 2}):
        got, got_loss = run("llama", **options)
        assert_close(got, params, **CLOSE, msg=lambda m, o=options: f"{o}: {m}")
        assert_close(got_loss, loss, **CLOSE)
