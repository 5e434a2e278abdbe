"""`remat estimate` as a user runs it: table, JSON, options and errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from remat.cli import main

MiB = 1 << 20


def run_json(capsys: pytest.CaptureFixture[str], *args: str) -> dict:
    assert main(["estimate", *args, "--json", "-"]) == 0
    return json.loads(capsys.readouterr().out)


def test_default_is_64_stages_of_32mib_with_optimum_k8(capsys: pytest.CaptureFixture[str]) -> None:
    data = run_json(capsys)
    assert data["n"] == 64
    assert data["act_bytes"] == 32 * MiB
    assert data["no_checkpoint_bytes"] == 2 << 30
    assert data["optimal_k"] == 8
    assert data["optimal_total_bytes"] == 512 * MiB
    assert [r["k"] for r in data["rows"]] == [1, 2, 4, 8, 16, 32, 64]
    for row in data["rows"]:
        assert set(row) >= {"k", "boundary_bytes", "local_bytes", "total_bytes"}
        assert row["total_bytes"] == row["boundary_bytes"] + row["local_bytes"]


def test_table_goes_to_stdout_without_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["estimate"]) == 0
    out = capsys.readouterr().out
    assert "optimum: k=8, 512 MiB (16 copies) against 2 GiB" in out


def test_json_dash_keeps_stdout_pure_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["estimate", "--json", "-"]) == 0
    captured = capsys.readouterr()
    json.loads(captured.out)
    assert "optimum" in captured.err


def test_json_to_a_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "sub" / "est.json"
    assert (
        main(["estimate", "--layers", "10", "--act", "1e6", "--k", "4", "--json", str(path)]) == 0
    )
    data = json.loads(path.read_text())
    assert data["rows"] == [
        {
            "k": 4,
            "segments": 3,
            "boundary_bytes": 3_000_000,
            "local_bytes": 4_000_000,
            "total_bytes": 7_000_000,
        }
    ]
    assert "optimum" in capsys.readouterr().out


def test_unequal_sizes(capsys: pytest.CaptureFixture[str]) -> None:
    data = run_json(capsys, "--layers", "48", "--boundary", "4MiB", "--inner", "3MiB")
    assert data["continuous_k"] == pytest.approx(8.0)
    assert data["optimal_k"] == 8
    assert data["no_checkpoint_bytes"] == 48 * 3 * MiB


def test_transformer_sizes_the_chain(capsys: pytest.CaptureFixture[str]) -> None:
    data = run_json(capsys, "--transformer", "1,4096,4096,32,2", "--layers", "32")
    t = data["transformer"]
    assert t["attention_matrix_bytes"] == 1 << 30
    assert data["boundary_bytes"] == t["hidden_state_bytes"] == 4096 * 4096 * 2
    assert data["act_bytes"] == t["layer_bytes"]
    flash = run_json(capsys, "--transformer", "1,4096,4096,32,2", "--flash")
    assert flash["act_bytes"] == flash["transformer"]["layer_bytes_flash"] == 34 * 4096 * 4096


@pytest.mark.parametrize(
    "args",
    [
        ["--act", "12XB"],
        ["--act", "lots"],
        ["--boundary", "1,5GiB"],
        ["--layers", "0"],
        ["--k", "two"],
        ["--k", "0"],
        ["--transformer", "1,2,3"],
        ["--act", "1MiB", "--inner", "2MiB"],
        ["--flash"],
        ["--inner", "0"],
    ],
)
def test_bad_input_is_a_one_line_error_with_exit_2(
    args: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["estimate", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("remat estimate: error: ")
    assert "\n" not in err
    assert "Traceback" not in err


def test_console_script_entry_point_runs_as_module() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "remat", "estimate", "--act", "nope"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1
    assert "not a size" in proc.stderr
