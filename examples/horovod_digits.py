"""A Horovod-style PyTorch script, unchanged from what Horovod users write: the bundled
digits MLP trained on the 8x8 handwritten digits with `hvd.DistributedOptimizer`.

    horovodrun -np 2 -H localhost:2 python examples/horovod_digits.py
    horovodrun -np 2 python examples/horovod_digits.py --epochs 5 --fp16-allreduce
    python examples/horovod_digits.py                      # one process, as under Horovod

Each process reads its own share of every epoch (a DistributedSampler), the gradients are
averaged over the processes as backward produces them, and rank 0 prints the accuracy on
the held-out digits, averaged over every process's share of them.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

import horovod.torch as hvd
from dtrain.datasets import load_digits
from dtrain.models.digits import DigitsMLP


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Horovod digits example")
    parser.add_argument("--batch-size", type=int, default=32, help="per-process batch size")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--lr", type=float, default=0.05, help="learning rate of one process")
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--fp16-allreduce", action="store_true", help="send fp16 gradients")
    parser.add_argument(
        "--batches-per-allreduce", type=int, default=1, help="backward passes per all-reduce"
    )
    return parser.parse_args()


def metric_average(value: float, name: str) -> float:
    """The mean of `value` over every process."""
    return hvd.allreduce(torch.tensor(value), name=name).item()


def main() -> None:
    args = parse_args()
    hvd.init()
    torch.manual_seed(args.seed)
    if torch.cuda.is_available():
        torch.cuda.set_device(hvd.local_rank())
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.set_num_threads(1)

    train_set, test_set = load_digits()
    train_sampler = DistributedSampler(
        train_set, num_replicas=hvd.size(), rank=hvd.rank(), seed=args.seed
    )
    # With several batches per all-reduce, each loader batch is cut into that many parts.
    allreduce_batch = args.batch_size * args.batches_per_allreduce
    train_loader = DataLoader(train_set, batch_size=allreduce_batch, sampler=train_sampler)
    test_sampler = DistributedSampler(
        test_set, num_replicas=hvd.size(), rank=hvd.rank(), shuffle=False
    )
    test_loader = DataLoader(test_set, batch_size=256, sampler=test_sampler)

    model = DigitsMLP().to(device)
    # Horovod's rule: scale the learning rate by the number of processes, since the
    # global batch is that many times larger.
    lr_scaler = args.batches_per_allreduce * hvd.size()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * lr_scaler, momentum=args.momentum)

    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    optimizer = hvd.DistributedOptimizer(
        optimizer,
        named_parameters=model.named_parameters(),
        compression=compression,
        backward_passes_per_step=args.batches_per_allreduce,
    )

    for epoch in range(1, args.epochs + 1):
        model.train()
        train_sampler.set_epoch(epoch)
        for images, labels in train_loader:
            images, labels = images.to(device), labels.to(device)
            size = args.batch_size
            parts = list(zip(images.split(size), labels.split(size), strict=True))
            total = 0.0
            for part_images, part_labels in parts:
                loss = F.cross_entropy(model(part_images), part_labels) / len(parts)
                loss.backward()
                total += loss.item()
            optimizer.step()
            optimizer.zero_grad()
        loss_avg = metric_average(total, "train_loss")
        if hvd.rank() == 0:
            print(f"epoch {epoch}: train loss {loss_avg:.4f}", flush=True)

    model.eval()
    correct, seen = torch.zeros(()), torch.zeros(())
    with torch.no_grad():
        for images, labels in test_loader:
            predicted = model(images.to(device)).argmax(dim=1).cpu()
            correct += (predicted == labels).sum()
            seen += len(labels)
    correct = hvd.allreduce(correct, op=hvd.Sum, name="correct")
    seen = hvd.allreduce(seen, op=hvd.Sum, name="seen")
    if hvd.rank() == 0:
        print(f"test accuracy {correct.item() / seen.item():.4f} on {hvd.size()} process(es)")


if __name__ == "__main__":
    main()
