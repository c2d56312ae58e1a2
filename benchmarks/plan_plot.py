"""The picture of a plan validation: each candidate's predicted samples/s against its
measured samples/s, a panel per model, with the line of a perfect
prediction and the goal's band (within 20%). The planner's first pick of each model is
ringed. Needs matplotlib (the `plots` extra); without it, says so and draws nothing.
"""

from __future__ import annotations

import statistics
from pathlib import Path

Point = tuple[str, float, float, bool]
"""(model, predicted samples/s, measured samples/s, the planner's first pick)."""


def points_of(name: str, result: dict, measured: dict[str, list[float]]) -> list[Point]:
    """The plotted points of one model: its candidates that ran, in the plan's order
    (`result["candidates"]` after `plan_validation.table`, which sets their median
    predictions)."""
    out = []
    for i, c in enumerate(result["candidates"]):
        runs = measured.get(c["flags"])
        if runs:
            out.append((name, c["samples_per_second"], statistics.median(runs), i == 0))
    return out


def draw(points: list[Point], path: Path, title: str) -> None:
    """Write the scatter of `points` to `path` (PNG)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import FuncFormatter, MaxNLocator
    except ImportError:
        print(f"matplotlib is not installed (pip install 'dtrain[plots]'): no {path}.")
        return
    models = list(dict.fromkeys(p[0] for p in points))
    figure, panels = plt.subplots(
        1, len(models), figsize=(5.2 * len(models), 5.0), dpi=120, squeeze=False
    )
    for axes, model in zip(panels[0], models, strict=True):
        mine = [p for p in points if p[0] == model]
        values = [v for p in mine for v in p[1:3]]
        low, high = 0.0, max(values) * 1.1
        axes.plot([low, high], [low, high], color="black", linewidth=1, label="exact")
        axes.fill_between(
            [low, high], [low * 0.8, high * 0.8], [low * 1.2, high * 1.2],
            color="grey", alpha=0.25, label="within 20%",
        )  # fmt: skip
        axes.scatter([p[2] for p in mine], [p[1] for p in mine], s=24, label="a candidate")
        first = [p for p in mine if p[3]]
        axes.scatter(
            [p[2] for p in first], [p[1] for p in first], s=160,
            facecolors="none", edgecolors="red", linewidths=1.5, label="first pick",
        )  # fmt: skip
        axes.set(xlim=(low, high), ylim=(low, high), aspect="equal")
        for axis in (axes.xaxis, axes.yaxis):
            axis.set_major_locator(MaxNLocator(5))
            axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.0f}"))
        axes.set_xlabel("measured samples/s")
        axes.set_ylabel("predicted samples/s")
        axes.set_title(model, fontsize=10)
        axes.legend(fontsize=8, loc="upper left")
    figure.suptitle(title, fontsize=11)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path)
    plt.close(figure)
    print(f"wrote {path}")
