"""`dtrain plan`: calibrate, list the layouts, predict each, rank them, explain the first.

Called by `dtrain.cli` after the command line is parsed; everything here may import torch.
"""

from __future__ import annotations

import argparse
import json
import shutil
from dataclasses import asdict
from typing import Any

import torch

from dtrain.errors import ConfigError
from dtrain.plan import calibrate, links, report, weigh
from dtrain.plan.estimate import (
    Estimate,
    Inputs,
    estimate,
    inexact_unneeded,
    probe_points,
    rank,
    wrappers_of,
)
from dtrain.plan.layouts import Layout, check, enumerate_layouts, inexact_layouts
from dtrain.plan.machine import Machine, physical_memory, threads_from_env, usable_cores
from dtrain.plan.source import Source, Workload, load_source


def source_of(args: argparse.Namespace) -> Source:
    """The workload the flags name."""
    experts = args.experts or None  # a dense model's flags name no experts
    top_k = args.top_k if experts else None
    return Source(
        args.model, args.model_size, args.script, args.factory, args.optimizer, experts, top_k
    )


def global_batch(args: argparse.Namespace, work: Workload) -> int:
    """The global batch: --global-batch-size, or the bundled model's default."""
    if args.global_batch_size is None:
        if not work.bundled:
            raise ConfigError(
                "--global-batch-size is needed with --script or --factory: the plan splits "
                "that batch over the devices."
            )
        from dtrain.models.recipes import TASKS

        return TASKS[args.model or "cnn"].global_batch_size
    return int(args.global_batch_size)


def cuttable(model: object) -> bool:
    """Whether `model`'s samples can be cut over context-parallel ranks (--cp)."""
    from dtrain.parallel.context_parallel import check_positions

    try:
        check_positions(model, 2)  # type: ignore[arg-type]
    except ConfigError:
        return False
    return True


def check_job(args: argparse.Namespace, batch: int, cuttable: bool = False) -> None:
    """Refuse a process count, machine count or batch that no layout can use (`cuttable`:
    the model's samples can be cut over ranks with --cp, so a batch of fewer samples than
    processes can still be spread)."""
    if args.nproc < 1 or args.nnodes < 1:
        raise ConfigError(
            f"--nproc and --nnodes must be at least 1, got {args.nproc} and {args.nnodes}."
        )
    world = args.nproc * args.nnodes
    if batch < 1:
        raise ConfigError(
            f"--global-batch-size must be at least 1, got {batch}; give the samples of one "
            "step, or drop the flag for the model's default."
        )
    if batch % world and not cuttable:
        raise ConfigError(
            f"--global-batch-size {batch} does not divide evenly over the {world} processes "
            f"of --nproc {args.nproc} x --nnodes {args.nnodes}; use a multiple of {world}, "
            f"e.g. {max(1, (batch // world + 1)) * world}."
        )
    if args.probe_seconds <= 0:
        raise ConfigError(f"--probe-seconds must be positive, got {args.probe_seconds}.")
    if args.memory_per_device is not None and args.memory_per_device <= 0:
        raise ConfigError(f"--memory-per-device must be positive, got {args.memory_per_device}.")
    if (args.link_gbps is None) != (args.link_latency_us is None):
        raise ConfigError(
            "--link-gbps and --link-latency-us go together (a bandwidth and a latency); give "
            "both, or neither to measure the links."
        )


def machine_of(args: argparse.Namespace) -> Machine:
    """The hardware: this machine's cores and GPUs, the memory per device."""
    gpus = 0 if args.cpu or not torch.cuda.is_available() else torch.cuda.device_count()
    memory = args.memory_per_device
    if memory is None:
        memory = torch.cuda.get_device_properties(0).total_memory if gpus else physical_memory()
    return Machine(
        cores=usable_cores(),
        gpus=gpus,
        single_threads=torch.get_num_threads(),
        memory_per_device=int(memory),
        inter_node=(args.inter_node_gbps * 1e9, args.inter_node_latency_us * 1e-6),
        threads_per_process=threads_from_env(),
    )


def plan(args: argparse.Namespace) -> dict[str, Any]:
    """The whole plan as the JSON object `--json` prints."""
    source = source_of(args)
    work = load_source(source)
    batch = global_batch(args, work)
    check_job(args, batch, cuttable(work.model))
    machine = machine_of(args)
    kept: list[Layout] = []
    left_out: list[dict[str, str]] = []
    # bf16 and fp16 cost the same: offer the one the devices reduce in.
    half = "fp16" if machine.gpus and not torch.cuda.is_bf16_supported() else "bf16"
    layouts = enumerate_layouts(args.nproc, args.nnodes, machine.gpus)
    layouts += inexact_layouts(args.nproc, args.nnodes, half)
    for layout in layouts:
        reason = check(layout, batch, work.model)
        if reason is None:
            kept.append(layout)
        else:
            left_out.append({"flags": layout.flags(), "reason": reason})
    device = torch.device("cuda", 0) if machine.gpus else torch.device("cpu")
    contenders = args.nproc - 1 if not machine.gpus else 0
    cal = calibrate.measure(
        work,
        probe_points(kept, batch, machine),
        device,
        source,
        contenders,
        args.probe_seconds,
        wrappers_of(kept),
    )  # fmt: skip
    tensor = weigh.tensor_figures(work, batch, device)
    world = args.nproc * args.nnodes
    if args.link_gbps is not None:
        link = links.given(args.nproc, args.link_gbps, args.link_latency_us)
    elif world > 1:
        link = links.probe(
            args.nproc if args.nnodes == 1 else max(2, args.nproc), machine.gpus == 0
        )
    else:
        link = links.given(1, 1.0, 0.0)
    inputs = Inputs(cal, link, machine, batch, tensor)
    estimates: list[Estimate] = []
    for layout in kept:
        e = estimate(inputs, layout)
        if e.fits:
            estimates.append(e)
        else:
            left_out.append(
                {
                    "flags": layout.flags(),
                    "reason": f"needs {e.memory_bytes_per_rank / report.MIB:,.1f} MiB per rank, "
                    f"more than the {machine.memory_per_device / report.MIB:,.1f} MiB per "
                    "device (--memory-per-device).",
                }
            )
    why = inexact_unneeded(estimates) if args.nnodes == 1 else None
    if why is not None:
        inexact = [e for e in estimates if not e.layout.exact]
        left_out += [{"flags": e.layout.flags(), "reason": why} for e in inexact]
        estimates = [e for e in estimates if e.layout.exact]
    if not estimates:
        raise ConfigError(
            f"No layout of {work.name} fits {machine.memory_per_device:,} bytes per device "
            f"with --nproc {args.nproc} x --nnodes {args.nnodes}; add devices, lower "
            "--global-batch-size, or raise --memory-per-device if the devices hold more."
        )
    estimates = rank(estimates)
    explanation = report.explain(estimates, machine.memory_per_device)
    pays = report.where_approximate_pays(estimates, _link_words(args, link, machine))
    if pays:
        explanation += "\n\n" + pays
    if args.top:
        estimates = estimates[: args.top]
    prefix = None
    if work.bundled:
        size = f" --model-size {args.model_size}" if args.model_size else ""
        if args.experts:
            size += f" --experts {args.experts} --top-k {args.top_k}"
        prefix = (
            f"dtrain demo --model {args.model or 'cnn'}{size} --optimizer {work.optimizer} "
            f"--global-batch-size {batch}"
        )
    return {
        "model": work.name,
        "global_batch_size": batch,
        "candidates": [report.candidate(e, prefix) for e in estimates],
        "left_out": left_out,
        "explanation": explanation,
        "calibration": _calibration_summary(cal, link, machine),
        "_estimates": estimates,
    }


def _link_words(args: argparse.Namespace, link: links.Links, machine: Machine) -> str:
    """The links a data-parallel layout's gradients cross, in words with their speed."""
    if args.nnodes > 1:
        return f"the {machine.inter_node[0] * 8e-6:,.0f} Mbit/s links between machines"
    return f"the {link.bus_bandwidth * 8e-6:,.0f} Mbit/s links between the processes"


def _calibration_summary(
    cal: calibrate.Calibration, link: links.Links, machine: Machine
) -> dict[str, Any]:
    f = cal.figures
    steps = [
        {
            "batch": b,
            "threads": t,
            "beside_other_ranks": c,
            **{k: v for k, v in asdict(s).items() if k != "totals"},
            "mean_step": sum(s.totals) / max(len(s.totals), 1),
        }
        for (b, t, c), s in sorted(cal.steps.items())
    ]
    return {
        "device": cal.device,
        "cores": machine.cores,
        "gpus": machine.gpus,
        "parameters": f.params,
        "parameter_bytes": f.param_bytes,
        "optimizer_bytes": f.optimizer_bytes,
        "activation_bytes_per_sample": f.activation_bytes_per_sample,
        "flops_per_sample": f.flops_per_sample,
        "steps": steps,
        "wrapper_overhead_seconds": cal.overheads,
        "engine_seconds": cal.engine_seconds,
        "link": link.source,
        "all_reduce_latency_seconds": link.latency_seconds,
        "all_reduce_bus_bandwidth": link.bus_bandwidth if link.ranks > 1 else None,
        "probe_seconds": cal.probe_seconds,
    }


def main(args: argparse.Namespace) -> int:
    """Run `dtrain plan` and print its answer; returns the exit code."""
    result = plan(args)
    estimates = result.pop("_estimates")
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    cal = result["calibration"]
    print(
        f"dtrain plan: {result['model']}, global batch {result['global_batch_size']}, "
        f"{args.nproc} process(es) x {args.nnodes} machine(s) on {cal['device']}; "
        f"{cal['parameters']:,} parameters; calibrated in {cal['probe_seconds']:.1f} s "
        f"(links {cal['link']})."
    )
    print(report.table(estimates))
    print()
    print(result["explanation"])
    if result["left_out"]:
        width = min(100, shutil.get_terminal_size().columns)
        print(f"\n{report.left_out(result['left_out'], width)}")
    return 0
