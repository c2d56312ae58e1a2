"""The block finder picks a model's repeated blocks inside any container (``ModuleList``,
``ModuleDict``, ``Sequential``) and never a container itself, which FSDP2 cannot shard."""

from __future__ import annotations

import torch
from torch import nn

from dtrain.models.gpt import GPT, GPTConfig
from dtrain.parallel.blocks import CONTAINERS, find_blocks


class Block(nn.Module):
    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


class Keyed(nn.Module):
    """Blocks in a ModuleDict named `layers` (torchtitan's pattern)."""

    def __init__(self, n: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.layers = nn.ModuleDict({str(i): Block() for i in range(n)})
        self.head = nn.Linear(8, 16)


class OneBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.blocks = nn.ModuleList([Block()])
        self.head = nn.Linear(8, 16)


class Staged(nn.Module):
    """A ResNet's layout: blocks in one Sequential per stage."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(8, 8)
        self.layer1 = nn.Sequential(Block(), Block())
        self.layer2 = nn.Sequential(Block())
        self.fc = nn.Linear(8, 2)


def test_blocks_in_a_module_dict_are_the_blocks() -> None:
    model = Keyed()
    assert find_blocks(model) == list(model.layers.values())


def test_one_block_in_a_list_is_found_and_no_container_is_a_block() -> None:
    model = OneBlock()
    blocks = find_blocks(model)
    assert model.blocks[0] in blocks
    assert not any(isinstance(b, CONTAINERS) for b in blocks)


def test_blocks_spread_over_stages_are_all_found() -> None:
    model = Staged()
    assert find_blocks(model) == [model.layer1[0], model.layer1[1], model.layer2[0]]


def test_a_sequential_model_of_blocks_gives_its_blocks() -> None:
    model = nn.Sequential(Block(), Block())
    assert find_blocks(model) == list(model)


def test_the_bundled_gpt_keeps_its_blocks() -> None:
    model = GPT(GPTConfig(vocab_size=16, context=4, dim=8, layers=2, heads=2))
    assert find_blocks(model) == list(model.blocks)
