"""Hugging Face models train under dtrain with only the dtrain lines added: dict batches
(``model(**batch)``) and the loss the model returns, equal to one process after a few
steps under towers, ddp, zero3 and tensor parallel: a BERT classifier and GPT-2, whose
input embedding and output layer share one weight."""

from __future__ import annotations

import pytest
import torch
from distributed import run_ranks
from hf_training import train_hf, train_hf_variants
from torch.testing import assert_close

KINDS = ("bert", "gpt2")


@pytest.fixture(scope="module")
def references() -> dict[str, dict[str, torch.Tensor]]:
    return {kind: train_hf(kind, strategy="single") for kind in KINDS}


def test_the_output_layer_stays_tied(references: dict[str, dict[str, torch.Tensor]]) -> None:
    params = references["gpt2"]
    assert_close(params["lm_head.weight"], params["transformer.wte.weight"])


@pytest.mark.timeout(180)
def test_towers_train_hugging_face_models_as_single(
    references: dict[str, dict[str, torch.Tensor]],
) -> None:
    for kind in KINDS:
        params = train_hf(kind, strategy="towers", towers=2)
        assert_close(params, references[kind], msg=lambda m, k=kind: f"towers, {k}: {m}")


@pytest.mark.timeout(400)
def test_two_process_strategies_train_hugging_face_models_as_single(
    references: dict[str, dict[str, torch.Tensor]],
) -> None:
    variants = [{"kind": kind, "strategy": s} for kind in KINDS for s in ("ddp", "zero3")]
    variants.append({"kind": "bert", "strategy": "tensor"})
    results = run_ranks(train_hf_variants, 2, variants, timeout=380)[0]
    for variant, params in zip(variants, results, strict=True):
        label = f"{variant['strategy']}, {variant['kind']}"
        assert_close(params, references[variant["kind"]], msg=lambda m, x=label: f"{x}: {m}")
