"""Exit codes and outputs that never lie (issue 47, item 5).

User code that exits or raises KeyboardInterrupt is user code failing (exit 3), a real
Ctrl-C is 130; with ``--json -`` stdout holds only the JSON document; an output path that
is one of the command's inputs, or that cannot be written, is refused before any work;
every file is written atomically; every command writes ``{"ok": false, "error": ...}`` to
``--json`` when it stops early; ``remat calibrate`` does not shadow a built-in device
unless told to, and a plan for a user-calibrated device says so. Tiny models only.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from remat.cli import main
from remat.core.errors import INTERRUPTS

FIXTURES = Path(__file__).parent / "fixtures"
PROFILE = FIXTURES / "profile_mlp_tiny.json"
SPEC = f"{__name__}:{{}}"
MISSING = "no_such_module_here:factory"  # a model that fails to load: work never starts


def _err(capsys: pytest.CaptureFixture[str]) -> str:
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1, lines
    return lines[0]


# -- the factories a command is handed ---------------------------------------------------


def tiny(batch_size: int = 4) -> Any:
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8))
                            for _ in range(3)))
    return model, torch.randn(batch_size, 8), lambda m, b: m(b).pow(2).mean()


def exits_0(batch_size: int = 4) -> Any:
    raise SystemExit(0)  # a module that runs argparse when imported


def exits_2(batch_size: int = 4) -> Any:
    sys.exit(2)


def interrupts(batch_size: int = 4) -> Any:
    raise KeyboardInterrupt


def exits_in_loss(batch_size: int = 4) -> Any:
    model, batch, loss = tiny(batch_size)
    calls = [0]

    def loss_fn(m: nn.Module, b: torch.Tensor) -> torch.Tensor:
        calls[0] += 1
        if calls[0] > 2:  # after the first training step: inside profiling
            raise SystemExit(0)
        return loss(m, b)

    return model, batch, loss_fn


def ctrl_c(batch_size: int = 4) -> Any:
    """A loss that gets a real SIGINT, as Ctrl-C sends, on its third call. The signal is
    raised in the calling thread: ``os.kill`` lets the kernel hand a process-wide signal to
    any thread (torch's pool included), and on a loaded machine that thread could run its
    handler after the profile had finished and main had put its handler back."""
    model, batch, loss = tiny(batch_size)
    calls = [0]

    def loss_fn(m: nn.Module, b: torch.Tensor) -> torch.Tensor:
        calls[0] += 1
        if calls[0] == 3:
            signal.raise_signal(signal.SIGINT)
        return loss(m, b)

    return model, batch, loss_fn


def printing(batch_size: int = 4) -> Any:
    print("the factory says hello")
    model, batch, loss = tiny(batch_size)

    def loss_fn(m: nn.Module, b: torch.Tensor) -> torch.Tensor:
        print("loss_fn says hello")
        return loss(m, b)

    return model, batch, loss_fn


# -- user code that exits or interrupts ------------------------------------------------------


@pytest.mark.parametrize(("factory", "said"), [
    ("exits_0", "SystemExit(0)"), ("exits_2", "SystemExit(2)"),
    ("interrupts", "KeyboardInterrupt (no Ctrl-C was pressed)"),
    ("exits_in_loss", "SystemExit(0)"),
])
def test_user_code_that_exits_or_interrupts_is_user_code_failing(
    factory: str, said: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "p.json"
    code = main(["profile", "--model", SPEC.format(factory), "--repeats", "1",
                 "--json", str(out)])
    assert code == 3
    err = _err(capsys)
    assert err.startswith("remat profile: error: ") and said in err
    error = json.loads(out.read_text())["error"]
    assert error["exit_code"] == 3 and said in error["message"]


def test_a_real_ctrl_c_is_still_interrupted_130(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A process started from a terminal has Python's own SIGINT handler. A test process
    # may not: a library another test ran in this worker can leave SIGINT ignored (or
    # handled in C), and main then rightly treats Ctrl-C as unable to reach the process
    # (the suite once saw main return 0 here). So the terminal's state is set, and put back.
    ambient = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        out = tmp_path / "p.json"
        code = main(["profile", "--model", SPEC.format("ctrl_c"), "--repeats", "1",
                     "--json", str(out)])
        assert code == 130, (code, f"SIGINT's handler before the test: {ambient!r}",
                             f"seen: {INTERRUPTS.seen}")
        assert _err(capsys) == "remat: interrupted"
        assert json.loads(out.read_text())["error"]["exit_code"] == 130
        # the handler is main's only
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, ambient if ambient is not None else signal.SIG_DFL)


def warns(batch_size: int = 4) -> Any:
    """A factory that warns, as torch and transformers do, with a message on two lines."""
    import warnings

    warnings.warn("a deprecated flag was set;\n   set the new one instead", UserWarning,
                  stacklevel=1)
    return tiny(batch_size)


@pytest.mark.parametrize("debug", [False, True])
def test_a_python_warning_reaches_the_user_as_one_warning_line(debug: bool) -> None:
    import subprocess

    here = Path(__file__).resolve().parent
    done = subprocess.run(
        [sys.executable, "-m", "remat", "profile", "--model", "test_outputs:warns",
         "--repeats", "1", *(["--debug"] if debug else [])],
        cwd=here, capture_output=True, text=True, timeout=600,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(
            [str(here.parent / "src"), os.environ.get("PYTHONPATH", "")])})
    assert done.returncode == 0, done.stderr
    err = [line for line in done.stderr.splitlines()
           if "deprecated" in line or "set the new one" in line or "warnings.warn" in line]
    if debug:  # Python's own form: the source path and the category, then the code line
        assert any("UserWarning: a deprecated flag" in line for line in err), err
    else:
        assert err == ["warning: a deprecated flag was set; set the new one instead"]


# -- --json - ------------------------------------------------------------------------------


def test_json_on_stdout_is_only_the_document_whatever_user_code_prints(
    capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["profile", "--model", SPEC.format("printing"), "--repeats", "1",
                 "--json", "-"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["model"] == SPEC.format("printing")
    assert "the factory says hello" in captured.err and "loss_fn says hello" in captured.err
    assert sys.stdout is not sys.stderr  # put back after the run


def test_json_on_stdout_of_a_plan_and_rich_output_still_on_stdout_without_it(
    capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["plan", "--profile", str(PROFILE), "--budget", "1e99", "--json", "-"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["schema_version"] == 1
    assert "solver optimal" in captured.err
    assert main(["plan", "--profile", str(PROFILE), "--budget", "1e99"]) == 0
    assert "solver optimal" in capsys.readouterr().out


# -- outputs that are inputs, outputs that cannot be written ---------------------------------


def _copy_profile(tmp_path: Path) -> Path:
    path = tmp_path / "p.json"
    path.write_text(PROFILE.read_text())
    return path


@pytest.mark.parametrize("spelling", ["p.json", "./p.json", "sub/../p.json", "link.json",
                                      "ABS"])
def test_an_output_that_is_the_input_is_refused_however_it_is_spelled(
    spelling: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.chdir(tmp_path)
    profile = _copy_profile(tmp_path)
    (tmp_path / "sub").mkdir()
    (tmp_path / "link.json").symlink_to(profile)
    target = str(profile) if spelling == "ABS" else spelling
    before = profile.read_bytes()
    assert main(["plan", "--profile", "p.json", "--budget", "1e99", "--json", target]) == 2
    assert "would overwrite 'p.json', the --profile file this command reads" in _err(capsys)
    assert profile.read_bytes() == before  # no error document over it either


def test_verify_and_the_model_file_are_inputs_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    plan = tmp_path / "plan.json"
    assert main(["plan", "--profile", str(PROFILE), "--solver", "per-stage",
                 "--json", str(plan)]) == 0
    capsys.readouterr()
    assert main(["verify", "--model", MISSING, "--plan", "plan.json", "--json",
                 "./plan.json"]) == 2
    assert "the --plan file this command reads" in _err(capsys)
    model = tmp_path / "my_model.py"
    model.write_text("def factory():\n    pass\n")
    assert main(["profile", "--model", "my_model.py:factory", "--json", "my_model.py"]) == 2
    assert "the --model file this command reads" in _err(capsys)
    assert model.read_text() == "def factory():\n    pass\n"


@pytest.mark.parametrize("case", ["directory", "under a file", "proc", "empty"])
@pytest.mark.parametrize("option", ["--json", "--out"])
def test_an_output_that_cannot_be_written_fails_before_any_work(
    case: str, option: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    afile = tmp_path / "afile"
    afile.write_text("x")
    path = {"directory": str(tmp_path), "under a file": str(afile / "x.json"),
            "proc": "/proc/no/such/x.json", "empty": " "}[case]
    if option == "--out" and case == "directory":
        path = str(afile)  # --out of auto is a directory: a file is what it cannot be
    command = ["auto"] if option == "--out" else ["plan", "--budget", "50%"]
    # the model cannot be imported: reaching it would be another error
    assert main([*command, "--model", MISSING, option, path]) == 2
    err = _err(capsys)
    assert f"{option} " in err and "no_such_module_here" not in err
    assert afile.read_text() == "x"


def test_calibrate_out_and_json_must_differ(tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    path = str(tmp_path / "d.json")
    assert main(["calibrate", "--model", MISSING, "--out", path, "--json", path]) == 2
    assert "the device table this command reads" in _err(capsys)


# -- atomic writes -------------------------------------------------------------------------


def test_outputs_are_replaced_whole_never_written_in_place(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from remat.core import artifact

    replaced: list[tuple[str, str]] = []
    real = os.replace

    def spy(source: Any, target: Any) -> None:
        replaced.append((str(source), str(target)))
        real(source, target)

    monkeypatch.setattr(artifact.os, "replace", spy)
    out = tmp_path / "plan.json"
    out.write_text("old")
    assert main(["plan", "--profile", str(PROFILE), "--budget", "1e99",
                 "--json", str(out)]) == 0
    assert json.loads(out.read_text())["solver"] == "optimal"
    (source, target), = replaced
    assert target == str(out) and Path(source).parent == tmp_path
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json"]  # no temporary left


def test_a_write_that_fails_leaves_the_old_file_and_no_temporary(tmp_path: Path) -> None:
    from remat.core.artifact import replacing, write_text

    path = tmp_path / "x.json"
    write_text(path, "old")
    with pytest.raises(RuntimeError), replacing(path) as temporary:
        temporary.write_text("half")
        raise RuntimeError("killed mid-write")
    assert path.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["x.json"]


def test_artifacts_and_the_device_table_are_saved_atomically(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from remat.core import artifact
    from remat.core.devices import BUILT_IN, save_device
    from remat.core.plan_format import Plan

    replaced: list[str] = []
    real = os.replace
    monkeypatch.setattr(artifact.os, "replace",
                        lambda a, b: (replaced.append(str(b)), real(a, b)))
    Plan(("a", "b")).save(tmp_path / "plan.json")
    save_device(dataclasses.replace(BUILT_IN["cpu"], name="here"), tmp_path / "d.json")
    assert replaced == [str(tmp_path / "plan.json"), str(tmp_path / "d.json")]
    assert Plan.load(tmp_path / "plan.json").stages == ("a", "b")


# -- the error document of every command ------------------------------------------------------


@pytest.mark.parametrize(("argv", "code", "message"), [
    (["profile", "--model", MISSING], 2, "cannot import module"),
    (["plan", "--profile", str(PROFILE), "--budget", "lots"], 2, "budget 'lots' is not a size"),
    (["plan", "--profile", str(PROFILE), "--budget", "1%"], 1, "no plan fits"),
    (["verify", "--model", MISSING, "--plan", "none", "--steps", "0"], 2, "--steps 0"),
    (["estimate", "--layers", "0"], 2, "--layers 0 is below 1"),
    (["bench", "--budgets", "lots"], 2, "budget 'lots'"),
    (["calibrate", "--model", MISSING, "--name", "h200"], 2, "--name h200 is a built-in"),
    (["auto", "--threads", "0"], 2, "--threads 0 is below 1"),
    (["plan", "--profile", str(PROFILE), "--budgett", "5"], 2, "unrecognized arguments"),
    (["profile", "--repeats", "1001"], 2, "--repeats 1001 is above 1000"),
    (["profile", "--model", SPEC.format("exits_0")], 3, "SystemExit(0)"),
])
def test_every_command_writes_an_error_object_when_it_stops_early(
    argv: list[str], code: int, message: str, tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    out = tmp_path / "out.json"
    assert main([*argv, "--json", str(out)]) == code
    line = _err(capsys)
    data = json.loads(out.read_text())
    assert data["ok"] is False and data["command"] == argv[0]
    error = data["error"]
    assert {"stage", "message", "exit_code"} <= set(error) and error["exit_code"] == code
    assert message in error["message"] and error["message"] in line
    if "no plan fits" in message:
        assert isinstance(error["minimum_budget_bytes"], int)


def test_the_error_object_on_stdout_is_the_whole_of_stdout(
    capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["estimate", "--layers", "0", "--json", "-"]) == 2
    captured = capsys.readouterr()
    assert json.loads(captured.out)["error"]["exit_code"] == 2
    assert "--layers 0" in captured.err


# -- calibrate and the device table ----------------------------------------------------------


def test_calibrate_refuses_a_built_in_name_before_measuring(
    capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["calibrate", "--model", MISSING, "--name", "h100-sxm"]) == 2
    err = _err(capsys)
    assert "--name h100-sxm is a built-in device" in err and "--replace-builtin" in err
    # told to, it goes on (and stops at the model, which cannot be imported)
    assert main(["calibrate", "--model", MISSING, "--name", "h100-sxm",
                 "--replace-builtin"]) == 2
    assert "no_such_module_here" in _err(capsys)
    # cpu is the placeholder calibrate is for
    assert main(["calibrate", "--model", MISSING]) == 2
    assert "no_such_module_here" in _err(capsys)


def test_a_plan_for_a_user_calibrated_device_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from remat.core.devices import BUILT_IN, save_device, source_note

    table = tmp_path / "devices.json"
    monkeypatch.setenv("REMAT_DEVICES", str(table))
    assert source_note(BUILT_IN["h200"]) is None
    save_device(dataclasses.replace(BUILT_IN["h200"], source="remat calibrate here"))
    out = tmp_path / "fits.json"
    sets = ["--set=n_layer=2", "--set=n_embd=16", "--set=n_head=2", "--set=block_size=16"]
    assert main(["plan", "--fake", "--device", "h200", "--largest-batch", "--model", "gpt",
                 *sets, "--batch-size", "1", "--budget", "64MiB", "--json", str(out)]) == 0
    printed = " ".join(capsys.readouterr().out.split())
    said = f"note: device 'h200' is the entry of the user's device table {table} in place of"
    assert said in printed
    assert json.loads(out.read_text())["device_note"].startswith("note: device 'h200'")


def test_a_plan_file_for_a_user_calibrated_device_carries_the_note(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from remat.core.devices import BUILT_IN, save_device

    table = tmp_path / "devices.json"
    monkeypatch.setenv("REMAT_DEVICES", str(table))
    save_device(dataclasses.replace(BUILT_IN["h200"], source="remat calibrate here"))
    out = tmp_path / "plan.json"
    sets = ["--set=n_layer=2", "--set=n_embd=16", "--set=n_head=2", "--set=block_size=16"]
    assert main(["plan", "--fake", "--device", "h200", "--model", "gpt", *sets,
                 "--batch-size", "1", "--budget", "64MiB", "--json", str(out)]) == 0
    notes = json.loads(out.read_text()).get("notes", [])
    assert any(f"the user's device table {table}" in n for n in notes), notes
