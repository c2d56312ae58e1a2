"""The table of `dtrain bench`: one row per configuration (strategy x processes), medians
over its repeated trials, written as CSV and JSON and printed."""

from __future__ import annotations

import csv
import json
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from dtrain.bench.trial import TrialResult
from dtrain.observe.progress import steady_rate as engine_steady_rate

PHASES = ("data", "forward", "backward", "communication", "optimizer", "other")
"""The parts of a step in the metrics JSON's `breakdown`, in the order they are stacked."""
MIB = 2**20
MODEL_STATE = ("parameters", "gradients", "optimizer")
"""The keys of the metrics JSON's `memory` (--memory-report) that add up to model state."""
BASES = {
    "steady": "the global batch over the median step time after warm-up (the breakdown's "
    "`step`, mean over ranks)",
    "run": "the metrics JSON's samples_per_second, over the whole run with its first (slow) steps",
}
"""What the samples/s column measures: `steady` where every trial reports its breakdown and
global batch, else `run`. One basis for the whole table, so that rows compare."""


@dataclass
class Row:
    """One configuration's figures; times in seconds per step, memory in MiB."""

    strategy: str
    processes: int
    status: str
    """ok (every trial), partial (some failed), failed (none ran), skipped (cannot run) or
    interrupted (the bench was stopped before its first trial)."""
    trials: str = ""
    """Trials that ran to the end, of those started ("3/3")."""
    samples_per_second: float | None = None
    """Median over the trials, on the bench's basis (see `BASES`)."""
    samples_per_second_min: float | None = None
    samples_per_second_max: float | None = None
    run_samples_per_second: float | None = None
    """Median of the metrics JSON's own figure: the whole run, first steps included."""
    scaling_efficiency: float | None = None
    """samples/s over the strategy's smallest process count's, scaled by the count."""
    step_seconds: float | None = None
    """The median trial's step time after warm-up (mean over ranks; for an even number of
    trials, the lower of the middle two)."""
    data: float | None = None
    forward: float | None = None
    backward: float | None = None
    communication: float | None = None
    optimizer: float | None = None
    other: float | None = None
    peak_rss_mib: float | None = None
    """The largest rank's peak resident memory (host RAM)."""
    model_state_mib: float | None = None
    """The largest rank's parameters + gradients + optimizer state (--memory-report)."""
    layout: str = ""
    diagnosis: str = ""
    note: str = ""
    peak_rss_mib_per_rank: list[float | None] = field(default_factory=list)
    model_state_mib_per_rank: list[float] = field(default_factory=list)
    breakdown_per_rank: list[dict[str, float]] = field(default_factory=list)
    """The median trial's breakdown (by step time), rank by rank."""

    @property
    def label(self) -> str:
        """The configuration in a few characters, for plots and progress lines."""
        return f"{self.strategy} x{self.processes}"


PER_RANK = ("peak_rss_mib_per_rank", "model_state_mib_per_rank", "breakdown_per_rank")
"""Row fields kept out of the CSV (lists); the JSON holds them."""
CSV_COLUMNS = [name for name in Row.__dataclass_fields__ if name not in PER_RANK]


def skipped_row(strategy: str, nproc: int, reason: str) -> Row:
    """The row of a configuration that cannot run, with the reason on one line."""
    return Row(strategy, nproc, "skipped", note=" ".join(reason.split()))


def interrupted_row(strategy: str, processes: int) -> Row:
    """The row of a configuration the bench was stopped before it could try."""
    return Row(strategy, processes, "interrupted", "0/0", note="the bench stopped before it ran")


def steady_rate(trial: TrialResult) -> float | None:
    """The trial's global batch over its median step time after warm-up (mean over ranks),
    or None when its metrics lack the breakdown or the global batch."""
    ranks = _breakdown(trial.metrics)
    if not ranks:
        return None
    return engine_steady_rate({**trial.metrics, "breakdown": ranks})


def throughput_basis(trials: Sequence[TrialResult]) -> str:
    """`steady` when every trial that ran has a steady rate, else `run` (see `BASES`)."""
    ok = [t for t in trials if t.status == "ok"]
    return "steady" if ok and all(steady_rate(t) for t in ok) else "run"


def summarise(strategy: str, nproc: int, trials: Sequence[TrialResult], basis: str) -> Row:
    """The row of one configuration from its trials (medians over those that ran), its
    samples/s on `basis` (a key of `BASES`)."""
    ok = [t for t in trials if t.status == "ok"]
    status = "ok" if len(ok) == len(trials) else ("partial" if ok else "failed")
    row = Row(strategy, nproc, status, trials=f"{len(ok)}/{len(trials)}")
    row.note = "; ".join(f"trial {t.repeat + 1} {t.status}: {t.note}" for t in trials if t.note)
    if not ok:
        return row
    row.run_samples_per_second = statistics.median(
        float(t.metrics["samples_per_second"]) for t in ok
    )
    if basis == "steady":
        rates = [steady_rate(t) or 0.0 for t in ok]
    else:
        rates = [float(t.metrics["samples_per_second"]) for t in ok]
    row.samples_per_second = statistics.median(rates)
    row.samples_per_second_min, row.samples_per_second_max = min(rates), max(rates)
    per_rank = [ranks for ranks in (_breakdown(t.metrics) for t in ok) if ranks]
    if len(per_rank) == len(ok):
        # The median trial's own breakdown (by step time), so that its parts add up to its
        # step; medians taken part by part over noisy trials would not.
        per_rank.sort(key=lambda ranks: statistics.fmean(r["step"] for r in ranks))
        row.breakdown_per_rank = per_rank[(len(per_rank) - 1) // 2]
        for phase in (*PHASES, "step"):
            value = statistics.fmean(r[phase] for r in row.breakdown_per_rank)
            setattr(row, "step_seconds" if phase == "step" else phase, value)
    else:
        batch = ok[0].metrics.get("global_batch_size")
        if batch:
            row.step_seconds = float(batch) / row.run_samples_per_second
    peaks = [t.peak_rss_bytes for t in ok if t.peak_rss_bytes]
    if peaks:
        row.peak_rss_mib_per_rank = _median_lists(peaks, MIB)
        row.peak_rss_mib = _max(row.peak_rss_mib_per_rank)
    states = [_model_state(t.metrics) for t in ok]
    if all(states):
        row.model_state_mib_per_rank = _median_lists(states, MIB)  # type: ignore[arg-type]
        row.model_state_mib = _max(row.model_state_mib_per_rank)
    row.layout = str(ok[0].metrics.get("layout") or "")
    row.diagnosis = _top_cause(ok)
    return row


def add_scaling_efficiency(rows: list[Row]) -> None:
    """Fill each row's scaling efficiency against its strategy's smallest process count
    that ran: (samples/s at n) / (samples/s at n0 x n / n0); 1.0 is linear scaling."""
    base: dict[str, Row] = {}
    for row in sorted(rows, key=lambda r: r.processes):
        if row.samples_per_second is None:
            continue
        first = base.setdefault(row.strategy, row)
        assert first.samples_per_second is not None
        ideal = first.samples_per_second * row.processes / first.processes
        row.scaling_efficiency = row.samples_per_second / ideal


def write_table(rows: list[Row], out: Path, meta: dict[str, Any]) -> tuple[Path, Path]:
    """Write bench.csv (one row per configuration) and bench.json (the same rows with
    their per-rank lists, under `meta`: command, machine, workload); return both paths."""
    out.mkdir(parents=True, exist_ok=True)
    csv_path, json_path = out / "bench.csv", out / "bench.json"
    with csv_path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: _cell(v) for k, v in asdict(row).items() if k in CSV_COLUMNS})
    document = {**meta, "rows": [asdict(row) for row in rows]}
    json_path.write_text(json.dumps(document, indent=2) + "\n")
    return csv_path, json_path


def read_rows(path: Path) -> list[Row]:
    """The rows of a bench.json written by `write_table`."""
    return [Row(**row) for row in json.loads(Path(path).read_text())["rows"]]


def format_rows(rows: list[Row]) -> str:
    """The table as text: medians, with the min-max of samples/s; times in milliseconds."""
    # Whole names, never cut: the phases are ms per step, as the step column.
    head = ("strategy", "procs", "samples/s", "min-max", "eff", "step ms")
    head += PHASES + ("RSS MiB", "state MiB", "note")
    lines = [head]
    for r in rows:
        rate = _num(r.samples_per_second, "{:,.0f}")
        spread = (
            f"{r.samples_per_second_min:,.0f}-{r.samples_per_second_max:,.0f}"
            if r.samples_per_second_min is not None and r.samples_per_second_max is not None
            else ""
        )
        times = [r.step_seconds, *(getattr(r, p) for p in PHASES)]
        lines.append(
            (r.strategy, str(r.processes), rate, spread, _num(r.scaling_efficiency, "{:.0%}"))
            + tuple(_num(None if t is None else t * 1e3, "{:.2f}") for t in times)
            + (_num(r.peak_rss_mib, "{:.0f}"), _num(r.model_state_mib, "{:.2f}"))
            + (r.note if r.status != "ok" else r.diagnosis,)
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(head) - 1)]
    return "\n".join(
        "  ".join(
            cell.rjust(w) if i else cell.ljust(w)
            for i, (cell, w) in enumerate(zip(line[:-1], widths, strict=True))
        )
        + "  "
        + line[-1]
        for line in lines
    )


def _num(value: float | None, form: str) -> str:
    return "" if value is None else form.format(value)


def _cell(value: Any) -> Any:
    """CSV cells: empty for missing figures, floats to 6 significant digits."""
    if value is None:
        return ""
    return f"{value:.6g}" if isinstance(value, float) else value


def _breakdown(metrics: dict[str, Any]) -> list[dict[str, float]] | None:
    """The metrics JSON's per-rank breakdown, or None when it has none (or an incomplete
    one)."""
    ranks = metrics.get("breakdown")
    if not isinstance(ranks, list) or not ranks:
        return None
    keys = (*PHASES, "step")
    if not all(
        isinstance(r, dict) and all(isinstance(r.get(k), int | float) for k in keys) for r in ranks
    ):
        return None
    return [{k: float(r[k]) for k in keys} for r in ranks]


def _model_state(metrics: dict[str, Any]) -> list[int] | None:
    """Each rank's model-state bytes from the metrics JSON's `memory`, in rank order."""
    ranks = metrics.get("memory")
    if not isinstance(ranks, list) or not ranks:
        return None
    ordered = sorted(ranks, key=lambda r: r.get("rank", 0))
    return [sum(int(r.get(k, 0)) for k in MODEL_STATE) for r in ordered]


def _median_lists(trials: list[list[int | None]], unit: int) -> list[float | None]:
    """Per rank, the median over trials of the values that were measured, in `unit`s."""
    ranks = max(len(t) for t in trials)
    result: list[float | None] = []
    for r in range(ranks):
        values = [t[r] for t in trials if r < len(t) and t[r] is not None]
        result.append(statistics.median(values) / unit if values else None)
    return result


def _max(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return max(known) if known else None


def _top_cause(trials: list[TrialResult]) -> str:
    """The most frequent first cause of the trials' `diagnosis`, or '' without one."""
    causes = []
    for t in trials:
        diagnosis = t.metrics.get("diagnosis")
        if isinstance(diagnosis, list) and diagnosis and isinstance(diagnosis[0], dict):
            causes.append(str(diagnosis[0].get("cause", "")))
    return statistics.mode(causes) if causes else ""
