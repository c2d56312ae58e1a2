"""`dtrain bench comm`: message sizes, the nccl-tests bandwidth definitions, and a short
run on two processes whose table holds every collective at every size."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
from conftest import run_cli

from dtrain.bench.comm import BUS_FACTOR, OPS, check_ops, parse_bytes, sizes
from dtrain.errors import ConfigError


def test_sizes_double_and_split_evenly() -> None:
    assert parse_bytes("1K") == 1024 and parse_bytes("256M") == 256 * 2**20
    assert parse_bytes("4096") == 4096 and parse_bytes("2kb") == 2048
    got = sizes(1024, 8192, 3)
    assert all(size % 12 == 0 for size in got) and len(got) == 4
    with pytest.raises(ConfigError, match="Expected a size"):
        parse_bytes("lots")
    with pytest.raises(ConfigError, match="--min-bytes"):
        sizes(4096, 1024, 2)
    with pytest.raises(ConfigError, match="choose from all_reduce"):
        check_ops("all_reduce,alltoallv")


def test_bus_bandwidth_factors_are_the_nccl_tests_ones() -> None:
    assert BUS_FACTOR["all_reduce"](4) == 1.5
    assert BUS_FACTOR["reduce_scatter"](4) == BUS_FACTOR["all_gather"](4) == 0.75
    assert BUS_FACTOR["broadcast"](8) == BUS_FACTOR["send_recv"](2) == 1.0


@pytest.mark.timeout(180)
def test_a_short_run_measures_every_collective(tmp_path: Path) -> None:
    table = tmp_path / "comm.csv"
    proc = run_cli(
        "bench", "comm", "--nproc", "2", "--max-bytes", "16K", "--iters", "3",
        "--csv", str(table), cwd=tmp_path, timeout=150,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "peak bus bandwidth" in proc.stdout
    with table.open() as f:
        rows = list(csv.DictReader(f))
    assert {row["op"] for row in rows} == set(OPS)
    assert len(rows) == len(OPS) * len(sizes(1024, 16 * 1024, 2))
    for row in rows:
        factor = BUS_FACTOR[row["op"]](2)
        assert float(row["busbw_GBps"]) == pytest.approx(float(row["algbw_GBps"]) * factor)
        assert float(row["microseconds"]) > 0
