"""Results: the metrics JSON (the keys other tools read, listed in README.md) and the short
table printed at the end."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

REQUIRED = ("strategy", "world_size", "steps", "train_loss", "samples_per_second", "wall_seconds")


def write_metrics(path: Path, metrics: dict[str, Any]) -> None:
    """Write `metrics` as one JSON object; it must hold the contract's required keys."""
    missing = [k for k in REQUIRED if k not in metrics]
    if missing:
        raise ValueError(f"metrics lack the required keys {missing}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(metrics, indent=2, sort_keys=True) + "\n")


def format_table(rows: list[tuple[str, Any]]) -> str:
    """A two-column table of (name, value), floats shown to 4 significant figures."""

    def show(value: Any) -> str:
        if isinstance(value, float):
            return f"{value:,.4g}" if abs(value) < 1e4 else f"{value:,.0f}"
        return str(value)

    shown = [(name, show(value)) for name, value in rows]
    left = max(len(n) for n, _ in shown)
    right = max(len(v) for _, v in shown)
    rule = f"+{'-' * (left + 2)}+{'-' * (right + 2)}+"
    lines = [rule] + [f"| {n:<{left}} | {v:>{right}} |" for n, v in shown] + [rule]
    return "\n".join(lines)


def format_memory(per_rank: list[dict[str, int]]) -> str:
    """Per-rank model-state memory (MiB) as a small table.

    "params" are held between steps; "in step" are held from forward to backward (the
    gathered parameters of zero2, and of zero3's blocks in flight).
    """
    mib = 2**20
    keys = ("parameters", "parameters_in_step", "gradients", "optimizer")
    lines = [f"{'rank':>4} {'params':>9} {'in step':>9} {'grads':>9} {'optim':>9}  (MiB)"]
    for row in per_rank:
        values = " ".join(f"{row.get(k, 0) / mib:>9.3f}" for k in keys)
        lines.append(f"{row['rank']:>4} {values}")
    return "\n".join(lines)
