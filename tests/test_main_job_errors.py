"""How auto, profile and bench stop: the step, one sentence, the exit code, the JSON.

Through the CLI entry point, on tiny models: a factory that raises, a loss that is not a
scalar, a stage whose rebuild torch rejects (a Python-side cache the stage appends to),
a budget no plan fits; ``--threads``; and transformers' ``use_cache``, switched off with
one note where it builds a cache and left alone where it does not (encoder-only BERT).
"""

from __future__ import annotations

import importlib
import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import remat
from remat import plans
from remat.benchmarking.factory import make_factory
from remat.cli import main

SPEC = f"{__name__}:{{}}"
apply_module = importlib.import_module("remat.runtime.install")  # the package re-exports apply
FAST = ["--repeats", "1", "--verify-steps", "1"]
THREADS_SEEN: list[int] = []


class CacheNet(nn.Module):
    """Each block appends its input to a list the model owns and reads all of it."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(CacheBlock(self) for _ in range(3))
        self.cache: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.cache.clear()
        for block in self.blocks:
            x = block(x)
        return x


CACHING = {"on": True}  # off: the blocks leave the cache alone (a hazard-free model)


class CacheBlock(nn.Module):
    def __init__(self, owner: CacheNet) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.owner = [owner]  # a list, so the owner is not registered as a submodule

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not CACHING["on"]:
            return torch.tanh(self.lin(x))
        cache = self.owner[0].cache
        cache.append(x)  # a rebuild appends again and stacks a longer list
        return torch.tanh(self.lin(x + torch.stack(cache).mean(0)))


def cache_net(batch_size: int = 4) -> Any:
    torch.manual_seed(0)
    return CacheNet(), torch.randn(batch_size, 16), lambda m, b: m(b).pow(2).mean()


def chain(batch_size: int = 4) -> Any:
    THREADS_SEEN.append(torch.get_num_threads())
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 16))
                            for _ in range(3)))
    return model, torch.randn(batch_size, 16), lambda m, b: m(b).pow(2).mean()


def raising(batch_size: int = 4) -> Any:
    raise FileNotFoundError("weights.bin is missing")


def not_scalar(batch_size: int = 4) -> Any:
    model, batch, _ = chain(batch_size)
    return model, batch, lambda m, b: m(b)


def _err(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    lines = [line for line in err if "Warning" not in line and not line.startswith("  ")]
    assert len(lines) == 1, err
    assert "Traceback" not in "\n".join(err)
    return lines[0]


def test_auto_a_factory_that_raises_exits_3_naming_loading_the_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "auto.json"
    assert main(["auto", "--model", SPEC.format("raising"), *FAST, "--json", str(out)]) == 3
    err = _err(capsys)
    assert err.startswith("remat auto: error: loading the model: the model factory raised "
                          "FileNotFoundError: weights.bin is missing")
    data = json.loads(out.read_text())
    assert data["ok"] is False and data["model"] == SPEC.format("raising")
    assert data["error"]["stage"] == "loading the model"
    assert data["error"]["exit_code"] == 3
    assert "weights.bin is missing" in data["error"]["message"]


def test_profile_a_factory_that_raises_exits_3_naming_loading_the_model(
    capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["profile", "--model", SPEC.format("raising"), "--repeats", "1"]) == 3
    assert _err(capsys).startswith("remat profile: error: loading the model: the model "
                                   "factory raised FileNotFoundError")


@pytest.mark.parametrize("command", ["auto", "bench", "profile"])
def test_a_factory_file_whose_import_fails_exits_3_naming_loading_the_model(
    command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # a user's factory file that imports a package this environment lacks
    path = tmp_path / "needs_pkg.py"
    path.write_text("import remat_no_such_package\n\ndef factory():\n    return None\n")
    assert main([command, "--model", f"{path}:factory"]) == 3
    assert _err(capsys).startswith(
        f"remat {command}: error: loading the model: the model factory raised "
        "ModuleNotFoundError: No module named 'remat_no_such_package'")


def test_the_original_exception_stays_chained() -> None:
    with pytest.raises(remat.RematError) as info:
        remat.auto(raising, repeats=1)
    assert isinstance(info.value.__cause__, FileNotFoundError)
    assert info.value.stage == "loading the model"  # type: ignore[attr-defined]


@pytest.mark.parametrize("command", ["auto", "profile", "bench", "plan", "verify"])
def test_a_loss_that_is_not_a_scalar_exits_3_naming_the_first_training_step(
    command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    extra = {"auto": FAST, "profile": ["--repeats", "1"],
             "bench": ["--strategies", "none", "--budgets", "100%", "--microbatch-budget",
                       "off", "--repeats", "1"],
             "plan": ["--budget", "50%"], "verify": ["--plan", "per-stage"]}[command]
    assert main([command, "--model", SPEC.format("not_scalar"), *extra]) == 3
    err = _err(capsys)
    assert err.startswith(f"remat {command}: error: the first training step: loss_fn returned "
                          "a float32 tensor of shape (4, 16), not a scalar loss")


def _verify_hazard() -> str:
    model, batch, loss_fn = cache_net()
    report = remat.verify(model, batch, plans.per_stage(model), loss_fn, steps=1)
    assert report.blocking_hazards
    return report.blocking_hazards[0].message


@pytest.mark.parametrize("command", ["auto", "profile", "bench"])
def test_a_rebuild_torch_rejects_exits_1_with_the_hazard_verify_names(
    command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    extra = {"auto": [*FAST, "--json", str(tmp_path / "a.json")],
             "profile": ["--repeats", "1"],
             "bench": ["--strategies", "none", "--budgets", "100%", "--microbatch-budget",
                       "off", "--repeats", "1"]}[command]
    assert main([command, "--model", SPEC.format("cache_net"), *extra]) == 1
    err = _err(capsys)
    hazard = _verify_hazard()
    assert err.startswith(f"remat {command}: error: profiling: torch rejected the rebuild")
    assert hazard in err and "remat verify finds a control-flow hazard in stage" in err
    if command == "auto":
        error = json.loads((tmp_path / "a.json").read_text())["error"]
        assert error["stage"] == "profiling" and error["exit_code"] == 1
        assert hazard in error["message"]


def test_a_bench_row_whose_rebuild_torch_rejects_names_the_hazard_and_fails_the_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from remat.benchmarking import bench
    from remat.benchmarking.stopping import REJECTED
    from remat.cli.bench import _failed

    monkeypatch.setitem(CACHING, "on", False)  # profiling sees a clean model ...

    def progress(what: str, _done: int, _total: int) -> None:
        if what == "measuring per-stage":  # ... the per-stage row the cache-appending one
            CACHING["on"] = True

    report = bench(cache_net, strategies="none,per-stage", budgets="100%", repeats=1,
                   warmup=0, verify_steps=1, profile_repeats=1, matched=False,
                   microbatch_budget=None, progress=progress)
    row = next(r for r in report.rows if r.key == "per-stage")
    assert row.status == "failed" and (row.reason or "").startswith(REJECTED)
    assert _verify_hazard() in (row.reason or "")
    assert _failed(report) == [f"per-stage could not run: {row.reason}"]  # remat bench exits 1


def test_an_infeasible_budget_writes_the_minimum_budget_in_the_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "auto.json"
    assert main(["auto", "--model", SPEC.format("chain"), "--budget", "1%", *FAST,
                 "--json", str(out)]) == 1
    err = _err(capsys)
    error = json.loads(out.read_text())["error"]
    assert error["stage"] == "planning" and error["exit_code"] == 1
    least = error["minimum_budget_bytes"]
    assert isinstance(least, int) and f"({least} bytes" in error["message"]
    assert err == f"remat auto: error: planning: {error['message']}"


def test_a_bad_option_still_writes_the_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "auto.json"
    assert main(["auto", "--threads", "0", "--json", str(out)]) == 2
    assert "--threads 0 is below 1" in _err(capsys)
    error = json.loads(out.read_text())["error"]
    assert error == {"stage": "checking the options", "exit_code": 2,
                     "message": "--threads 0 is below 1; give 1 or more"}


def test_auto_refuses_a_profile_of_no_rounds_before_any_step(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "auto.json"
    assert main(["auto", "--profile-repeats", "0", "--json", str(out)]) == 2
    assert "profile_repeats=0 is invalid" in _err(capsys)
    assert json.loads(out.read_text())["error"]["stage"] == "checking the options"


def test_auto_threads_sets_torch_threads_for_the_run_and_restores_them(
    capsys: pytest.CaptureFixture[str]
) -> None:
    before = torch.get_num_threads()
    wanted = before + 1
    THREADS_SEEN.clear()
    assert main(["auto", "--model", SPEC.format("chain"), "--budget", "1%", *FAST,
                 "--threads", str(wanted)]) == 1  # stops at planning: enough to see it
    assert THREADS_SEEN and set(THREADS_SEEN) == {wanted}
    assert torch.get_num_threads() == before


# -- transformers' use_cache ---------------------------------------------------------------

def _hf(config_class: str, model_class: str, **fields: Any) -> Any:
    transformers = pytest.importorskip("transformers")
    config = getattr(transformers, config_class)(**fields)
    torch.manual_seed(0)
    model = getattr(transformers, model_class)(config).train()
    ids = torch.randint(0, 64, (2, 8))
    return model, {"input_ids": ids, "labels": ids.clone()}, lambda m, b: m(**b).loss


def neox(batch_size: int = 2) -> Any:  # GPTNeoXConfig: use_cache=True by default
    return _hf("GPTNeoXConfig", "GPTNeoXForCausalLM", vocab_size=64, hidden_size=32,
               num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
               max_position_embeddings=64)


def t5(batch_size: int = 2) -> Any:
    return _hf("T5Config", "T5ForConditionalGeneration", vocab_size=64, d_model=32, d_kv=8,
               d_ff=64, num_layers=2, num_heads=2, decoder_start_token_id=0)


def bert(batch_size: int = 2) -> Any:
    return _hf("BertConfig", "BertForMaskedLM", vocab_size=64, hidden_size=32,
               num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
               max_position_embeddings=64)


@pytest.fixture
def fresh_note(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(apply_module, "_NOTED", [])


def _notes(record: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in record if "use_cache" in str(w.message)]


def test_a_use_cache_model_is_profiled_with_the_cache_off_and_one_note(
    fresh_note: None, capsys: pytest.CaptureFixture[str]
) -> None:
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        assert main(["profile", "--model", SPEC.format("neox"), "--repeats", "1"]) == 0
    assert _notes(record) == [apply_module.USE_CACHE_NOTE]


def test_the_note_comes_once_however_many_models_a_run_builds(fresh_note: None) -> None:
    factory, _ = make_factory(t5)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        models = [factory(None) for _ in range(3)]
    assert len(_notes(record)) == 1
    model, batch, _ = models[0]
    # T5's stacks keep their own copies of the config: all are off, so no cache is built
    assert all(getattr(m.config, "use_cache", False) is False
               for m in model.modules() if hasattr(m, "config"))
    assert model(**batch).past_key_values is None


def test_encoder_only_bert_gets_no_note_and_keeps_its_config(fresh_note: None) -> None:
    factory, _ = make_factory(bert)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any warning fails the test
        model, batch, loss_fn = factory(None)
        assert model.config.use_cache is True  # untouched: it builds no cache
        handle = remat.apply(model, plans.per_stage(model))
        loss_fn(model, batch).backward()
        handle.remove()


def test_apply_warns_once_per_model_where_the_cache_is_built() -> None:
    model, _, _ = neox()
    plan = plans.per_stage(model)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for _ in range(3):
            remat.apply(model, plan).remove()
    assert len(_notes(record)) == 1 and "set model.config.use_cache = False" in _notes(record)[0]


def test_bench_exits_1_naming_a_remat_row_that_could_not_run(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import remat.benchmarking.bench_job as bench_run

    real = bench_run.check_plan

    def check_plan(factory: Any, plan: Any, **kwargs: Any) -> Any:
        if plan.regions:  # the per-stage row raises; the plain row runs
            raise RuntimeError("out of file handles")
        return real(factory, plan, **kwargs)

    monkeypatch.setattr(bench_run, "check_plan", check_plan)
    assert main(["bench", "--model", SPEC.format("chain"), "--strategies", "none,per-stage",
                 "--budgets", "100%", "--microbatch-budget", "off", "--no-matched",
                 "--repeats", "1", "--warmup", "0", "--profile-repeats", "1",
                 "--verify-steps", "1"]) == 1
    out = " ".join(capsys.readouterr().out.split())  # rich wraps long lines
    assert "check failed: per-stage could not run: RuntimeError: out of file handles" in out


def test_debug_and_remat_debug_add_the_traceback_to_the_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["profile", "--model", SPEC.format("raising"), "--repeats", "1"]
    for words, env in ((["--debug", *argv], None), ([*argv, "--debug"], None), (argv, "1")):
        if env:
            monkeypatch.setenv("REMAT_DEBUG", env)
        assert main(words) == 3
        err = capsys.readouterr().err
        assert "Traceback" in err and 'raise FileNotFoundError("weights.bin is missing")' in err
        assert err.strip().splitlines()[-1].startswith("remat profile: error: loading the model")
    monkeypatch.setenv("REMAT_DEBUG", "0")
    assert main(argv) == 3
    assert "Traceback" not in capsys.readouterr().err


def test_an_unexpected_error_is_one_line_exit_4(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import remat.cli.profile as profile_cli

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise KeyError("stages")  # a bug inside remat, not the user's doing

    monkeypatch.setattr(profile_cli, "profile_with_progress", broken)
    assert main(["profile", "--model", SPEC.format("chain"), "--repeats", "1"]) == 4
    line = _err(capsys)
    assert line.startswith("remat profile: unexpected error: KeyError: 'stages'; this is a bug")
    assert main(["--debug", "profile", "--model", SPEC.format("chain"), "--repeats", "1"]) == 4
    assert "Traceback" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["plan", "verify", "profile"])
def test_a_loss_fn_that_raises_exits_3_naming_the_first_training_step(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    extra = {"plan": ["--budget", "50%"], "verify": ["--plan", "per-stage"],
             "profile": ["--repeats", "1"]}[command]
    assert main([command, "--model", SPEC.format("loss_raises"), *extra]) == 3
    assert _err(capsys) == (
        f"remat {command}: error: the first training step: the model's forward, loss_fn or "
        "backward raised ValueError: bad label; fix them so that one plain training step runs "
        "(--debug shows the traceback)")


def test_verify_leaves_a_batchnorm_model_as_it_was_after_checking_the_first_step(
    capsys: pytest.CaptureFixture[str]
) -> None:
    model, _, _ = held_bn()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert main(["verify", "--model", SPEC.format("held_bn"), "--plan", "per-stage",
                 "--steps", "1"]) == 0
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # running stats too


_BN: dict[str, Any] = {}


def held_bn(batch_size: int = 4) -> Any:
    if not _BN:
        torch.manual_seed(0)
        _BN["model"] = nn.Sequential(*(nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8))
                                       for _ in range(3)))
        _BN["batch"] = torch.randn(batch_size, 8)
    return _BN["model"], _BN["batch"], lambda m, b: m(b).pow(2).mean()


def loss_raises(batch_size: int = 4) -> Any:
    model, batch, _ = chain(batch_size)

    def loss(m: nn.Module, b: torch.Tensor) -> torch.Tensor:
        raise ValueError("bad label")

    return model, batch, loss
