"""A plain PyTorch loop on the handwritten digits that ship with scikit-learn, run under
any strategy: the lines marked `# dtrain` are what dtrain adds to the loop or changes."""

import argparse

import torch
import torch.nn.functional as F
from torch import nn

import dtrain
from dtrain.datasets import load_digits

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=10)
args = parser.parse_args()
dataset, test_set = load_digits()  # images (N, 1, 8, 8) in [0, 1], labels 0-9
torch.manual_seed(0)  # the same model and data order in every run, under every strategy

engine = dtrain.init()  # dtrain: the topology `dtrain run` chose (one device under python)
model = nn.Sequential(nn.Flatten(), nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
model, optimizer = engine.setup(model, optimizer)  # dtrain
loader = engine.dataloader(dataset, global_batch_size=64)  # dtrain: each worker its share
test_loader = engine.dataloader(test_set, batch_size=256, shuffle=False, drop_last=False)  # dtrain
for epoch in range(args.epochs):
    for batch in engine.progress(loader, epoch=epoch):  # dtrain: a progress bar on rank 0
        engine.train_step(batch, F.cross_entropy)  # dtrain: forward, backward, sync, step
    engine.save(f"runs/quickstart/epoch-{epoch}")  # dtrain: rank 0 writes, atomically
engine.print(f"test: {engine.evaluate(test_loader, F.cross_entropy)}")  # dtrain: reduced
