"""A pipeline trains what `single` trains on a user's own model: a nanoGPT port whose
pipeline_layers() are small wrappers and whose head is tied to the token embedding, and a
model with BatchNorm and a counter buffer; its checkpoints move to and from single."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
import torch.nn.functional as F
from distributed import run_ranks
from torch import nn
from torch.testing import assert_close
from training import finish

import dtrain
from dtrain.parallel.schedule import untouched
from dtrain.parallel.split import Stage, layers_of, layout_of, split_layers
from dtrain.parallel.stage_checks import check_stages

VOCAB, DIM, CONTEXT = 32, 8, 6
SPLIT = ["transformer.h.1"]  # embeddings and one block, then a block and the head
CLIP = 0.05  # small enough that every step clips


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(DIM)
        self.fc = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc(F.gelu(self.ln(x)))


class Embed(nn.Module):
    """nanoGPT's embedding step as a pipeline layer, given the modules it uses."""

    def __init__(self, wte: nn.Embedding, wpe: nn.Embedding) -> None:
        super().__init__()
        self.wte, self.wpe = wte, wpe

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))


class EmbedAll(nn.Module):
    """The same step given the whole transformer (which holds every block too)."""

    def __init__(self, transformer: nn.Module) -> None:
        super().__init__()
        self.net = transformer

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = self.net
        return t.wte(idx) + t.wpe(torch.arange(idx.shape[1]))


class Head(nn.Module):
    def __init__(self, ln_f: nn.LayerNorm, lm_head: nn.Linear) -> None:
        super().__init__()
        self.ln_f, self.lm_head = ln_f, lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(x))


class TinyGPT(nn.Module):
    """nanoGPT's layout: transformer.{wte, wpe, h, ln_f}, lm_head tied to wte."""

    def __init__(self, whole_wrapper: bool = False) -> None:
        super().__init__()
        self.whole_wrapper = whole_wrapper
        self.transformer = nn.ModuleDict(
            {
                "wte": nn.Embedding(VOCAB, DIM),
                "wpe": nn.Embedding(CONTEXT, DIM),
                "h": nn.ModuleList(Block() for _ in range(3)),
                "ln_f": nn.LayerNorm(DIM),
            }
        )
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)
        self.lm_head.weight = self.transformer.wte.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        for _, layer in self.pipeline_layers():
            idx = layer(idx)
        return idx

    def pipeline_layers(self) -> list[tuple[str, nn.Module]]:
        t = self.transformer
        embed = EmbedAll(t) if self.whole_wrapper else Embed(t.wte, t.wpe)
        blocks = [(f"transformer.h.{i}", block) for i, block in enumerate(t.h)]
        return [("transformer.embed", embed), *blocks, ("head", Head(t.ln_f, self.lm_head))]

    def get_num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())


class Count(nn.Module):
    """Counts its forwards in a buffer, as some user models count steps."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x


def batchnorm_net() -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(4, 6), nn.BatchNorm1d(6), Count(), nn.ReLU(), nn.Linear(6, 6), nn.Linear(6, 3)
    )


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def gpt_batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, VOCAB, (8, CONTEXT + 1), generator=torch.Generator().manual_seed(i))
    return tokens[:, :-1], tokens[:, 1:]


def bn_batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(i)
    return torch.randn(8, 4, generator=g), torch.randint(0, 3, (8,), generator=g)


def run(
    make: Any,
    batch: Any,
    loss_fn: Any,
    steps: int,
    load: str | None = None,
    save: str | None = None,
    close: bool = True,
    **options: Any,
) -> tuple[dict[str, torch.Tensor] | None, Any]:
    """Train `steps` steps of `make()` with AdamW (after loading `load`, saving
    `save` at the end); return (the whole state on the main rank, what the strategy says
    the user's model is, checked to be the object given to setup)."""
    engine = dtrain.init(seed=0, **options)
    torch.manual_seed(0)
    model = make()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.02, weight_decay=0.1)
    engine.setup(model, optimizer)
    user = engine.strategy.user_model()
    assert user is model
    if load:
        engine.load(load)
    for _ in range(steps):
        engine.train_step(batch(engine.step), loss_fn)
    if save:
        engine.save(save)
    sizes = user.get_num_params() if hasattr(user, "get_num_params") else None
    del model, optimizer, user
    return finish(engine, close), sizes


def pipeline_jobs(root: str) -> list[Any]:
    """On 2 ranks: the GPT under gpipe with clipping (saving a checkpoint); the GPT under
    1f1b over 4 micro-batches, resumed from single's step-2 checkpoint; the
    BatchNorm model under gpipe."""
    pp = {"strategy": "pipeline", "split_points": SPLIT, "clip_grad_norm": CLIP}
    return [
        run(TinyGPT, gpt_batch, lm_loss, 4, save=f"{root}/pipe", close=False,
            schedule="gpipe", microbatches=2, **pp),
        run(TinyGPT, gpt_batch, lm_loss, 2, load=f"{root}/single2", close=False,
            schedule="1f1b", microbatches=4, **pp),
        run(batchnorm_net, bn_batch, F.cross_entropy, 3, schedule="gpipe",
            strategy="pipeline", microbatches=2),
    ]  # fmt: skip


@pytest.mark.timeout(120)
def test_user_gpt_and_batchnorm_under_pipeline_match_single(tmp_path: Path) -> None:
    root = str(tmp_path)
    run(TinyGPT, gpt_batch, lm_loss, 2, save=f"{root}/single2", clip_grad_norm=CLIP)
    (expected, sizes), _ = run(TinyGPT, gpt_batch, lm_loss, 4, clip_grad_norm=CLIP), None
    bn_expected, _ = run(batchnorm_net, bn_batch, F.cross_entropy, 3, grad_accumulation=2)
    (gpipe, gpipe_sizes), (resumed, _), (bn, _) = run_ranks(pipeline_jobs, 2, root, timeout=100)[0]
    assert expected is not None
    # Every name single has, the tied head included (equal to the embedding it is).
    assert_close(gpipe, expected, msg=lambda m: f"gpipe: {m}")
    assert_close(resumed, expected, msg=lambda m: f"1f1b resumed from single: {m}")
    assert_close(gpipe["lm_head.weight"], gpipe["transformer.wte.weight"], rtol=0, atol=0)
    assert gpipe_sizes == sizes  # user_model() is the whole user model on every rank
    assert_close(bn, bn_expected, msg=lambda m: f"batchnorm: {m}")
    assert bn_expected["2.calls"].item() == 6
    # The pipeline's checkpoint has single's names and loads under single.
    saved = safetensors.torch.load_file(f"{root}/pipe/model.safetensors")
    assert set(saved) == set(expected)
    loaded, _ = run(TinyGPT, gpt_batch, lm_loss, 0, load=f"{root}/pipe")
    assert_close(loaded, expected)


def test_stage_names_ties_and_refusals() -> None:
    """Wrapper layers are held under the model's names, the tie is found, and a wrapper
    holding another stage's blocks is refused naming both layers."""
    model = TinyGPT()
    stages = [Stage(g, model) for g in split_layers(layers_of(model), 2, SPLIT)]
    assert set(stages[0].state_dict()) == {
        "transformer.wte.weight", "transformer.wpe.weight",
        "transformer.h.0.ln.weight", "transformer.h.0.ln.bias",
        "transformer.h.0.fc.weight", "transformer.h.0.fc.bias",
    }  # fmt: skip
    assert "lm_head.weight" in stages[1].state_dict()
    assert layout_of(stages[1]).model_names == {"lm_head.weight": "transformer.wte.weight"}
    [tie] = check_stages(model, stages, 2)
    assert tie.names == {0: "transformer.wte.weight", 1: "lm_head.weight"}
    with pytest.raises(dtrain.ConfigError, match="same pipeline rank"):
        check_stages(model, stages, 1)
    whole = TinyGPT(whole_wrapper=True)
    split = [Stage(g, whole) for g in split_layers(layers_of(whole), 2, SPLIT)]
    with pytest.raises(dtrain.ConfigError, match=r"'transformer.embed' \(stage 0\) and "
                       r"'transformer.h.1' \(stage 1\) .* hold transformer.h.1"):  # fmt: skip
        check_stages(whole, split, 2)


def test_untouched_restores_buffers_and_random_state() -> None:
    net = batchnorm_net()
    before = {k: v.clone() for k, v in net.state_dict().items()}
    state = torch.get_rng_state()
    with untouched(net, torch.device("cpu")):
        net(torch.randn(4, 4))
        net[2].calls = net[2].calls + 1  # a new tensor in place of the buffer
    assert_close(net.state_dict(), before, rtol=0, atol=0)
    assert torch.equal(torch.get_rng_state(), state)
