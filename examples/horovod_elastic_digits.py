"""An elastic Horovod script, as Horovod's users write one: the bundled digits MLP on the
8x8 handwritten digits, with `hvd.elastic.run`, a `TorchState` and an `ElasticSampler`.

    horovodrun -np 2 --min-np 1 --max-np 2 python examples/horovod_elastic_digits.py
    horovodrun -np 2 --min-np 1 --max-np 2 python examples/horovod_elastic_digits.py --crash-at 7
    python examples/horovod_elastic_digits.py                   # one process, as under Horovod

The state (model, optimizer, sampler, epoch) is committed every --batches-per-commit
batches. `--crash-at B` kills the last rank at batch B of the second epoch, on the first
attempt only: dtrain's launcher then restarts the workers, which resume from the last
commit and finish with the model an uninterrupted run reaches.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

import horovod.torch as hvd
from dtrain.datasets import load_digits
from dtrain.models.digits import DigitsMLP


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Elastic Horovod digits example")
    parser.add_argument("--batch-size", type=int, default=32, help="per-process batch size")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--lr", type=float, default=0.05, help="learning rate of one process")
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--batches-per-commit", type=int, default=4)
    parser.add_argument("--crash-at", type=int, help="kill the last rank at this batch of epoch 1")
    parser.add_argument("--save", help="rank 0 saves the final state_dict here")
    return parser.parse_args()


def crash_if_asked(args: argparse.Namespace, epoch: int, batch: int) -> None:
    """Simulate a machine failure: the last rank dies, on the first attempt only."""
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    last_rank = hvd.rank() == hvd.size() - 1 and hvd.size() > 1
    if first_attempt and last_rank and (epoch, batch) == (1, args.crash_at):
        print(f"rank {hvd.rank()}: crashing at epoch {epoch}, batch {batch}", file=sys.stderr)
        sys.stderr.flush()
        os._exit(17)


def main() -> None:
    args = parse_args()
    hvd.init()
    torch.manual_seed(args.seed)
    if torch.cuda.is_available():
        torch.cuda.set_device(hvd.local_rank())
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.set_num_threads(1)

    train_set, _ = load_digits()
    train_sampler = hvd.elastic.ElasticSampler(train_set, seed=args.seed)
    # drop_last: every pass ends on a full global batch, so a resumed epoch takes the
    # same batches as an uninterrupted one.
    train_loader = DataLoader(
        train_set, batch_size=args.batch_size, sampler=train_sampler, drop_last=True
    )

    model = DigitsMLP().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=args.momentum)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())

    def on_state_reset() -> None:
        # A restarted group may hold another number of processes: rescale the rate.
        for group in optimizer.param_groups:
            group["lr"] = args.lr * hvd.size()

    state = hvd.elastic.TorchState(
        model=model, optimizer=optimizer, train_sampler=train_sampler, epoch=0
    )
    state.register_reset_callbacks([on_state_reset])

    @hvd.elastic.run
    def train(state: hvd.elastic.TorchState) -> None:
        print(f"rank {hvd.rank()} of {hvd.size()}: training from epoch {state.epoch}", flush=True)
        while state.epoch < args.epochs:
            model.train()
            total = torch.zeros(())
            for batch, (images, labels) in enumerate(train_loader):
                if batch % args.batches_per_commit == 0:
                    state.commit()
                crash_if_asked(args, state.epoch, batch)
                loss = F.cross_entropy(model(images.to(device)), labels.to(device))
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                total += loss.detach().cpu()
                state.train_sampler.record_batch(batch, args.batch_size)
            mean = hvd.allreduce(total / max(1, len(train_loader)), name="train_loss")
            if hvd.rank() == 0:
                print(f"epoch {state.epoch}: train loss {mean.item():.4f}", flush=True)
            state.epoch += 1
            state.train_sampler.set_epoch(state.epoch)
            state.commit()

    train(state)
    if args.save and hvd.rank() == 0:
        torch.save(model.state_dict(), args.save)


if __name__ == "__main__":
    main()
