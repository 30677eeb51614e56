"""benchmarks/grid_bench.py: grid specs, and one real run of two small grids."""

from __future__ import annotations

import csv
import sys

import pytest

from conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import grid_bench  # noqa: E402


def test_grid_specs_parse_and_bad_ones_are_refused():
    assert grid_bench.parse_grid("2x2x1") == (2, 2, 1, False, 1)
    assert grid_bench.parse_grid("1x2x2+sp+v2") == (1, 2, 2, True, 2)
    with pytest.raises(SystemExit, match="TPxPPxDP"):
        grid_bench.parse_grid("2x2")


def test_the_benchmark_runs_grids_and_writes_a_table_with_communication_times(tmp_path, capsys):
    shrink = ["--set", "model.hidden=64", "--set", "model.seq_len=32"]
    rc = grid_bench.main(["--steps", "3", "--grids", "1x1x2", "2x1x1+sp", "--out", str(tmp_path), *shrink])
    assert rc == 0
    rows = list(csv.DictReader((tmp_path / "table.csv").read_text().splitlines()))
    assert [r["grid"] for r in rows] == ["1x1x2", "2x1x1+sp"]
    assert float(rows[0]["dp_comm_ms"]) > 0 and float(rows[0]["tp_comm_ms"]) == 0
    assert float(rows[1]["tp_comm_ms"]) > 0 and float(rows[1]["dp_comm_ms"]) == 0
    assert rows[0]["final_loss"][:6] == rows[1]["final_loss"][:6]  # same training, another grid
    assert "| 2x1x1+sp | 2 |" in capsys.readouterr().out
