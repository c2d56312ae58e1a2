"""Tiny Hugging Face models built from configs in code (nothing downloaded): a BERT
classifier and GPT-2, with the token set they train on as dict batches (tests/third_party.py
trains them; tests/test_checkpoint_habits.py checkpoints them)."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from torch.utils.data import Dataset  # noqa: E402
from transformers import (  # noqa: E402
    BertConfig,
    BertForSequenceClassification,
    GPT2Config,
    GPT2LMHeadModel,
)
from transformers.utils import logging as hf_logging  # noqa: E402

VOCAB, LENGTH, SAMPLES = 64, 16, 96
BERT_TP_PLAN = {
    "bert.encoder.layer.*.intermediate.dense": "colwise",
    "bert.encoder.layer.*.output.dense": "rowwise",
}
"""The feed-forward layers of every BERT block, split over the tensor-parallel ranks."""

hf_logging.set_verbosity_error()


def prompt_masked(ids: torch.Tensor, i: int) -> torch.Tensor:
    """Sample `i`'s labels: its tokens, a prompt of 0 to 5 of them first left out of the
    loss (-100), so that the shares of a batch hold unequal counts of labels."""
    labels = ids.clone()
    labels[: i % 6] = -100
    return labels


class Tokens(Dataset):
    """Random token sequences with a class label (BERT) or as their own targets (GPT-2, a
    prompt left out of the loss)."""

    def __init__(self, kind: str) -> None:
        generator = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, VOCAB, (SAMPLES, LENGTH), generator=generator)
        self.classes = torch.randint(0, 3, (SAMPLES,), generator=generator)
        self.kind = kind

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = self.ids[i]
        if self.kind == "bert":
            return {
                "input_ids": ids,
                "attention_mask": torch.ones_like(ids),
                "labels": self.classes[i],
            }
        return {"input_ids": ids, "labels": prompt_masked(ids, i)}


def build(kind: str) -> torch.nn.Module:
    """A tiny BERT classifier or GPT-2 (tied embeddings), without dropout."""
    torch.manual_seed(0)
    if kind == "bert":
        config = BertConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=64,
            max_position_embeddings=LENGTH,
            num_labels=3,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
        )
        return BertForSequenceClassification(config)
    config = GPT2Config(
        vocab_size=VOCAB,
        n_positions=LENGTH,
        n_embd=32,
        n_layer=2,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        use_cache=False,
        bos_token_id=0,
        eos_token_id=0,
    )
    return GPT2LMHeadModel(config)
