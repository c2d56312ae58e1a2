"""Expert parallelism (--ep): each mixture-of-experts layer's experts split over ranks,
tokens sent to them by all-to-all. The bundled MoE GPT and a Hugging Face Mixtral train
to `single`'s parameters under ddp and zero3 with the experts split; what cannot be split
is refused by name."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from distributed import run_ranks
from torch.testing import assert_close
from torch.utils.data import Dataset, Subset
from training import CLOSE

import dtrain
from dtrain.config import Config
from dtrain.errors import ConfigError
from dtrain.models.gpt import GPT, GPTConfig, lm_loss
from dtrain.parallel.expert_parallel import check_experts, experts_of
from dtrain.strategies.specs import lookup

STEPS = 3
LENGTH = 16
MODELS = ("gpt", "mixtral")
CONFIG = GPTConfig(vocab_size=48, context=LENGTH, dim=32, layers=2, heads=4, experts=4, top_k=2)


class Tokens(Dataset):
    """Random token sequences as (inputs, targets) pairs, the targets shifted by one."""

    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, CONFIG.vocab_size, (32, LENGTH + 1), generator=generator)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.ids[i, :-1], self.ids[i, 1:]


class Labelled(Dataset):
    """The same sequences as Hugging Face batches, ``{"input_ids", "labels"}``."""

    def __init__(self) -> None:
        self.ids = Tokens().ids[:, :-1]

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def mixtral(starved: bool = False) -> torch.nn.Module:
    """A tiny Hugging Face Mixtral: 4 experts, top-2, its load-balancing loss on. With
    `starved`: top-1 and its own loop over the experts ("eager", which skips an expert
    without tokens), the routers never choosing experts 2 and 3."""
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(
        vocab_size=CONFIG.vocab_size,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=1 if starved else 2,
        max_position_embeddings=LENGTH,
        output_router_logits=not starved,
        router_aux_loss_coef=0.02,
        use_cache=False,
    )
    model = MixtralForCausalLM(config)
    if starved:
        model.set_experts_implementation("eager")
        for layer in model.model.layers:
            with torch.no_grad():  # scores a.x, -a.x, 0, 0: expert 0 or 1 always wins
                weight = layer.mlp.gate.weight
                weight[1], weight[2:] = -weight[0], 0.0
    return model


def trained(layout: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The model's parameters after STEPS AdamW steps on global batches of 8 under
    `layout` (saved as a checkpoint under its "save" path, if it names one). With
    "by_hand": the habits of a loop written by hand (below); model "starved": a Mixtral
    whose router never picks the experts of the second half (ep rank 1's)."""
    layout = dict(layout)
    by_hand = layout.pop("by_hand", False)
    save = layout.pop("save", None)
    load = layout.pop("load", None)
    folder = layout.pop("save_pretrained", None)
    count = layout.pop("count_collectives", False)
    kind = layout.pop("model", "gpt")
    hf = kind in ("mixtral", "starved")
    engine = dtrain.init(seed=0, cpu=True, **layout)
    torch.manual_seed(0)
    model = mixtral(starved=kind == "starved") if hf else GPT(CONFIG)
    if by_hand:  # a layer's experts frozen, the rest under a schedule
        model.blocks[0].mlp.experts.requires_grad_(False)
    trainable = [p for p in model.parameters() if p.requires_grad]
    model, optimizer = engine.setup(model, torch.optim.AdamW(trainable, lr=3e-3))
    if load is not None:  # a checkpoint of the same run: loaded, then nothing more trained
        engine.load(load)
        params = engine.state_dict()
        engine.close()
        return params
    data = Labelled() if hf else Tokens()
    marked: list[int] = []
    if count:  # the all-to-alls tell the breakdown (the strategy's handover) when they run
        handover = engine.strategy.handover
        engine.strategy.experts.timing = SimpleNamespace(
            collective_started=lambda: (marked.append(1), handover.collective_started()),
            collective_ended=handover.collective_ended,
        )
    if by_hand:
        assert optimizer is not None
        schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=1e-2, total_steps=STEPS)
        loader = engine.dataloader(data, global_batch_size=8)
        for _, (inputs, targets) in zip(range(STEPS), loader, strict=False):
            optimizer.zero_grad()
            # Two halves accumulated without no_sync: one through engine.backward, one
            # through a plain backward (the experts' gradients are reduced either way).
            half = len(inputs) // 2
            engine.backward(lm_loss(model(inputs[:half]), targets[:half]) / 2)
            (lm_loss(model(inputs[half:]), targets[half:]) / 2).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)  # torch's own, by hand
            optimizer.step()
            schedule.step()
    for batch in engine.dataloader(data, global_batch_size=8) if not by_hand else []:
        engine.train_step(batch, None if hf else lm_loss)
        if engine.step == STEPS:
            break
    params = engine.state_dict()
    if params is not None and count:
        params["collectives"] = torch.tensor(len(marked))
    if save is not None:
        engine.save(save)
    if folder is not None:
        engine.save_pretrained(folder)
    # 5 samples in batches of 2: the ranks hold 2 and 1 batches, yet each runs as many
    # forwards (the experts exchange tokens in each).
    loader = engine.dataloader(Subset(data, range(5)), batch_size=2, drop_last=False)
    evaluated = engine.evaluate(loader, None if hf else lm_loss)["loss"]
    if params is not None:  # the main rank's
        params["evaluated"] = torch.tensor(evaluated)
    engine.close()
    return params


def trained_each(layouts: list[dict[str, Any]]) -> list[dict[str, torch.Tensor]]:
    return [trained(layout) for layout in layouts]


def reference(layout: dict[str, Any]) -> str:
    """Which of `single`'s runs `layout` trains as."""
    if "grad_accumulation" in layout:
        return "accumulated"
    return "by_hand" if layout.get("by_hand") else layout.get("model", "gpt")


LAYOUTS_AT_2: list[dict[str, Any]] = [
    {"strategy": "ddp", "ep": 2, "count_collectives": True},
    {"strategy": "zero3", "ep": 2},
    {"strategy": "zero2", "ep": 2, "grad_accumulation": 2},
    # A loop by hand: torch's clip_grad_norm_, a scheduler, one layer's experts frozen.
    {"strategy": "ddp", "ep": 2, "by_hand": True},
    {"strategy": "zero3", "ep": 2, "by_hand": True},
    # Without --ep too, the balancing loss is the global batch's (not each rank's own).
    {"strategy": "ddp", "model": "mixtral"},
    {"strategy": "ddp", "ep": 2, "model": "mixtral", "save_pretrained": "ddp"},
    {"strategy": "zero3", "ep": 2, "model": "mixtral", "save_pretrained": "zero3"},
    # No token reaches rank 1's experts: its forward skips them, its backward still runs
    # both exchanges (else every rank would wait in backward).
    {"strategy": "ddp", "ep": 2, "model": "starved"},
]


@pytest.mark.timeout(600)
def test_experts_split_over_ranks_train_as_single(tmp_path: Path) -> None:
    expected = {
        model: trained({"strategy": "single", "model": model}) for model in (*MODELS, "starved")
    }
    expected["accumulated"] = trained({"strategy": "single", "grad_accumulation": 2})
    expected["by_hand"] = trained({"strategy": "single", "by_hand": True})
    at_two = [
        {**layout, "save_pretrained": str(tmp_path / layout["save_pretrained"])}
        if "save_pretrained" in layout
        else layout
        for layout in [*LAYOUTS_AT_2, {"strategy": "zero3", "ep": 2, "save": str(tmp_path / "ep2")}]
    ]
    results = run_ranks(trained_each, 2, at_two, timeout=280)[0]
    saved = dict(results[-1])
    saved.pop("evaluated")
    # Each step, each of the 2 MoE layers: the counts exchanged, the tokens sent and
    # their outputs returned in forward, both again in backward.
    assert results[0].pop("collectives").item() == STEPS * 2 * 5
    for layout, got in zip(at_two, results, strict=True):
        assert_close(got, expected[reference(layout)], **CLOSE, msg=lambda m, o=layout: f"{o}: {m}")
    layouts = [
        {"strategy": "zero3", "ep": 2},  # two groups of two ranks, each holding every expert
        {"strategy": "zero3", "ep": 2, "model": "mixtral"},
        {"strategy": "hsdp", "ep": 2, "shard_size": 2},
        {"strategy": "ddp", "ep": 4, "load": str(tmp_path / "ep2")},  # one expert a rank
    ]
    replicated, hf, hybrid, loaded = run_ranks(trained_each, 4, layouts, timeout=280)[0]
    assert_close(replicated, expected["gpt"], **CLOSE, msg=lambda m: f"zero3 ep2 of 4: {m}")
    assert_close(hf, expected["mixtral"], **CLOSE, msg=lambda m: f"mixtral ep2 of 4: {m}")
    assert_close(hybrid, expected["gpt"], **CLOSE, msg=lambda m: f"hsdp ep2 of 4: {m}")
    assert_close(loaded, saved, rtol=0, atol=0, msg=lambda m: f"loaded at ep4: {m}")
    # The checkpoint holds every expert under the layer's own name: it loads whole into one
    # process.
    engine = dtrain.init(strategy="single", cpu=True)
    model, _ = engine.setup(GPT(CONFIG))
    engine.load(tmp_path / "ep2")
    assert_close(dict(model.state_dict()), saved, rtol=0, atol=0)
    engine.close()
    # Hugging Face folders hold each layer's experts stacked, as the model stores them.
    from transformers import MixtralForCausalLM

    for layout, got in zip(at_two, results, strict=True):
        if "save_pretrained" in layout:
            folder = MixtralForCausalLM.from_pretrained(layout["save_pretrained"])
            state = {k: v for k, v in folder.state_dict().items() if k in got}
            assert state.keys() == got.keys() - {"evaluated"}
            assert_close(state, {k: got[k] for k in state}, rtol=0, atol=0)


def setup_refusals() -> list[str]:
    """What --ep 2 says at setup to a model without experts, a compiled one and one built
    on the meta device."""
    engine = dtrain.init(strategy="zero3", ep=2, cpu=True)

    def empty() -> torch.nn.Module:
        with engine.init_empty():
            return GPT(CONFIG)

    said = []
    for build in (
        lambda: GPT(replace(CONFIG, experts=0)),
        lambda: torch.compile(GPT(CONFIG)),
        empty,
    ):
        with pytest.raises(ConfigError) as refused:
            engine.setup(build())
        said.append(str(refused.value))
    engine.close()
    # The script fixes its mistake and starts again in the same process (a notebook): the
    # second group joins the store the first left bound, under keys of its own.
    engine = dtrain.init(strategy="zero3", cpu=True)
    dense = GPT(replace(CONFIG, experts=0))
    model, optimizer = engine.setup(dense, torch.optim.SGD(dense.parameters(), lr=0.1))
    engine.train_step(next(iter(engine.dataloader(Tokens(), global_batch_size=8))), lm_loss)
    engine.close()
    return said


def accumulation_refusal() -> str:
    """What ddp says at setup to a model adding its balancing loss, with micro-batches
    accumulated over two ranks."""
    engine = dtrain.init(strategy="ddp", grad_accumulation=2, cpu=True)
    with pytest.raises(ConfigError) as refused:
        engine.setup(mixtral())
    engine.close()
    return str(refused.value)


@pytest.mark.timeout(120)
def test_models_expert_parallelism_cannot_split_are_refused_at_setup() -> None:
    said = run_ranks(accumulation_refusal, 2, timeout=100)[0]
    assert "MixtralForCausalLM adds its load-balancing loss" in said
    assert "without --grad-accumulation" in said
    said = run_ranks(setup_refusals, 2, timeout=100)
    assert said[0] == said[1]
    dense, compiled, meta = said[0]
    assert "GPT has no experts modules" in dense
    assert "drop --ep for a dense model" in dense
    assert "pass the model to engine.setup uncompiled with --ep" in compiled
    assert "'blocks.0.mlp.experts' from the whole layer, but it is on the meta" in meta


def test_what_cannot_be_split_is_refused_by_name() -> None:
    with pytest.raises(ConfigError, match=r"--ep 2 splits .* which --strategy tensor does not"):
        dtrain.init(strategy="tensor", ep=2)
    with pytest.raises(ConfigError, match=r"--ep with --cp is not supported yet"):
        dtrain.init(strategy="ddp", ep=2, cp=2)
    with pytest.raises(ConfigError, match=r"--ep must be at least 1, got 0"):
        dtrain.init(strategy="ddp", ep=0)
    with pytest.raises(ConfigError, match=r"--ep 4 groups the 2 data-parallel ranks .* does not"):
        lookup("zero3").layout(Config(strategy="zero3", ep=4), 2)  # type: ignore[attr-defined]
    with pytest.raises(ConfigError, match=r"--ep 4 does not divide the 6 experts of 'blocks.0"):
        check_experts(GPT(replace(CONFIG, experts=6)), 4)
    wrong = GPT(CONFIG)
    wrong.expert_parallel_plan = lambda: ["blocks.*.mlp"]  # the router and experts together
    with pytest.raises(ConfigError, match=r"it holds router.weight, experts.up, experts.down"):
        check_experts(wrong, 2)
    buffered = GPT(CONFIG)
    buffered.blocks[0].mlp.experts.register_buffer("scale", torch.ones(4))
    with pytest.raises(ConfigError, match=r"holds scale in modules inside it or as buffers"):
        check_experts(buffered, 2)
    called = GPT(CONFIG)
    called.expert_parallel_plan = lambda: ["blocks.*.mlp.experts"]
    called.blocks[0].mlp.experts.forward = lambda hidden: hidden  # type: ignore[method-assign]
    with pytest.raises(ConfigError, match=r"but its forward takes \(hidden\)"):
        check_experts(called, 2)
    with pytest.raises(ValueError, match=r"--top-k 5 routes each token to that many of the 4"):
        GPT(replace(CONFIG, top_k=5))
    with pytest.raises(ValueError, match=r"place the experts over ranks with --ep instead"):
        GPT(CONFIG).tensor_parallel_plan(2)


def test_experts_are_found_as_the_model_says() -> None:
    assert list(experts_of(GPT(CONFIG))) == ["blocks.0.mlp.experts", "blocks.1.mlp.experts"]
    assert list(experts_of(mixtral())) == [
        "model.layers.0.mlp.experts",
        "model.layers.1.mlp.experts",
    ]
    assert experts_of(GPT(replace(CONFIG, experts=0))) == {}


def test_a_balancing_loss_split_over_towers_is_refused() -> None:
    engine = dtrain.init(strategy="towers", towers=2, cpu=True)
    with pytest.raises(ConfigError, match=r"MixtralForCausalLM adds its load-balancing loss"):
        engine.setup(mixtral())
    engine.close()
