"""The pictures of `dtrain bench`, drawn with matplotlib (the optional `plots` extra):
samples/s against processes with the ideal linear-scaling line, scaling efficiency, the
step's breakdown as stacked bars, and memory per rank.

matplotlib's object API (`Figure`) is used rather than pyplot: no global figure state and
no display backend, so it draws the same on a server with no screen.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING

from dtrain.bench.table import PHASES, Row

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

EXTRA_NOTE = (
    "matplotlib is not installed, so no plots were drawn (the table is complete); install "
    "the plots extra with pip install 'dtrain[plots]' (or pip install matplotlib) and run "
    "the bench again."
)
PHASE_COLOURS = {
    "data": "#8c564b",
    "forward": "#1f77b4",
    "backward": "#ff7f0e",
    "communication": "#d62728",
    "optimizer": "#2ca02c",
    "other": "#7f7f7f",
}
DPI = 100


def draw(
    rows: list[Row], out: Path, title: str, basis: str = "run"
) -> tuple[list[Path], list[str]]:
    """Draw every plot the rows allow into `out`; return the files written and a note for
    each plot left out (no data for it). `basis` names what samples/s measures (a key of
    `table.BASES`). Raises ImportError without matplotlib."""
    from matplotlib.figure import Figure

    ran = [r for r in rows if r.samples_per_second is not None]
    written: list[Path] = []
    notes: list[str] = []
    if not ran:
        return written, ["No configuration ran, so there is nothing to plot."]
    for name, plot in (
        ("samples_per_second.png", _throughput),
        ("scaling_efficiency.png", _efficiency),
        ("breakdown.png", _breakdown),
        ("memory.png", _memory),
    ):
        fig = Figure(figsize=(7, 4.2), layout="constrained")
        missing = plot(fig, ran, basis)
        if missing:
            notes.append(f"{name} was not drawn: {missing}")
            continue
        fig.suptitle(title, fontsize=8)
        path = out / name
        fig.savefig(path, dpi=DPI)
        written.append(path)
    return written, notes


def _by_strategy(rows: list[Row]) -> dict[str, list[Row]]:
    groups: dict[str, list[Row]] = defaultdict(list)
    for row in sorted(rows, key=lambda r: r.processes):
        groups[row.strategy].append(row)
    return groups


def _finish_counts_axes(ax: Axes, rows: list[Row], ylabel: str) -> None:
    """Processes along x (the counts measured), `ylabel` up from zero, a legend."""
    ax.set_xlabel("processes")
    ax.set_xticks(sorted({r.processes for r in rows}))
    ax.grid(alpha=0.3)
    ax.set_ylabel(ylabel)
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=7)


def _throughput(fig: Figure, rows: list[Row], basis: str) -> str:
    ax = fig.add_subplot()
    for i, (strategy, group) in enumerate(_by_strategy(rows).items()):
        colour = f"C{i}"
        counts = [r.processes for r in group]
        rates = [r.samples_per_second for r in group]
        low = [r.samples_per_second - r.samples_per_second_min for r in group]  # type: ignore[operator]
        high = [r.samples_per_second_max - r.samples_per_second for r in group]  # type: ignore[operator]
        ax.errorbar(
            counts, rates, yerr=[low, high], marker="o", capsize=3, color=colour, label=strategy
        )
        first = group[0]
        if len(group) > 1:
            ideal = [first.samples_per_second * n / first.processes for n in counts]  # type: ignore[operator]
            ax.plot(
                counts, ideal, linestyle="--", color=colour, alpha=0.6, label=f"{strategy} ideal"
            )
    what = "steady state" if basis == "steady" else "whole run"
    _finish_counts_axes(ax, rows, f"samples/s, {what} (median; bars: min-max)")
    return ""


def _efficiency(fig: Figure, rows: list[Row], basis: str) -> str:
    ax = fig.add_subplot()
    for i, (strategy, group) in enumerate(_by_strategy(rows).items()):
        points = [(r.processes, r.scaling_efficiency * 100) for r in group if r.scaling_efficiency]
        ax.plot(*zip(*points, strict=True), marker="o", color=f"C{i}", label=strategy)
    ax.axhline(100, color="black", linewidth=0.8, linestyle="--", label="linear scaling")
    _finish_counts_axes(ax, rows, "scaling efficiency (%)")
    return ""


def _breakdown(fig: Figure, rows: list[Row], basis: str) -> str:
    shown = [r for r in rows if r.step_seconds is not None and r.data is not None]
    if not shown:
        return "the trials' metrics JSON carried no `breakdown`."
    ax = fig.add_subplot()
    labels = [r.label for r in shown]
    bottom = [0.0] * len(shown)
    for phase in PHASES:
        heights = [(getattr(r, phase) or 0.0) * 1e3 for r in shown]
        ax.bar(labels, heights, bottom=bottom, color=PHASE_COLOURS[phase], label=phase)
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    ax.plot(labels, [r.step_seconds * 1e3 for r in shown], "k_", markersize=20, label="step")  # type: ignore[operator]
    ax.set_ylabel("ms per step (mean over ranks)")
    ax.tick_params(axis="x", labelrotation=30, labelsize=7)
    ax.legend(fontsize=7)
    return ""


def _memory(fig: Figure, rows: list[Row], basis: str) -> str:
    panels = [
        ("peak_rss_mib_per_rank", "peak resident memory (MiB)"),
        ("model_state_mib_per_rank", "model state: params + grads + optimizer (MiB)"),
    ]
    panels = [(key, text) for key, text in panels if any(getattr(r, key) for r in rows)]
    if not panels:
        return "no trial measured memory (no /proc here and no --memory-report figures)."
    labels = [r.label for r in rows]
    ranks = max(len(getattr(r, key)) for r in rows for key, _ in panels)
    width = 0.8 / ranks
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    for ax, (key, text) in zip(axes, panels, strict=True):
        for rank in range(ranks):
            values = [_at(getattr(r, key), rank) for r in rows]
            places = [i + (rank - (ranks - 1) / 2) * width for i in range(len(rows))]
            ax.bar(places, values, width=width, color=f"C{rank}", label=f"rank {rank}")
        ax.set_xticks(range(len(rows)), labels, rotation=30, fontsize=7)
        ax.set_title(text, fontsize=8)
        ax.legend(fontsize=7)
    return ""


def _at(values: list[float | None], i: int) -> float:
    return (values[i] or 0.0) if i < len(values) else 0.0
