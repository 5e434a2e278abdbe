"""What the command line says to input a user can type: one line naming the real cause.

Budgets of any size and sign, files of the wrong kind, profiles that measured nothing,
sizes ``remat estimate`` cannot list, and help texts; all torch-free or on the tiny
profile in tests/fixtures (mlp-hetero, 4 blocks of width 32).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from remat.cli import main
from remat.core.errors import UsageError
from remat.core.plan_format import Plan
from remat.core.planner import plan, to_problem
from remat.core.profile_format import Profile
from remat.core.solve import Problem, simulate, solvers
from remat.core.units import format_bytes

FIXTURES = Path(__file__).parent / "fixtures"
PROFILE = FIXTURES / "profile_mlp_tiny.json"


def _err(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


# -- budgets of any size -------------------------------------------------------------------

@pytest.mark.parametrize("budget", ["1e22", "1e99", "1e300", 10**99, 1e300])
@pytest.mark.parametrize("path", ["numpy", "numba"])
def test_a_budget_beyond_int64_plans_no_checkpointing(budget: object, path: str) -> None:
    if path == "numba":
        from remat.core.solve import dp_numba

        if not dp_numba.available():
            pytest.skip("numba is not installed (the fast extra)")
    problem = to_problem(Profile.load(PROFILE))
    for solver in (solvers.optimal, solvers.segments_optimal):
        kwargs = {"path": path} if solver is solvers.optimal else {}
        result = solver(problem, budget, **kwargs)  # type: ignore[arg-type]
        assert result.regions == () and set(result.options) == {"keep"}
        assert result.budget_bytes is not None and result.budget_bytes >= 10**22
        none = simulate(Plan(problem.stage_names), problem)
        assert result.predicted_peak_bytes == none.peak_bytes


def test_a_budget_just_below_no_checkpointing_still_runs_the_tables() -> None:
    problem = Problem.load(FIXTURES / "chain_hetero_6.json")
    none = simulate(Plan(problem.stage_names), problem).peak_bytes
    least = solvers.minimum_budget(problem)
    assert least < none  # this profile has room between the two
    result = plan(problem, (least + none) // 2)
    assert result.regions or set(result.options) != {"keep"}
    assert result.predicted_peak_bytes is not None
    assert result.predicted_peak_bytes <= (least + none) // 2


def test_cli_plan_with_a_huge_budget_says_there_is_no_limit(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["plan", "--profile", str(PROFILE), "--budget", "1e99"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "against a budget of 1e+99 B" in out
    assert "so nothing is checkpointed (no limit)" in out


def test_format_bytes_of_sizes_beyond_any_device() -> None:
    assert format_bytes(3 << 50) == "3 PiB"
    assert format_bytes(10**99) == "1e+99 B"
    assert format_bytes(-(10**30)) == "-1e+30 B"


@pytest.mark.parametrize("spelling", [["--budget", "-5%"], ["--budget=-5%"],
                                      ["--budget", "-1e9"], ["--budget", "-2GiB"],
                                      ["--budget=-0.5"]])
def test_a_negative_budget_must_be_above_zero_however_it_is_written(
    spelling: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["plan", "--profile", str(PROFILE), *spelling]) == 2
    value = spelling[-1].removeprefix("--budget=")
    assert _err(capsys) == (f"remat plan: error: budget {value!r} must be above zero; give "
                            "bytes such as 6GiB, or 50%")


@pytest.mark.parametrize("argv", [["auto", "--budget", "-5%"], ["verify", "--budget", "-5%"],
                                  ["bench", "--budgets", "-5%,50%"],
                                  ["bench", "--microbatch-budget", "-5%"]])
def test_every_command_rejects_a_negative_budget_before_loading_a_model(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    # the model cannot be imported: loading it first would be the error
    assert main([*argv, "--model", "no.such.module:factory"]) == 2
    assert "'-5%' must be above zero" in _err(capsys)


def test_plan_checks_its_options_before_profiling(capsys: pytest.CaptureFixture[str]) -> None:
    # an unknown model module would fail first if the model were loaded before the checks
    for argv, message in (
        (["--solver", "fastest"], "--solver 'fastest' is not known"),
        (["--budget", "lots"], "budget 'lots' is not a size"),
        (["--budget", "50%", "--slots", "0"], "--slots 0 is outside 1..100000"),
        (["--budget", "50%", "--slots", "1000000000"], "--slots 1000000000 is outside"),
    ):
        assert main(["plan", "--model", "no.such.module:factory", *argv]) == 2
        assert message in _err(capsys)


# -- files of the wrong kind ---------------------------------------------------------------

def _plan_file(tmp_path: Path) -> Path:
    path = tmp_path / "plan.json"
    assert main(["plan", "--profile", str(PROFILE), "--solver", "per-stage",
                 "--json", str(path)]) == 0
    return path


def test_a_profile_given_as_a_plan_is_named_a_profile(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(UsageError, match=r"is a profile \(schema 2\), not a plan"):
        Plan.load(PROFILE)
    assert main(["verify", "--model", "mlp-hetero", "--set", "n_blocks=2", "--set",
                 "d_model=16", "--set", "pattern=wn", "--set", "expansion=2", "--batch-size",
                 "2", "--plan", str(PROFILE)]) == 2
    assert _err(capsys) == (f"remat verify: error: {str(PROFILE)!r} is a profile (schema 2), "
                            "not a plan; give the plan remat plan --json wrote")


def test_a_plan_given_as_a_profile_is_named_a_plan(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _plan_file(tmp_path)
    capsys.readouterr()
    assert main(["plan", "--profile", str(path), "--budget", "50%"]) == 2
    assert _err(capsys) == (f"remat plan: error: {str(path)!r} is a plan (schema 1), not a "
                            "profile; give the profile remat profile --json wrote")


def test_a_problem_file_given_as_a_profile_is_named_a_problem_file(
    capsys: pytest.CaptureFixture[str],
) -> None:
    path = FIXTURES / "chain_tiny_3.json"
    assert main(["plan", "--profile", str(path), "--budget", "50%"]) == 2
    assert "is a problem file (schema 1), not a profile" in _err(capsys)


@pytest.mark.parametrize("kind", ["plan", "profile"])
def test_json_that_is_no_remat_file_says_so_not_schema_none(
    kind: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "foo.json"
    path.write_text('{"foo": 1}')
    loader = Plan if kind == "plan" else Profile
    with pytest.raises(UsageError) as info:
        loader.load(path)
    message = str(info.value)
    assert message.startswith(f"{str(path)!r} is not a remat {kind}: it has none of the keys")
    assert "None" not in message


def test_a_profile_that_measured_no_peak_does_not_blame_the_budget(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = json.loads(PROFILE.read_text())
    data["measured_peak_bytes"] = 0
    path = tmp_path / "zero.json"
    path.write_text(json.dumps(data))
    assert main(["plan", "--profile", str(path), "--budget", "50%"]) == 2
    err = _err(capsys)
    assert "which is 0 bytes here, so the profile measured nothing" in err
    assert "must be above zero" not in err


# -- estimate sizes ------------------------------------------------------------------------

def test_estimate_of_a_billion_stages_is_quick(capsys: pytest.CaptureFixture[str]) -> None:
    began = time.perf_counter()
    assert main(["estimate", "--layers", "1000000000", "--json", "-"]) == 0
    assert time.perf_counter() - began < 5
    data = json.loads(capsys.readouterr().out)
    assert data["optimal_total_bytes"] == 63246 * 32 * 2**20  # ceil(2 sqrt(1e9)) copies


@pytest.mark.parametrize(("argv", "message"), [
    (["--layers", "1000000001"], "--layers 1000000001 is above 1000000000"),
    (["--act", "1e300"], "--act is 1e+300 bytes, above the 1e+30"),
    (["--inner", "1e40", "--boundary", "1"], "--inner is 1e+40 bytes"),
    (["--transformer", "99999999999,99999999999,99999999999,1,2"],
     "--transformer's hidden state is"),
    (["--act", "-5MiB"], "--act '-5MiB' is negative"),
])
def test_estimate_sizes_beyond_its_limits_are_one_line_usage_errors(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["estimate", *argv]) == 2
    assert message in _err(capsys)


# -- help ----------------------------------------------------------------------------------

@pytest.mark.parametrize("command", ["plan", "auto", "verify", "bench", "profile", "estimate"])
def test_help_prints_percent_signs_once_and_the_exit_codes(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([command, "--help"]) == 0
    out = capsys.readouterr().out
    assert "%%" not in out
    flat = " ".join(out.split())
    assert "3 your own code failed" in flat and "--debug" in flat


# -- issue 47: messages that say what was wrong and what to do --------------------------------

def test_a_file_that_is_not_utf8_is_a_usage_error_not_a_crash(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.json"
    bad.write_bytes(b'{"schema_version": 1, "stages": ["\xff\xfe"]}')
    for load in (Plan.load, Profile.load):
        with pytest.raises(UsageError, match="is not UTF-8 text"):
            load(bad)
    assert main(["plan", "--profile", str(bad), "--budget", "50%"]) == 2
    assert "is not UTF-8 text" in _err(capsys)
    assert main(["verify", "--model", "no.such.module:factory", "--plan", str(bad)]) == 2
    capsys.readouterr()


@pytest.mark.parametrize("value", [None, 3, b"plan.json", ["plan.json"]])
def test_load_and_from_json_of_the_wrong_type_are_usage_errors(value: object) -> None:
    for artifact in (Plan, Profile):
        with pytest.raises(UsageError, match="give the file"):
            artifact.load(value)  # type: ignore[arg-type]
        if not isinstance(value, bytes):
            with pytest.raises(UsageError, match="takes the JSON text"):
                artifact.from_json(value)  # type: ignore[arg-type]
    with pytest.raises(UsageError, match=r"a path is a str or pathlib\.Path"):
        Plan(("a",)).save(None)  # type: ignore[arg-type]


@pytest.mark.parametrize("seed", ["99999999999999999999999", "-99999999999999999999999"])
def test_a_seed_beyond_64_bits_is_a_usage_error(
    seed: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["verify", "--model", "no.such.module:factory", "--plan", "none",
                 f"--seed={seed}"]) == 2
    assert "does not fit torch's 64-bit seeds" in _err(capsys)


@pytest.mark.parametrize("version", ["1", "2", 1.5, True])
def test_a_schema_version_of_the_wrong_type_says_it_must_be_the_integer(
    version: object, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = json.loads(PROFILE.read_text())
    data["schema_version"] = version
    path = tmp_path / "p.json"
    path.write_text(json.dumps(data))
    assert main(["plan", "--profile", str(path), "--budget", "50%"]) == 2
    err = _err(capsys)
    assert "schema_version must be the integer 1 or 2, not" in err
    assert '"schema_version": 2 without quotes' in err
    plan = _plan_file(tmp_path)
    capsys.readouterr()
    data = json.loads(plan.read_text())
    data["schema_version"] = version
    with pytest.raises(UsageError, match="plan schema_version must be the integer 1, not"):
        Plan.from_dict(data)


def test_a_built_in_model_too_large_to_build_names_the_option(
    capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["profile", "--model", "gpt", "--set", "n_embd=100000000",
                 "--set", "n_layer=1", "--repeats", "1"]) == 2
    err = _err(capsys)
    assert "--set n_embd=100000000, n_layer=1 makes the built-in model 'gpt' too large" in err
    assert "can't allocate memory" in err and "give a smaller value" in err
    assert "fix the factory" not in err


def test_stages_of_a_wrapped_model_without_module_get_a_hint() -> None:
    from torch import nn

    from remat.runtime.stages import resolve_stages

    model = nn.DataParallel(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)))
    with pytest.raises(UsageError, match=r"paths start with 'module\.'; give 'module\.0'"):
        resolve_stages(model, ["0", "1"])
    assert resolve_stages(model, ["module.0", "module.1"]) == ["module.0", "module.1"]


@pytest.mark.parametrize(("builder", "example"), [
    ("groups:abc", "groups:2"), ("every:x", "every:2"), ("segments:y", "segments:3")])
def test_a_builder_argument_that_is_not_a_number_gets_an_example_of_its_own(
    builder: str, example: str,
) -> None:
    from torch import nn

    from remat.cli.verify import build_plan

    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    with pytest.raises(UsageError, match=f"write e.g. {example}$"):
        build_plan(builder, model, ["0", "1"])


@pytest.mark.parametrize("budget", ["1e-300", "1e-300%", "0.0000000001", "1e-20%"])
def test_budgets_under_one_byte_get_one_reason_however_written(
    budget: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["plan", "--profile", str(PROFILE), f"--budget={budget}"]) == 2
    assert _err(capsys) == (
        f"remat plan: error: budget {budget!r} comes to less than one byte; give a budget the "
        "step can fit, in bytes such as 6GiB, or a fraction such as 50%")


@pytest.mark.parametrize("spec", ["file.py:factory:extra", "pkg.mod:factory:extra",
                                  "a:b:c"])
def test_a_model_spec_with_too_many_colons_says_so(
    spec: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["profile", "--model", spec]) == 2
    err = _err(capsys)
    assert f"model spec {spec!r} has too many colons" in err
    assert "path/to/file.py:factory or package.module:factory" in err


def test_a_set_key_given_twice_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["profile", "--model", "gpt", "--set", "n_layer=1", "--set", "n_layer=2"]) == 2
    assert "--set names 'n_layer' twice ('n_layer=1' and 'n_layer=2')" in _err(capsys)


def test_a_json_key_given_twice_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    text = PROFILE.read_text()
    path = tmp_path / "p.json"
    path.write_text(text.replace('"model":', '"model": "twice", "model":', 1))
    assert main(["plan", "--profile", str(path), "--budget", "50%"]) == 2
    assert "names the key 'model' twice in one object; keep one of them" in _err(capsys)
    plan = _plan_file(tmp_path)
    plan.write_text(plan.read_text().replace('"solver":', '"solver": "x", "solver":', 1))
    with pytest.raises(UsageError, match="names the key 'solver' twice"):
        Plan.load(plan)
    from remat.core.devices import get_device

    table = tmp_path / "devices.json"
    table.write_text('{"cpu": {}, "cpu": {}}')
    monkeypatch.setenv("REMAT_DEVICES", str(table))
    with pytest.raises(UsageError, match="the key 'cpu' appears twice"):
        get_device("cpu")


@pytest.mark.parametrize(("argv", "option", "most"), [
    (["profile", "--repeats", "1001"], "--repeats", 1000),
    (["auto", "--repeats", "1000000000"], "--repeats", 1000),
    (["auto", "--profile-repeats", "1001"], "--profile-repeats", 1000),
    (["auto", "--verify-steps", "10001"], "--verify-steps", 10_000),
    (["verify", "--plan", "none", "--steps", "100000000"], "--steps", 10_000),
    (["bench", "--repeats", "1001"], "--repeats", 1000),
    (["bench", "--warmup", "1001"], "--warmup", 1000),
    (["bench", "--verify-steps", "10001"], "--verify-steps", 10_000),
    (["calibrate", "--repeats", "1001"], "--repeats", 1000),
])
def test_counts_above_their_bound_are_refused_before_any_work(
    argv: list[str], option: str, most: int, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([*argv, "--model", "no.such.module:factory"]) == 2
    assert f"{option} {argv[-1]} is above {most}, the most remat runs; give {most} or " \
           "fewer" in _err(capsys)
