"""A Hugging Face training loop under dtrain: a small BERT classifier, built from a config
in code (nothing downloaded), trained on dict batches with the loss the model computes.

    dtrain run --nproc 2 examples/hf_bert.py                 # ddp
    dtrain run --strategy zero3 --nproc 2 examples/hf_bert.py
    dtrain run --strategy ps --nproc 2 examples/hf_bert.py

The task is learnable: the label is the sequence's most frequent token class
(token id mod 3), so the accuracy printed at the end rises well above chance (1/3).
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from torch.utils.data import Dataset  # noqa: E402
from transformers import BertConfig, BertForSequenceClassification  # noqa: E402

import dtrain  # noqa: E402

VOCAB, LENGTH = 60, 16


class MajorityClass(Dataset):
    """Token sequences labelled with the most frequent class of their tokens."""

    def __init__(self, samples: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(1, VOCAB, (samples, LENGTH), generator=generator)
        counts = torch.stack([(self.ids % 3 == c).sum(1) for c in range(3)], dim=1)
        self.labels = counts.argmax(dim=1)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = self.ids[i]
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": self.labels[i]}


def main() -> None:
    engine = dtrain.init()
    config = BertConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=LENGTH,
        num_labels=3,
    )
    model = BertForSequenceClassification(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = engine.setup(model, optimizer)
    loader = engine.dataloader(MajorityClass(2048, seed=0), global_batch_size=64)
    test = engine.dataloader(
        MajorityClass(512, seed=1), batch_size=64, shuffle=False, drop_last=False
    )
    for epoch in range(3):
        for batch in engine.progress(loader, epoch=epoch):
            engine.train_step(batch)  # model(**batch); the loss is the model's own
    result = engine.evaluate(test)
    engine.print(f"test loss {result['loss']:.3f}, accuracy {result['accuracy']:.3f}")
    engine.report.results["test_accuracy"] = result["accuracy"]
    engine.close()


if __name__ == "__main__":
    main()
