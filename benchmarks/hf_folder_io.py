"""Hugging Face model folders: loading and saving time and memory, dtrain against transformers.

A Llama of about 100M parameters (fp32, built from a config in code, nothing downloaded)
is written once with ``save_pretrained`` in shards of 100 MB. Then, alternating in each
repeat:

1. One process. transformers: ``LlamaForCausalLM.from_pretrained(folder)`` (its model
   built without an initialisation, then read), then ``save_pretrained``. dtrain: the
   model built inside ``engine.init_empty()``, ``engine.setup(model, pretrained=folder)``
   (no random initialisation of what the folder holds), then ``engine.save_pretrained``.
   Seconds of each (medians) and their ratio (goal: load and save within 1.2x).
2. zero3 on ``--nproc`` processes (default 4), the model built inside
   ``engine.init_empty()``: how far each rank's resident memory rose during
   ``engine.load`` (the kernel's VmHWM, reset before the call; see checkpoint_io.py), against
   its shard of the model and the largest single tensor (goal: the rise at most the shard
   plus the largest tensor; a whole copy per rank is what loading through
   ``from_pretrained`` costs), and the slowest rank's seconds.

    python benchmarks/hf_folder_io.py --repeats 3
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from checkpoint_io import MIB, measured  # noqa: E402
from harness import arguments, launch  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

import dtrain  # noqa: E402

hf_logging.set_verbosity_error()

CONFIG = LlamaConfig(
    vocab_size=16000,
    hidden_size=768,
    intermediate_size=2048,
    num_hidden_layers=10,
    num_attention_heads=12,
    num_key_value_heads=12,
    max_position_embeddings=512,
    use_cache=False,
)


def transformers_side(folder: Path, out: Path) -> tuple[float, float]:
    """(load seconds, save seconds) through transformers alone."""
    start = time.perf_counter()
    model = LlamaForCausalLM.from_pretrained(folder)
    loaded = time.perf_counter()
    model.save_pretrained(out)
    return loaded - start, time.perf_counter() - loaded


def dtrain_side(folder: Path, out: Path) -> tuple[float, float]:
    """(load seconds: build, setup with the folder; save seconds) through dtrain in one
    process."""
    start = time.perf_counter()
    engine = dtrain.init(strategy="single", cpu=True)
    with engine.init_empty():
        model = LlamaForCausalLM(LlamaConfig.from_pretrained(folder))
    engine.setup(model, pretrained=folder)
    loaded = time.perf_counter()
    engine.save_pretrained(out)
    saved = time.perf_counter()
    engine.close()
    return loaded - start, saved - loaded


def sharded_load(folder: str) -> dict[str, Any]:
    """This rank's rise of resident memory and seconds during `engine.load` under zero3,
    with its shard's bytes and the largest tensor's."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    engine = dtrain.init(strategy="zero3", cpu=True)
    with engine.init_empty():
        model = LlamaForCausalLM(LlamaConfig.from_pretrained(folder))
    model, _ = engine.setup(model)
    shard = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    largest = max(p.numel() * p.element_size() for p in model.parameters())
    seconds, rise = measured(lambda: engine.load(folder))
    engine.close()
    return {"seconds": seconds, "rise": rise, "shard": shard, "largest": largest}


def main() -> None:
    parser = arguments(__doc__, batch=1, steps=0, warmup=0, repeats=3)
    parser.set_defaults(nproc=4)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    root = Path(tempfile.mkdtemp(prefix="dtrain-hf-bench-"))
    try:
        torch.manual_seed(0)
        model = LlamaForCausalLM(CONFIG)
        psi = sum(p.numel() for p in model.parameters())
        folder = root / "llama"
        model.save_pretrained(folder, max_shard_size="100MB")
        del model
        files = len(list(folder.glob("*.safetensors")))
        pairs: list[tuple[tuple[float, ...], tuple[float, ...]]] = []
        for repeat in range(args.repeats):
            sides = [("transformers", transformers_side), ("dtrain", dtrain_side)]
            ran = {}
            for name, side in sides if repeat % 2 == 0 else sides[::-1]:
                ran[name] = side(folder, root / f"out-{name}")
            pairs.append((ran["transformers"], ran["dtrain"]))
        ranks = launch(args.nproc, sharded_load, str(folder))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(
        f"Llama, {psi:,} parameters ({psi * 4 / MIB:,.0f} MiB in fp32), {files} safetensors "
        f"files; one process, medians of {args.repeats} repeats, alternating"
    )
    for i, what in enumerate(("load", "save")):
        peer = statistics.median(p[i] for p, _ in pairs)
        ours = statistics.median(o[i] for _, o in pairs)
        print(
            f"  {what}: transformers {peer:6.2f} s, dtrain {ours:6.2f} s, ratio {ours / peer:.2f}"
        )
    print(f"zero3 on {args.nproc} processes, engine.load after setup under init_empty:")
    for rank, r in enumerate(ranks):
        bound = r["shard"] + r["largest"]
        print(
            f"  rank {rank}: {r['seconds']:6.2f} s, memory rose {r['rise'] / MIB:7.1f} MiB; "
            f"shard {r['shard'] / MIB:6.1f} MiB + largest tensor {r['largest'] / MIB:5.1f} MiB "
            f"= {bound / MIB:6.1f} MiB ({'within' if r['rise'] <= bound else 'ABOVE'})"
        )
    slowest = max(r["seconds"] for r in ranks)
    print(f"  slowest rank {slowest:.2f} s (a whole copy per rank: {psi * 4 / MIB:,.0f} MiB)")


if __name__ == "__main__":
    main()
