"""A nanoGPT-style GPT learning English bytes, written once and run under any strategy.

The model has nanoGPT's layout and names (transformer.wte, wpe, h, ln_f; lm_head tied to
wte) and the script its habits: a seed per rank, AdamW with weight decay on matrices only,
a cosine learning rate set by hand each step, gradient clipping, an MFU estimate. The
dtrain lines are init, setup, dataloader, train_step (or, with --hand, backward and
clip_grad_norm_) and state_dict. Every synchronous strategy trains the same model:

    python examples/nanogpt.py --steps 100                        # one process
    dtrain run --strategy ddp --nproc 2 examples/nanogpt.py --steps 6
    dtrain run --strategy zero3 --nproc 2 examples/nanogpt.py
    dtrain run --strategy pipeline --nproc 2 examples/nanogpt.py  # GPT.pipeline_layers
    dtrain run --strategy tensor --nproc 2 examples/nanogpt.py    # GPT.tensor_parallel_plan

--out FILE writes the final parameters as safetensors; --compile compiles the model;
--hand steps by hand (every strategy but pipeline, whose schedule runs backward itself).
"""

from __future__ import annotations

import argparse
import itertools
import math
import time
from dataclasses import dataclass

import safetensors.torch
import torch
import torch.nn.functional as F
from torch import nn

import dtrain
from dtrain.datasets import load_text


@dataclass
class GPTConfig:
    """The model's sizes, named as nanoGPT names them."""

    block_size: int = 64  # context length
    vocab_size: int = 256  # bytes
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention. nanoGPT computes q, k and v with one c_attn layer;
    here each has its own, so that tensor parallelism can give every rank whole heads."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.head_size = config.n_embd // config.n_head
        self.c_q = nn.Linear(config.n_embd, config.n_embd)
        # No key bias: it adds one constant to all the scores of a query, which softmax
        # cancels, so its gradient is rounding noise (which Adam would blow up).
        self.c_k = nn.Linear(config.n_embd, config.n_embd, bias=False)
        self.c_v = nn.Linear(config.n_embd, config.n_embd)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # -1 heads: a tensor-parallel rank's projections give it only its share of them.
        q, k, v = (
            proj(x).view(b, t, -1, self.head_size).transpose(1, 2)
            for proj in (self.c_q, self.c_k, self.c_v)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    """n_embd -> 4 n_embd -> n_embd with GELU."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x)))


class Block(nn.Module):
    """A pre-norm transformer block: attention, then the MLP, each added to its input."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class Embedding(nn.Module):
    """Token ids -> token plus position embeddings (a pipeline layer: only wte and wpe)."""

    def __init__(self, wte: nn.Embedding, wpe: nn.Embedding) -> None:
        super().__init__()
        self.wte, self.wpe = wte, wpe

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))


class Head(nn.Module):
    """Final LayerNorm, then logits over the vocabulary (a pipeline layer)."""

    def __init__(self, ln_f: nn.LayerNorm, lm_head: nn.Linear) -> None:
        super().__init__()
        self.ln_f, self.lm_head = ln_f, lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(x))


class GPT(nn.Module):
    """Embeddings, n_layer blocks and a final norm (`transformer`), and an output head that
    shares its matrix with the token embedding; no dropout, so runs are reproducible."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            h=nn.ModuleList(Block(config) for _ in range(config.n_layer)),
            ln_f=nn.LayerNorm(config.n_embd),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.transformer.wte.weight  # one matrix reads and writes tokens
        for name, p in self.named_parameters():  # biases 0, norms 1, matrices N(0, 0.02)
            if p.dim() >= 2:  # the residual projections smaller, as in GPT-2
                deep = name.endswith("c_proj.weight")
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * config.n_layer) if deep else 0.02)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """(B, T) token ids -> (B, T, vocab) logits: the chain of `pipeline_layers`."""
        x = idx
        for _, layer in self.pipeline_layers():
            x = layer(x)
        return x

    def pipeline_layers(self) -> list[tuple[str, nn.Module]]:
        """The forward as (name, module) layers, for --strategy pipeline to split."""
        t = self.transformer
        blocks = [(f"transformer.h.{i}", block) for i, block in enumerate(t.h)]
        embed = ("transformer.embed", Embedding(t.wte, t.wpe))
        return [embed, *blocks, ("head", Head(t.ln_f, self.lm_head))]

    def tensor_parallel_plan(self, degree: int) -> dict[str, str]:
        """Megatron's split for --strategy tensor: q, k, v and c_fc by output columns (whole
        heads per rank), the two c_proj by input rows."""
        if self.config.n_head % degree:
            raise ValueError(f"its {self.config.n_head} heads do not split over {degree} ranks")
        plan = {"attn.c_q": "colwise", "attn.c_k": "colwise", "attn.c_v": "colwise"}
        plan |= {"attn.c_proj": "rowwise", "mlp.c_fc": "colwise", "mlp.c_proj": "rowwise"}
        return {f"transformer.h.*.{path}": style for path, style in plan.items()}

    def get_num_params(self, non_embedding: bool = True) -> int:
        """Parameters, the tied matrix once; without the position table if `non_embedding`."""
        n = sum(p.numel() for p in self.parameters())
        return n - self.transformer.wpe.weight.numel() if non_embedding else n

    def configure_optimizers(self, weight_decay: float, lr: float) -> torch.optim.AdamW:
        """AdamW that decays the matrices (weights, embeddings) but not biases or norms."""
        params = list(self.parameters())
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
        return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95))

    def estimate_mfu(self, tokens_per_iter: int, seconds: float) -> float:
        """Model FLOPs per second as a fraction of an A100's bf16 peak (PaLM's count)."""
        c = self.config
        per_token = 6 * self.get_num_params() + 12 * c.n_layer * c.n_embd * c.block_size
        return per_token * tokens_per_iter / seconds / 312e12


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-byte cross-entropy."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def get_lr(it: int, args: argparse.Namespace) -> float:
    """Linear warmup, then a cosine from --lr down to a tenth of it at the last step."""
    if it < args.warmup:
        return args.lr * (it + 1) / (args.warmup + 1)
    ratio = (it - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr / 10 + 0.5 * (1 + math.cos(math.pi * ratio)) * (args.lr - args.lr / 10)


def train(engine: dtrain.Engine, args: argparse.Namespace) -> None:
    torch.manual_seed(1337 + engine.rank)  # as nanoGPT does; dtrain starts all from rank 0
    config = GPTConfig(args.block_size, 256, args.n_layer, args.n_head, args.n_embd)
    model = GPT(config)
    optimizer = model.configure_optimizers(args.weight_decay, args.lr)
    if args.compile:
        model = torch.compile(model)
    model, optimizer = engine.setup(model, optimizer)
    engine.print(f"{engine.module.get_num_params() / 1e6:.2f}M parameters")
    train_set, val_set = load_text(context=config.block_size)
    loader = engine.dataloader(train_set, global_batch_size=args.batch_size)
    epoch = 0
    while engine.step < args.steps:
        for batch in engine.progress(loader, epoch=epoch):
            for group in optimizer.param_groups:
                group["lr"] = get_lr(engine.step, args)
            start = time.perf_counter()
            if args.hand:
                x, y = engine.to_device(batch)
                engine.backward(lm_loss(model(x), y))
                if args.grad_clip:  # 0 turns clipping off, as in nanoGPT
                    engine.clip_grad_norm_(args.grad_clip)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            else:
                engine.train_step(batch, lm_loss)  # clips as dtrain.init was told
            seconds = time.perf_counter() - start
            if engine.step % args.log_every == 0 or engine.step == args.steps:
                loss = engine.check_loss()  # every rank: it is a collective
                mfu = engine.module.estimate_mfu(args.batch_size * config.block_size, seconds)
                engine.print(f"step {engine.step}: loss {loss:.4f}, mfu {mfu:.2e}")
            if engine.step == args.steps:
                break
        epoch += 1
    val = engine.dataloader(val_set, global_batch_size=args.batch_size, shuffle=False)
    val_loss = engine.evaluate(itertools.islice(val, args.eval_iters), lm_loss)["loss"]
    engine.print(f"validation loss {val_loss:.4f} over {args.eval_iters} batches")
    state = engine.state_dict()  # every rank: sharded strategies gather it
    if engine.is_main and args.out:
        # lm_head.weight is wte.weight: safetensors stores no tensors sharing memory.
        safetensors.torch.save_file({k: v.clone() for k, v in state.items()}, args.out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sizes = {"steps": 200, "batch-size": 16, "block-size": 64, "n-layer": 4, "n-head": 4}
    sizes |= {"n-embd": 128, "warmup": 10, "log-every": 10, "eval-iters": 20}  # global batch
    for name, default in sizes.items():
        parser.add_argument(f"--{name}", type=int, default=default)
    for name, default in {"lr": 1e-3, "weight-decay": 0.1, "grad-clip": 1.0}.items():
        parser.add_argument(f"--{name}", type=float, default=default)
    parser.add_argument("--compile", action="store_true", help="torch.compile the model")
    parser.add_argument("--hand", action="store_true", help="a hand loop, not train_step")
    parser.add_argument("--out", help="write the final parameters to this safetensors file")
    args = parser.parse_args(argv)
    engine = dtrain.init(clip_grad_norm=args.grad_clip or None)  # for train_step
    train(engine, args)
    engine.close()


if __name__ == "__main__":
    main()
