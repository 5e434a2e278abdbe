"""Fuzzing the command line with what a user can type or hand it (hypothesis).

Random and mutated plan and profile JSON, budgets and argument lists go through
``remat.cli.main`` in-process. Whatever comes in, the command ends with a documented
exit code other than 4 (an unexpected error is a bug), at most one line on stderr and no
traceback; a model the command was handed (``remat verify`` takes it from a factory here)
is left exactly as it was: the same parameters and buffers, the same modules, no hooks
or wrapped forwards, no plan applied. A plan that loads is also applied and removed
through the Python API, which must leave the model as it was whether it succeeds or not.

Runs derandomized (the same examples every time); set REMAT_FUZZ_EXAMPLES to try more.
"""

from __future__ import annotations

import copy
import json
import operator
import os
from collections.abc import Iterator
from functools import reduce
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from torch import nn

import remat
from remat import plans
from remat.cli import main
from remat.core.errors import RematError
from remat.core.plan_format import Plan

FIXTURES = Path(__file__).parent / "fixtures"
PROFILE = json.loads((FIXTURES / "profile_mlp_tiny.json").read_text())
EXIT_CODES = {0, 1, 2, 3}  # README's Commands: success, check failed, usage, your code
SPEC = f"{__name__}:held"
SCALE = int(os.environ.get("REMAT_FUZZ_EXAMPLES", "1"))


def _settings(examples: int) -> settings:
    return settings(max_examples=examples * SCALE, deadline=None, derandomize=True,
                    database=None, suppress_health_check=list(HealthCheck))


# -- the model a command is handed ---------------------------------------------------------

torch.manual_seed(0)
MODEL = nn.Sequential(*(nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8))
                        for _ in range(3)))
BATCH = torch.randn(4, 8)


def held(batch_size: int = 4) -> Any:
    """The one model every call gets (verify must leave it as it was)."""
    return MODEL, BATCH, lambda m, b: m(b).pow(2).mean()


def _snapshot(model: nn.Module) -> Any:
    modules = [
        (name, type(m), "forward" in vars(m), len(m._forward_hooks),
         len(m._forward_pre_hooks), len(m._backward_hooks))
        for name, m in model.named_modules()
    ]
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return modules, state


def _assert_untouched(model: nn.Module, before: Any) -> None:
    modules, state = _snapshot(model)
    assert modules == before[0], "the model's modules, hooks or forwards changed"
    assert state.keys() == before[1].keys()
    for key, value in state.items():
        assert torch.equal(value, before[1][key]), f"{key} changed"
    assert not remat.applied(model)
    assert all(p.grad is None for p in model.parameters())


def _call(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    capsys.readouterr()
    code = main(argv)
    err = capsys.readouterr().err
    assert code in EXIT_CODES, (argv, code, err)
    assert "Traceback" not in err, (argv, err)
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) <= 1, (argv, err)
    return code, err


# -- JSON: random, and valid documents mutated ---------------------------------------------

EXTREMES: list[Any] = [0, -1, 1, 2**31, 2**63, 10**30, 10**400, 1e308, -1e-300,
                       float("inf"), float("nan"), "", "x", "1e99", "-5%", None, True, [],
                       {}, [0, 0], [[0, 1]], ["keep"]]
scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70),
                    st.floats(), st.text(max_size=6), st.sampled_from(EXTREMES))
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                               max_size=3),
    max_leaves=6,
)


def _paths(node: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    if prefix:
        yield prefix
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _paths(value, (*prefix, key))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _paths(value, (*prefix, i))


@st.composite
def mutated(draw: st.DrawFn, doc: dict[str, Any]) -> Any:
    """``doc`` with one to three of its keys or items deleted or given another value."""
    doc = copy.deepcopy(doc)
    for _ in range(draw(st.integers(1, 3))):
        paths = list(_paths(doc))
        if not paths:
            break
        path = draw(st.sampled_from(paths))
        parent = reduce(operator.getitem, path[:-1], doc)
        how = draw(st.sampled_from(["delete", "extreme", "random"]))
        if how == "delete":
            del parent[path[-1]]
        else:
            # a copy: a later mutation may reach inside it, and EXTREMES is shared
            parent[path[-1]] = copy.deepcopy(draw(st.sampled_from(EXTREMES)
                                                  if how == "extreme" else json_values))
    return doc


def _documents(valid: list[dict[str, Any]]) -> st.SearchStrategy[Any]:
    return st.one_of(st.sampled_from(valid), *(mutated(d) for d in valid), json_values)


def _write(path: Path, document: Any, raw: bool, garbled: bool = False) -> None:
    text = json.dumps(document)
    data = (text[: len(text) // 2] if raw else text).encode()  # raw: cut mid-file
    # garbled: a byte no UTF-8 text has, mid-file (a file saved in another encoding)
    path.write_bytes(data[: len(data) // 3] + b"\xff\xfe" + data[len(data) // 3:]
                     if garbled else data)


@pytest.fixture(autouse=True, scope="module")
def _elsewhere(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """A stray ``--json x`` among the drawn words writes x (an error document too): here."""
    before = os.getcwd()
    os.chdir(tmp_path_factory.mktemp("cwd"))
    try:
        yield
    finally:
        os.chdir(before)


PLANS = [
    plans.per_stage(MODEL).to_dict(),
    Plan(("0", "1", "2"), ((0, 3), (1, 2)), ("keep", "keep", "selective:save-nothing"),
         solver="optimal", budget_bytes=4096).to_dict(),
]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fuzz")


@_settings(30)
@given(document=_documents(PLANS), cut=st.booleans(), garbled=st.booleans())
# a stage path the model lacks: verify had looked it up before apply checked it (exit 4)
@example(document={**PLANS[0], "stages": ["x", *PLANS[0]["stages"][1:]]}, cut=False,
         garbled=False)
@example(document=PLANS[0], cut=False, garbled=True)  # Plan.load: UnicodeDecodeError (exit 4)
@example(document={**PLANS[0], "schema_version": "1"}, cut=False, garbled=False)
def test_any_plan_file_leaves_the_model_as_it_was(
    document: Any, cut: bool, garbled: bool, folder: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = folder / "plan.json"
    _write(path, document, cut and document not in PLANS, garbled)
    before = _snapshot(MODEL)
    _call(["verify", "--model", SPEC, "--plan", str(path), "--steps", "1"], capsys)
    _assert_untouched(MODEL, before)
    try:  # the same plan through the Python API
        handle = remat.apply(MODEL, Plan.load(path))
    except RematError:
        pass
    else:
        handle.remove()
    _assert_untouched(MODEL, before)


BUDGETS = st.one_of(
    st.sampled_from(["50%", "1e99", "1e400", "-5%", "0", "0.0", "1", "100%", "1e22", "nan",
                     "inf", "5e-324", " 64 MiB ", "1.5GB", "-0", "%", "1e", "2**10", "",
                     "1e-300", "1e-300%", "1e5%"]),
    st.from_regex(r"\A-?[0-9]{0,25}(\.[0-9]{0,3})?(e-?[0-9]{1,3})?(%|[KMGT]i?B|B)?\Z"),
    st.text(alphabet="0123456789.-+e%KMGTiB ", max_size=8),
)


@_settings(25)
@given(document=_documents([PROFILE]), budget=BUDGETS, cut=st.booleans(),
       solver=st.sampled_from(["optimal", "segments-optimal", "per-stage", "min-peak"]),
       garbled=st.booleans())
@example(document={**PROFILE, "schema_version": "2"}, budget="50%", cut=False,
         solver="optimal", garbled=False)
def test_any_profile_file_and_budget_end_in_one_line(
    document: Any, budget: str, cut: bool, solver: str, garbled: bool, folder: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    path = folder / "profile.json"
    _write(path, document, cut and document is not PROFILE, garbled)
    _call(["plan", "--profile", str(path), f"--budget={budget}", "--solver", solver], capsys)


@_settings(25)
@given(budget=BUDGETS, joined=st.booleans())
def test_any_budget_ends_in_one_line(
    budget: str, joined: bool, capsys: pytest.CaptureFixture[str]
) -> None:
    spelled = [f"--budget={budget}"] if joined else ["--budget", budget]
    code, _ = _call(["plan", "--profile", str(FIXTURES / "profile_mlp_tiny.json"), *spelled],
                    capsys)
    if budget.strip().startswith("-"):
        assert code == 2


# -- argument lists ------------------------------------------------------------------------

NUMBERS = st.one_of(st.integers(-3, 3).map(str), st.sampled_from(
    ["0", "-1", "1e9", "10000000000000000000000", "1.5", "x", "", "-5%", "nan", "1,2,0",
     "1001", "10001", "-99999999999999999999999"]))
OPTIONS: dict[str, list[tuple[str, st.SearchStrategy[str] | None]]] = {
    "estimate": [("--layers", NUMBERS), ("--act", BUDGETS), ("--boundary", BUDGETS),
                 ("--inner", BUDGETS), ("--k", NUMBERS), ("--flash", None),
                 ("--transformer", st.sampled_from(["1,8,16,2,2", "1,2,3", "0,0,0,0,0",
                                                    "a,b,c,d,e", "1,8,16,2,-2"]))],
    "plan": [("--budget", BUDGETS), ("--solver", st.sampled_from(
        ["optimal", "none", "every-k", "segments-k", "megatron-uniform", "megatron-block",
         "min-peak", "selective-everywhere", "segments-optimal", "bogus"])),
        ("--k", NUMBERS), ("--num-layers", NUMBERS), ("--slots", NUMBERS),
        ("--optimizer", st.sampled_from(["sgd", "adam"])), ("--stages", st.just("0")),
        ("--model", st.just("gpt"))],
    "verify": [("--plan", st.sampled_from(["none", "per-stage", "every:2", "every:0",
                                           "every:x", "segments", "segments:9",
                                           "groups:2", "groups:-1", "groups:abc",
                                           "selective", "selective:bogus", "nope"])),
               ("--steps", NUMBERS), ("--tolerance", st.sampled_from(
                   ["auto", "exact", "1e-3", "-1", "x"])), ("--seed", NUMBERS),
               ("--stages", st.sampled_from(["0,1,2", "0,,1", "9", "0.0"])),
               ("--set", st.sampled_from(["x=1", "x", "=1", "x=2"])),
               ("--batch-size", NUMBERS)],
}
# These commands train a model; handed options only, they must stop at the first bad one
# (the model cannot even be imported, so reaching it is exit 2 as well: never a crash).
TRAINING = {
    "profile": [("--repeats", NUMBERS), ("--batch-size", NUMBERS), ("--set", st.just("x")),
                ("--json", st.sampled_from(["/proc/no/x.json", ".", "-"]))],
    "auto": [("--budget", BUDGETS), ("--repeats", NUMBERS), ("--verify-steps", NUMBERS),
             ("--threads", NUMBERS), ("--stages", st.just(",")),
             ("--out", st.just("/proc/no/such/dir"))],
    "bench": [("--budgets", BUDGETS), ("--strategies", st.sampled_from(
        ["none", "every-0", "bogus", "", "remat,remat"])), ("--repeats", NUMBERS),
        ("--microbatch-budget", BUDGETS), ("--compile-limit", NUMBERS),
        ("--threads", NUMBERS)],
}


@st.composite
def argv_for(draw: st.DrawFn, table: dict[str, list[tuple[str, Any]]]) -> list[str]:
    command = draw(st.sampled_from(sorted(table)))
    words = [command]
    for _ in range(draw(st.integers(0, 4))):
        option, values = draw(st.sampled_from(table[command]))
        words.append(option)
        if values is not None:
            value = draw(values)
            joined = draw(st.booleans())
            words[-1:] = [f"{option}={value}"] if joined else [option, value]
    if draw(st.booleans()):  # a stray word
        words.insert(draw(st.integers(0, len(words))), draw(st.sampled_from(
            ["--bogus", "-5", "--", "--json", "x", "--debug"])))
    return words


@_settings(40)
@given(argv=argv_for(OPTIONS))
def test_any_argument_list_ends_in_one_line(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    before = _snapshot(MODEL)
    if argv[0] == "plan" and "--model" not in argv:
        argv = [*argv, "--profile", str(FIXTURES / "profile_mlp_tiny.json")]
    if argv[0] == "verify":
        argv = [*argv, "--model", SPEC]
        if not any(word.startswith("--plan") for word in argv):
            argv += ["--plan", "per-stage"]
        if not any(word.startswith("--steps") for word in argv):
            argv += ["--steps", "1"]
    if "--debug" in argv:
        argv.remove("--debug")  # tracebacks on purpose are not what this looks for
    if argv[0] == "plan" and "--model" in argv:
        argv = [*argv, "--set", "n_layer=1", "--set", "n_embd=16", "--batch-size", "1"]
    _call(argv, capsys)
    _assert_untouched(MODEL, before)


@_settings(30)
@given(argv=argv_for(TRAINING))
def test_the_training_commands_stop_at_their_options_in_one_line(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    if "--debug" in argv:
        argv.remove("--debug")
    code, _ = _call([*argv, "--model", "no_such_module_here:factory"], capsys)
    assert code == 2


# -- models that cannot train as given (issue 47) ------------------------------------------


def _odd(kind: str) -> Any:
    torch.manual_seed(0)
    with torch.device("meta" if kind == "meta" else "cpu"):
        model = nn.Sequential(*(nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8))
                                for _ in range(3)))
    if kind == "frozen":
        model.requires_grad_(False)
    if kind == "system-exit":
        raise SystemExit(0)  # a module that runs argparse when imported
    if kind == "interrupt":
        raise KeyboardInterrupt
    losses = {
        "nan": lambda m, b: m(b).pow(2).mean() * float("nan"),
        "inf": lambda m, b: m(b).pow(2).mean() * float("inf"),
        "detached": lambda m, b: m(b).pow(2).mean().detach(),
        "not-scalar": lambda m, b: m(b),
    }
    return model, torch.randn(4, 8), losses.get(kind, lambda m, b: m(b).pow(2).mean())


ODD = ["nan", "inf", "detached", "not-scalar", "frozen", "meta", "system-exit", "interrupt"]
for _kind in ODD:
    globals()[f"odd_{_kind.replace('-', '_')}"] = (
        lambda batch_size=4, _k=_kind: _odd(_k))


@_settings(16)
@given(kind=st.sampled_from(ODD), command=st.sampled_from(["verify", "profile"]))
def test_a_model_that_cannot_train_as_given_never_passes(
    kind: str, command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = f"{__name__}:odd_{kind.replace('-', '_')}"
    argv = ([command, "--model", spec, "--stages", "0,1,2"]
            + (["--plan", "per-stage", "--steps", "1"] if command == "verify"
               else ["--repeats", "1"]))
    code, err = _call(argv, capsys)
    # a NaN or infinite loss still profiles (its memory is real); verify cannot tell
    expected = {"nan": 1, "inf": 1} if command == "verify" else {"nan": 0, "inf": 0}
    assert code == expected.get(kind, 2 if kind == "meta" else 3), (kind, command, code, err)
