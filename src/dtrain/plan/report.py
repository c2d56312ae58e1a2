"""What `dtrain plan` prints: the candidates as JSON or as a table, and the first pick
explained in the usual performance model's terms (t1 compute against t2 communication,
the per-device batch, the bubble, memory), and what the fastest layout that changes the
training would gain over it."""

from __future__ import annotations

import textwrap
from dataclasses import replace
from typing import Any

from dtrain.config import grad_compression
from dtrain.plan.estimate import ROUNDED_PREFERENCE, Estimate
from dtrain.plan.layouts import Layout

MIB = 2**20


def candidate(e: Estimate, command_prefix: str | None) -> dict[str, Any]:
    """One candidate as the JSON contract gives it, with the terms behind it."""
    flags = e.layout.flags()
    out: dict[str, Any] = {
        "strategy": e.layout.strategy,
        "flags": flags,
        "samples_per_second": e.samples_per_second,
        "step_seconds": e.step_seconds,
        "memory_bytes_per_rank": int(e.memory_bytes_per_rank),
        "data_seconds": e.data_seconds,
        "compute_seconds": e.compute_seconds,
        "communication_seconds": e.communication_seconds,
        "optimizer_seconds": e.optimizer_seconds,
        "idle_seconds": e.idle_seconds,
        "wait_seconds": e.wait_seconds,
        "overhead_seconds": e.overhead_seconds,
        "per_device_batch": e.per_device_batch,
        "crowd": e.crowd,
        "model_state_bytes": int(e.model_state_bytes),
        "buffer_bytes": int(e.buffer_bytes),
        "activation_bytes": int(e.activation_bytes),
        "fits": e.fits,
        "exact": e.layout.exact,
        "training": e.layout.training,
    }
    if not e.layout.exact:
        out["note"] = e.layout.note
    if e.layout.pp > 1:
        out["bubble"] = e.bubble
    if command_prefix:
        out["command"] = f"{command_prefix} {flags}"
    return out


def table(ranked: list[Estimate]) -> str:
    """The candidates, best first, one line each: those that keep the training, then the
    approximate ones under their own heading."""
    head = (
        f"{'#':>3}  {'samples/s':>10} {'step ms':>9} {'t1 ms':>8} {'t2 ms':>8} "
        f"{'wait ms':>8} {'MiB/rank':>9}  flags"
    )
    lines = [head]
    for i, e in enumerate(ranked, 1):
        if not _keeps(e) and (i == 1 or _keeps(ranked[i - 2])):
            lines.append(
                "  Approximate: these change the training (PowerSGD, local SGD, DiLoCo) and "
                "rank after every layout that keeps it; check one's loss before using it."
            )
        lines.append(
            f"{i:>3}  {e.samples_per_second:>10,.1f} {e.step_seconds * 1e3:>9.2f} "
            f"{e.compute_seconds * 1e3:>8.2f} {e.communication_seconds * 1e3:>8.2f} "
            f"{e.wait_seconds * 1e3:>8.2f} {e.memory_bytes_per_rank / MIB:>9.1f}  "
            f"{e.layout.flags()}{' ~' if e.layout.training == 'rounded' else ''}"
        )
    if any(e.layout.training == "rounded" for e in ranked):
        lines.append(
            "  ~ rounds each gradient to 16 bits: the same training within the format's "
            "rounding; --json gives each one's note."
        )
    return "\n".join(lines)


def _keeps(e: Estimate) -> bool:
    """True if `e`'s layout keeps the training (exact or rounded)."""
    return e.layout.training != "approximate"


def explain(ranked: list[Estimate], memory_per_device: float) -> str:
    """One paragraph on why the first candidate comes first."""
    best = ranked[0]
    lay = best.layout
    t1, t2 = best.compute_seconds, best.communication_seconds
    parts = [
        f"First pick: {lay.flags()}, predicted {best.samples_per_second:,.1f} "
        f"samples/s (a step of {best.step_seconds * 1e3:.2f} ms)."
    ]
    if not lay.exact:
        parts.append(lay.note)
    batch = f"{best.per_device_batch:g}"
    if lay.pp > 1:
        parts.append(
            f"Each stage computes micro-batches of {batch} samples; t1 = {t1 * 1e3:.2f} ms of "
            f"forward and backward on the busiest stage, and the pipeline idles "
            f"{best.bubble:.0%} of the step filling and draining "
            f"({best.idle_seconds * 1e3:.2f} ms)."
        )
    else:
        parts.append(
            f"Each device computes {batch} samples per step: t1 = {t1 * 1e3:.2f} ms of forward "
            "and backward."
        )
    if lay.world > 1 or lay.strategy == "towers":
        if t2 <= 0.1 * t1:
            verdict = "so the devices stay busy (t1 >> t2)"
        elif t2 < t1:
            verdict = f"t1 is {t1 / t2:.1f} x t2, so the devices mostly compute"
        else:
            verdict = "so the devices mostly wait: communication bounds this layout"
        parts.append(f"Communication not hidden by compute: t2 = {t2 * 1e3:.2f} ms, {verdict}.")
    else:
        parts.append(
            "One device, so there is no communication (t2 = 0): every other layout splits "
            "the batch or the model and pays more in communication and smaller batches "
            "than it gains."
        )
    if best.wait_seconds > 0.05 * best.step_seconds:
        parts.append(
            f"Jitter costs {best.wait_seconds * 1e3:.2f} ms a step: the probe's step times "
            "vary (other jobs on the machine), and a step in lockstep waits for its slowest "
            "rank."
        )
    parts.append(
        f"The optimizer takes {best.optimizer_seconds * 1e3:.2f} ms. Memory per rank: "
        f"{best.memory_bytes_per_rank / MIB:,.1f} MiB (model states "
        f"{best.model_state_bytes / MIB:,.1f} MiB + activations "
        f"{best.activation_bytes / MIB:,.1f} MiB) of {memory_per_device / MIB:,.0f} MiB."
    )
    # The runner-up of the pick's own group: an approximate layout ranks lower however fast.
    runner = next((e for e in ranked[1:] if _keeps(e) == _keeps(best)), None)
    if runner is not None:
        gap = best.samples_per_second / runner.samples_per_second - 1
        if gap < 0:
            parts.append(
                f"The next, {runner.layout.flags()}, is predicted {-gap:.1%} faster but "
                f"rounds each gradient: within {ROUNDED_PREFERENCE - 1:.0%} the exact layout "
                "comes first (try both)."
            )
        else:
            parts.append(
                f"The next best, {runner.layout.flags()}, is predicted {gap:.0%} slower"
                + (" (within the model's error: try both)." if gap < 0.1 else ".")
            )
    return " ".join(parts)


def where_approximate_pays(ranked: list[Estimate], link: str) -> str | None:
    """For the fastest candidate that changes the training (an approximate one), what it
    saves in t1/t2 terms against the exact layout it changes, across `link` (words naming
    the links the gradients cross), and how much faster than the pick it is predicted,
    with its loss still to check; None if there is no such candidate."""
    approximate = next((e for e in ranked if not _keeps(e)), None)
    if approximate is None:
        return None
    lay = approximate.layout
    base = (
        Layout("ddp", nproc=lay.nproc, nnodes=lay.nnodes)
        if lay.strategy == "local-sgd"
        else replace(lay, grad_compression="none")
    )
    exact = next((e for e in ranked if e.layout == base), None)
    parts = []
    if exact is not None:
        parts.append(
            f"Under {base.flags()}, communication takes t2 = {_ms(exact.communication_seconds)} "
            f"per step against t1 = {_ms(exact.compute_seconds)} of compute across {link}; "
            f"{_saving(lay, approximate, exact)}, so {lay.flags()} is predicted at t2 = "
            f"{_ms(approximate.communication_seconds)}."
        )
    else:
        parts.append(
            f"{lay.flags()} communicates t2 = {_ms(approximate.communication_seconds)} per "
            f"step against t1 = {_ms(approximate.compute_seconds)} of compute across {link}."
        )
    pick = ranked[0]
    if pick is approximate:
        parts.append(
            "No layout that keeps the training is left, so it ranks first: check its loss "
            "before relying on it."
        )
    elif approximate.samples_per_second > pick.samples_per_second:
        parts.append(
            f"It is predicted {approximate.samples_per_second / pick.samples_per_second:.2f}x "
            "as fast as the first pick, but it changes the training, so it ranks after every "
            "layout that keeps it: its loss must be checked (train both for the same steps "
            "and compare) before it replaces the pick."
        )
    else:
        parts.append(
            f"It does not pay here: {pick.layout.flags()} is predicted as fast or faster and "
            "keeps the training."
        )
    return " ".join(parts)


def left_out(rows: list[dict[str, str]], width: int) -> str:
    """Every layout left out (``flags``) and why (``reason``), wrapped to `width` columns
    at spaces only: flags such as ``--grad-compression`` and paths stay whole."""
    lines = [f"Left out ({len(rows)}):"]
    for row in rows:
        text = f"{row['flags']}: {' '.join(row['reason'].split())}"
        lines += textwrap.wrap(
            text,
            width,
            initial_indent="  ",
            subsequent_indent="    ",
            break_long_words=False,
            break_on_hyphens=False,
        )
    return "\n".join(lines)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms"


def _saving(lay: Layout, approximate: Estimate, exact: Estimate) -> str:
    """What `lay` changes to send less, in a clause."""
    if lay.strategy == "local-sgd":
        return (
            f"local SGD at H = {lay.sync_every} all-reduces the parameters once every "
            f"{lay.sync_every} steps, dividing t2 by about {lay.sync_every}"
        )
    _, rank = grad_compression(lay.grad_compression)  # PowerSGD, the other approximate kind
    extra = approximate.overhead_seconds - exact.overhead_seconds
    return (
        f"PowerSGD sends each gradient matrix as two rank-{rank} factors for "
        f"{extra * 1e3:.2f} ms more compute"
    )
