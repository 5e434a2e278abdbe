"""``remat.verify``: run a model with and without a plan from one state and compare everything.

The twins (``twins.py``) are one plain model and one with the plan applied. Step 1
compares the loss, the gradients of floating-point inputs and of every parameter; one SGD
and one AdamW step from those gradients compare every parameter after an update;
``steps`` steps of the chosen optimizer compare the trajectory (losses, final parameters
and buffers). Step 1 of the twin with the plan also runs the value check of rebuilt
tensors (``fingerprint.py``) and the hazard detectors (``hazards.py``); when step 1
disagrees, ``divergence.py`` says where the twins first parted.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from remat.core.errors import UsageError
from remat.core.plan_format import Plan
from remat.core.profile_format import OPTIMIZERS
from remat.measure.model_state import refuse_meta
from remat.measure.step import checked_loss, make_optimizer
from remat.runtime.compiled_stages import stages_compiled
from remat.runtime.identity import stage_module
from remat.runtime.install import Handle, apply, observe
from remat.runtime.stage_calls import stage_submodule
from remat.verification.compare import check_tensors
from remat.verification.divergence import StageRecords, first_divergence
from remat.verification.fingerprint import ValueCheck
from remat.verification.hazards import HazardProbe
from remat.verification.tolerance import TolerancePolicy, parse_tolerance
from remat.verification.twin_models import (
    LossFn,
    PlanLike,
    build_twins,
    cuda_devices,
    fresh_batch,
    resolve_plan,
    seeded,
)
from remat.verification.verify_report import (
    Check,
    Divergence,
    Hazard,
    ValueCheckResult,
    VerifyReport,
)

__all__ = ["verify"]


# -- running steps ----------------------------------------------------------------------


@dataclass(frozen=True)
class _Hooks:
    """What the step calls around its forward and backward (the hazard probe's seams)."""

    begin: Callable[[], None]
    before_backward: Callable[[], None]
    after_backward: Callable[[], None]


def _step(
    model: nn.Module,
    batch: Any,
    loss_fn: LossFn,
    hooks: _Hooks | None = None,
) -> torch.Tensor:
    if hooks is not None:
        hooks.begin()
    loss = checked_loss(model, batch, loss_fn)
    if hooks is not None:
        hooks.before_backward()
    loss.backward()
    if hooks is not None:
        hooks.after_backward()
    return loss.detach()


class _Observers:
    """Several stage observers as one (the runtime takes one)."""

    def __init__(self, *observers: Any) -> None:
        self._observers = observers

    def stage_started(self, stage: int, rebuild: bool, args: Any, kwargs: Any) -> None:
        for o in self._observers:
            o.stage_started(stage, rebuild, args, kwargs)

    def stage_finished(self, stage: int, rebuild: bool, output: Any) -> None:
        for o in reversed(self._observers):
            o.stage_finished(stage, rebuild, output)


def _named_params(model: nn.Module) -> dict[str, nn.Parameter]:
    return dict(model.named_parameters())


def _grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    return {
        n: None if p.grad is None else p.grad.detach().clone()
        for n, p in model.named_parameters()
        if p.requires_grad
    }


def _after_one_step(model: nn.Module, optimizer: str, lr: float) -> dict[str, torch.Tensor]:
    """Parameters after one ``optimizer`` step from the current gradients; then put back."""
    params = _named_params(model)
    saved = {n: p.detach().clone() for n, p in params.items()}
    opt = make_optimizer(model, optimizer, lr=lr)
    opt.step()
    after = {n: p.detach().clone() for n, p in params.items()}
    with torch.no_grad():
        for n, p in params.items():
            p.copy_(saved[n])
    return after


@contextlib.contextmanager
def _gradients_of(model: nn.Module, grads: dict[str, torch.Tensor | None]) -> Iterator[None]:
    """``model``'s parameters hold ``grads`` (another model's, by name) inside; then their own."""
    params = _named_params(model)
    own = {n: p.grad for n, p in params.items()}
    try:
        for n, p in params.items():
            g = grads.get(n)
            p.grad = None if g is None else g.detach().clone()
        yield
    finally:
        for n, p in params.items():
            p.grad = own[n]


# Note [Optimizer steps that amplify rounding]
# A plan's forward and backward on eager stages are the plain model's to the bit, so the
# twins' optimizer steps are too. A selective option compiled into a stage is another
# graph than the plain stage's (other fusions, other summation orders): its gradients
# agree within the dtype's tolerance, not to the bit, and Adam turns a rounding-sized
# difference in a gradient near its eps into a step of up to lr (a parameter of the
# compiled UNet moved 2.2e-5 apart at lr 1e-3 from gradients 3.6e-9 apart). Where a step
# comparison fails while the gradients agreed, the step is compared again as the twin's
# gradients would move the plain model: equal there, the difference is the optimizer's
# amplification of gradients already judged equal, and the check passes saying so;
# unequal, something besides the gradients differs (parameters, optimizer inputs) and it
# fails as before. The trajectory does the same in lockstep (Harness._lockstep).
_AMPLIFIED = ("; the {what} differ by up to {err:.2g} as the models stepped apart, and agree "
              "when the plain model steps on the planned one's gradients (which agree within "
              "the tolerance): {optimizer} amplifies their rounding (Note [Optimizer steps "
              "that amplify rounding])")


def _amplified(direct: Check, explained: Check, what: str, optimizer: str) -> Check:
    """``explained`` if it passed where ``direct`` failed, saying why; else ``direct``
    (naming what differs besides the gradients)."""
    if direct.passed:
        return direct
    if not explained.passed:
        return dataclasses.replace(direct, message=direct.message + (
            f"; not from the gradients alone: stepped on the planned model's gradients, the "
            f"plain model still differs, worst {explained.worst!r}"))
    return dataclasses.replace(explained, message=explained.message + _AMPLIFIED.format(
        what=what, err=direct.max_abs_error or 0.0, optimizer=optimizer))


def _state_refs(model: nn.Module) -> dict[str, torch.Tensor]:
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in _state_refs(model).items()}


def _put_back(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """The parameters and buffers of ``state`` again, and no gradients."""
    with torch.no_grad():
        own = _state_refs(model)
        for n, value in state.items():
            own[n].copy_(value)
    model.zero_grad(set_to_none=True)


# Note [A model that refuses a batch that requires grad]
# The input-gradients check gives the batch's floating-point tensors requires_grad. Some
# models cannot take that: wav2vec2's feature encoder sets ``requires_grad`` on a view
# of the waveform it gets, which torch allows only on a leaf ("you can only change
# requires_grad flags of leaf variables"). When the plain model's first step fails with
# such a batch, it is put back and run again on the batch as it is; if that step runs,
# the input-gradients check is skipped, saying why, and every other check compares the
# two runs as usual. A model that fails either way fails verify as before.


def _skipped(names: tuple[str, ...], reason: str) -> list[Check]:
    return [Check(n, "skip", reason) for n in names]


def verify(
    model_or_factory: nn.Module | Callable[[], Any],
    batch: Any,
    plan: PlanLike,
    loss_fn: LossFn | None = None,
    steps: int = 3,
    optimizer: str = "adamw",
    tolerance: object = "auto",
    *,
    seed: int = 0,
    lr: float = 1e-3,
    check_rebuilds: bool = True,
    preserve_rng_state: bool = True,
    force: bool = False,
) -> VerifyReport:
    """Prove that ``plan`` changes memory and time only, never the training.

    ``model_or_factory`` is a model (deep-copied twice and left as given) or a
    zero-argument factory returning a model or a ``(model, batch, loss_fn)`` triple
    (``batch`` and ``loss_fn`` may then be None). ``plan`` is a :class:`remat.Plan` or a
    builder such as ``remat.plans.per_stage``. ``loss_fn(model, batch)`` runs the forward
    and returns the scalar loss (default:
    :func:`remat.verification.twin_models.default_loss`). ``tolerance`` is ``"auto"`` (by
    dtype), ``"exact"`` or a number used as rtol and atol.

    ``check_rebuilds`` runs the value check and the hazard detectors in step 1;
    ``preserve_rng_state=False`` applies the plan with RNG preservation off, a debugging
    switch that shows verification catching the wrong dropout masks it causes.
    ``force=True`` applies a plan made for another model anyway (see ``remat.apply``).
    Returns a :class:`VerifyReport`; ``report.ok`` is True only when every check passed
    and no uncovered hazard was found.
    """
    start = time.perf_counter()
    policy = _checked_arguments(steps, optimizer, seed, lr, tolerance)
    plain, twin, batch, loss = build_twins(model_or_factory, batch, loss_fn, seed)
    resolved, compiled, handle = _applied(plan, plain, twin, batch,
                                          preserve_rng_state=preserve_rng_state, force=force)
    run = _Run(plain, twin, batch, loss, resolved, policy, seed, lr, cuda_devices())
    try:
        checks, hazards, divergence, values = run.all(
            steps, optimizer, handle,
            check_rebuilds=check_rebuilds and not compiled,
            preserve_rng_state=preserve_rng_state, compiled=compiled,
        )
    finally:
        handle.remove()
    return VerifyReport(
        checks=tuple(checks),
        hazards=hazards,
        first_divergence=divergence,
        value_check=values,
        steps=steps,
        optimizer=optimizer,
        tolerance=policy.describe(),
        seed=seed,
        preserve_rng_state=preserve_rng_state,
        plan_solver=resolved.solver,
        plan_regions=tuple(str(r) for r in resolved.regions),
        elapsed_s=time.perf_counter() - start,
    )


def _applied(
    plan: PlanLike, plain: nn.Module, twin: nn.Module, batch: Any, *,
    preserve_rng_state: bool, force: bool,
) -> tuple[Plan, bool, Handle]:
    """``plan`` resolved for ``twin`` and applied to it: the plan, whether its stages are
    compiled, and the handle that removes it."""
    refuse_meta(plain, batch, fake=False)
    resolved = resolve_plan(plan, twin)
    for path in resolved.stages:  # a plan for another model: one sentence, before anything
        stage_module(twin, resolved, path)
    # Compiled stages run as graphs: no op of theirs reaches a dispatch mode, so the value
    # check and the hazard probes (which would run them eagerly) are skipped, and the
    # steps are compared as compiled (docs/compile.md).
    compiled = stages_compiled(twin, resolved.stages)
    handle = apply(twin, resolved, preserve_rng_state=preserve_rng_state, force=force,
                   allow_compile_mismatch=True)
    return resolved, compiled, handle


def _checked_arguments(
    steps: int, optimizer: str, seed: int, lr: float, tolerance: object,
) -> TolerancePolicy:
    """The tolerance policy; UsageError on a ``steps``, ``optimizer``, ``seed``, ``lr`` or
    ``tolerance`` verify cannot take."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise UsageError(f"steps={steps!r} is invalid; give a whole number >= 1")
    if optimizer not in OPTIMIZERS:
        raise UsageError(f"optimizer {optimizer!r} is unknown; use one of {', '.join(OPTIMIZERS)}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise UsageError(f"seed={seed!r} is invalid; give a whole number")
    if not isinstance(lr, (int, float)) or isinstance(lr, bool) or not 0 < lr < math.inf:
        raise UsageError(f"lr={lr!r} is invalid; give a positive number")
    return parse_tolerance(tolerance)


@dataclass(frozen=True)
class _FirstSteps:
    """Step 1 of both twins: each loss (None where the step raised, with the error), the
    batch's leaves that required grad, and why the batch was given without grad, if it was
    (Note [A model that refuses a batch that requires grad])."""

    plain_loss: torch.Tensor | None
    plain_error: str | None
    plain_leaves: dict[str, torch.Tensor]
    twin_loss: torch.Tensor | None
    twin_error: str | None
    twin_leaves: dict[str, torch.Tensor]
    refused: str | None

    def failed(self) -> Check:
        """The "runs" check that says which step 1 raised."""
        failed = "; ".join(
            f"the {who} model's step 1 raised {error}"
            for who, error in (("plain", self.plain_error), ("planned", self.twin_error))
            if error is not None
        )
        return Check("runs", "error", failed)


@dataclass(eq=False)
class _Run:
    """One verification: the twins and everything their steps share."""

    plain: nn.Module
    twin: nn.Module
    batch: Any
    loss_fn: LossFn
    plan: Plan
    policy: TolerancePolicy
    seed: int
    lr: float
    devices: list[int]

    def all(
        self,
        steps: int,
        optimizer: str,
        handle: Handle,
        *,
        check_rebuilds: bool,
        preserve_rng_state: bool,
        compiled: bool = False,
    ) -> tuple[list[Check], tuple[Hazard, ...], Divergence | None, ValueCheckResult | None]:
        probe = value_check = None
        if check_rebuilds:
            probe = HazardProbe(self.twin, self.plan, preserve_rng_state=preserve_rng_state)
            value_check = ValueCheck(handle, tolerance=self.policy)
        names = self.plan.stages
        captures = (StageRecords.install(self.twin, names), StageRecords.install(self.plain, names))
        try:
            checks, divergence = self._compare(steps, optimizer, probe, value_check, captures)
        finally:
            for capture in captures:
                capture.close()
            if probe is not None:
                probe.close()
        values = None if value_check is None else value_check.result()
        hazards = (
            () if probe is None or value_check is None
            else probe.hazards(values, value_check.forward)
        )
        checks.append(self._values_check(values, check_rebuilds, compiled))
        return checks, hazards, divergence, values

    def _compare(
        self,
        steps: int,
        optimizer: str,
        probe: HazardProbe | None,
        value_check: ValueCheck | None,
        captures: tuple[StageRecords, StageRecords],
    ) -> tuple[list[Check], Divergence | None]:
        # the twins start from one state (build_twins): one copy for Harness._lockstep
        initial = _state(self.plain)
        first = self._first_steps(initial, probe, value_check)
        if first.plain_loss is None or first.twin_loss is None:
            return [first.failed(), *_skipped(_COMPARED, "step 1 failed")], None

        grads = (_grads(self.twin), _grads(self.plain))
        # Note [A model that is not finite on its own]
        plain_values = [("loss", first.plain_loss),
                        *((f"gradient of the batch's {k}", t.grad)
                          for k, t in first.plain_leaves.items()),
                        *((f"gradient of {n!r}", g) for n, g in grads[1].items())]
        checks = self._gradient_checks(first, grads)
        divergence = None
        if not all(c.passed for c in checks):
            divergence = first_divergence(
                *captures, grads, self._stage_parameters(), self.policy,
                None if value_check is None else value_check.result(),
            )
        checks += self._optimizer_step_checks(grads, grads_agree=checks[-1].passed)
        trajectory, runs, later = self._trajectory_checks(
            steps, optimizer, first.twin_loss, first.plain_loss, initial)
        checks += trajectory
        finite = _finite_check([*plain_values, *((f"step {t + 2} loss", loss)
                                                  for t, loss in enumerate(later))])
        return [runs, finite, *checks], divergence

    def _first_steps(
        self,
        initial: dict[str, torch.Tensor],
        probe: HazardProbe | None,
        value_check: ValueCheck | None,
    ) -> _FirstSteps:
        """Step 1 of the plain model, then of the twin (its probes watching), each on a fresh
        copy of the batch; a step that raises is recorded, not raised."""
        plain_batch, plain_leaves = fresh_batch(self.batch, grad=True)
        plain_loss, plain_error = _guarded(lambda: self._first_step(self.plain, plain_batch))
        refused = None  # Note [A model that refuses a batch that requires grad]
        if plain_loss is None and plain_leaves:
            _put_back(self.plain, initial)
            plain_batch, plain_leaves = fresh_batch(self.batch, grad=False)
            plain_loss, again = _guarded(lambda: self._first_step(self.plain, plain_batch))
            if plain_loss is None:
                plain_error = again
            else:
                refused = plain_error
        twin_batch, twin_leaves = fresh_batch(self.batch, grad=refused is None)
        twin_loss, twin_error = _guarded(
            lambda: self._first_step(self.twin, twin_batch, probe, value_check)
        )
        return _FirstSteps(plain_loss, plain_error, plain_leaves,
                           twin_loss, twin_error, twin_leaves, refused)

    def _gradient_checks(
        self,
        first: _FirstSteps,
        grads: tuple[dict[str, torch.Tensor | None], dict[str, torch.Tensor | None]],
    ) -> list[Check]:
        """Step 1's loss, input gradients and parameter gradients compared, in that order."""
        plain_leaves, twin_leaves = first.plain_leaves, first.twin_leaves
        checks = [check_tensors("loss", [("loss", first.twin_loss, first.plain_loss)],
                                self.policy)]
        if plain_leaves:
            checks.append(check_tensors(
                "input-gradients",
                [(k, twin_leaves[k].grad, plain_leaves[k].grad) for k in plain_leaves],
                self.policy, what="input gradients",
            ))
        elif first.refused is not None:
            checks.append(Check(
                "input-gradients", "skip",
                f"the model's step fails on a batch that requires grad ({first.refused}), so "
                "the batch was given as it is and only the other checks compare the runs"))
        else:
            checks.append(Check("input-gradients", "skip",
                                "the batch has no floating-point tensors"))
        checks.append(check_tensors(
            "parameter-gradients", [(n, grads[0].get(n), g) for n, g in grads[1].items()],
            self.policy, what="parameter gradients",
        ))
        return checks

    def _optimizer_step_checks(
        self,
        grads: tuple[dict[str, torch.Tensor | None], dict[str, torch.Tensor | None]],
        *,
        grads_agree: bool,
    ) -> list[Check]:
        """One SGD and one AdamW step from step 1's gradients, the parameters compared (each
        model put back after)."""
        checks = []
        for name in ("sgd", "adamw"):
            ours = _after_one_step(self.twin, name, self.lr)
            theirs = _after_one_step(self.plain, name, self.lr)
            check = check_tensors(
                f"{name}-step", [(n, ours[n], t) for n, t in theirs.items()], self.policy,
                what="parameters",
            )
            if not check.passed and grads_agree:  # Note [Optimizer steps that amplify rounding]
                with _gradients_of(self.plain, grads[0]):
                    stepped = _after_one_step(self.plain, name, self.lr)
                check = _amplified(check, check_tensors(
                    f"{name}-step", [(n, ours[n], t) for n, t in stepped.items()],
                    self.policy, what="parameters"), "parameters", name)
            checks.append(check)
        return checks

    def _trajectory_checks(
        self, steps: int, optimizer: str, twin_loss: torch.Tensor, plain_loss: torch.Tensor,
        initial: dict[str, torch.Tensor],
    ) -> tuple[list[Check], Check, list[torch.Tensor]]:
        """The trajectory's checks (an error if a later step raised), the "runs" check, and
        the plain model's losses after step 1."""
        trajectory, error = _guarded(
            lambda: self._trajectory(steps, optimizer, twin_loss, plain_loss, initial)
        )
        if trajectory is None:
            return [
                Check("trajectory-losses", "error", f"a later step raised {error}"),
                Check("trajectory-parameters", "skip", "a later step failed"),
            ], Check("runs", "pass", "both models ran step 1"), []
        return (trajectory[0], Check("runs", "pass", f"both models ran {steps} training step(s)"),
                trajectory[1])

    def _first_step(
        self,
        model: nn.Module,
        batch: Any,
        probe: HazardProbe | None = None,
        value_check: ValueCheck | None = None,
    ) -> torch.Tensor:
        with contextlib.ExitStack() as stack:
            stack.enter_context(seeded(self.seed, self.devices))
            hooks = None
            if probe is not None and value_check is not None:
                stack.enter_context(observe(model, _Observers(probe, value_check)))
                stack.enter_context(value_check.recording())
                hooks = _Hooks(probe.begin_step, probe.before_backward, probe.after_backward)
            return _step(model, batch, self.loss_fn, hooks)

    def _trajectory(
        self, steps: int, optimizer: str, twin_loss: torch.Tensor, plain_loss: torch.Tensor,
        initial: dict[str, torch.Tensor],
    ) -> tuple[list[Check], list[torch.Tensor]]:
        """Step 1's gradients, then ``steps - 1`` more steps, all with one ``optimizer``;
        the checks, and the plain model's losses after step 1."""
        losses: tuple[list[torch.Tensor], list[torch.Tensor]] = ([twin_loss], [plain_loss])
        models = (self.twin, self.plain)
        opts = [make_optimizer(m, optimizer, lr=self.lr) for m in models]
        for opt in opts:
            opt.step()
        for t in range(1, steps):
            for k, (model, opt) in enumerate(zip(models, opts, strict=True)):
                opt.zero_grad(set_to_none=True)
                batch, _ = fresh_batch(self.batch, grad=False)
                with seeded(self.seed + t, self.devices):
                    losses[k].append(_step(model, batch, self.loss_fn))
                opt.step()
        for model in models:
            model.zero_grad(set_to_none=True)
        ours, theirs = _state(self.twin), _state(self.plain)
        what = f"parameters and buffers after {steps} {optimizer} step(s)"
        checks = [
            check_tensors(
                "trajectory-losses",
                [(f"step {t + 1} loss", a, b)
                 for t, (a, b) in enumerate(zip(*losses, strict=True))],
                self.policy, what="losses",
            ),
            check_tensors(
                "trajectory-parameters", [(n, ours.get(n), t) for n, t in theirs.items()],
                self.policy, what=what,
            ),
        ]
        if checks[0].passed and not checks[1].passed:
            checks[1] = _amplified(
                checks[1], self._lockstep(steps, optimizer, initial, what),
                "parameters", optimizer)
        return checks, losses[1][1:]

    def _lockstep(
        self, steps: int, optimizer: str,
        initial: dict[str, torch.Tensor], what: str,
    ) -> Check:
        """The trajectory again from the first state, the plain model stepping on the twin's
        gradients (Note [Optimizer steps that amplify rounding]): fails where a step's
        gradients differ beyond the tolerance, or the parameters and buffers at the end."""
        models = (self.twin, self.plain)
        for model in models:
            _put_back(model, initial)
        opts = [make_optimizer(m, optimizer, lr=self.lr) for m in models]
        for t in range(steps):
            for model, opt in zip(models, opts, strict=True):
                opt.zero_grad(set_to_none=True)
                batch, _ = fresh_batch(self.batch, grad=False)
                with seeded(self.seed + t, self.devices):
                    _step(model, batch, self.loss_fn)
            grads = (_grads(self.twin), _grads(self.plain))
            agree = check_tensors(
                "trajectory-parameters",
                [(n, grads[0].get(n), g) for n, g in grads[1].items()], self.policy,
                what=f"parameter gradients of step {t + 1}")
            if not agree.passed:
                return agree
            with _gradients_of(self.plain, grads[0]):
                opts[1].step()
            opts[0].step()
        for model in models:
            model.zero_grad(set_to_none=True)
        ours, theirs = _state(self.twin), _state(self.plain)
        return check_tensors(
            "trajectory-parameters", [(n, ours.get(n), t) for n, t in theirs.items()],
            self.policy, what=what)

    def _stage_parameters(self) -> list[list[str]]:
        """Each stage's parameters under their model-level names (tied ones appear once)."""
        names = {id(p): n for n, p in self.twin.named_parameters()}
        return [
            [names[id(p)] for p in stage_submodule(self.twin, stage).parameters()
             if id(p) in names]
            for stage in self.plan.stages
        ]

    @staticmethod
    def _values_check(
        values: ValueCheckResult | None, check_rebuilds: bool, compiled: bool = False
    ) -> Check:
        if values is None:
            reason = (
                "not possible on compiled stages (their ops run inside graphs); the steps "
                "are compared" if compiled
                else "turned off (check_rebuilds=False)" if not check_rebuilds
                else "step 1 failed"
            )
            return Check("rebuilt-values", "skip", reason)
        if values.rebuilt_calls == 0:
            return Check("rebuilt-values", "skip", "the plan rebuilds nothing in this step")
        first = values.first
        skipped = ""
        if values.outputs_skipped:  # Note [What backward reads] in fingerprint.py
            skipped = (
                f"; {values.outputs_skipped} output(s) skipped: not read by backward as values "
                f"({', '.join(values.skipped_outputs)} differed, and no later op reads "
                f"{'it' if len(values.skipped_outputs) == 1 else 'them'}: a kernel's workspace "
                "or state only its own op's backward keeps)"
            )
        if first is None:
            return Check(
                "rebuilt-values", "pass",
                f"{values.ops_compared} ops of {values.rebuilt_calls} rebuilt stage call(s) "
                f"match their forward fingerprints{skipped}",
                compared=values.ops_compared, tolerance="checksums",
            )
        return Check(
            "rebuilt-values", "fail",
            f"{len(values.mismatches)} stage(s) rebuilt other values; first: {first.message}"
            f"{skipped}",
            compared=values.ops_compared,
            max_abs_error=first.max_abs_error,
            max_rel_error=first.max_rel_error,
            worst=f"{first.stage} op {first.op_index} {first.rebuilt_op}",
            tolerance="checksums",
        )


_COMPARED = (
    "finite", "loss", "input-gradients", "parameter-gradients", "sgd-step", "adamw-step",
    "trajectory-losses", "trajectory-parameters",
)


# Note [A model that is not finite on its own]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# The checks compare the model with the plan against the plain model, and NaN in the same
# place on both sides compares equal (a model that is NaN anyway is not made worse by a
# plan). A model whose own loss or gradients are NaN or infinite would so pass every
# check while proving nothing: any plan, right or wrong, gives NaN there too. So the
# plain model's loss (each step's), input gradients and parameter gradients must be
# finite, or the "finite" check fails and says the comparison cannot tell; values that
# are not finite only with the plan fail the comparisons themselves, as any difference.


def _finite_check(named: Iterable[tuple[str, torch.Tensor | None]]) -> Check:
    """Fails, naming the first, where one of the plain model's tensors is not finite
    (``named``: what each is, as the message says it, and the tensor)."""
    count = 0
    for name, t in named:
        if t is None or not (t.is_floating_point() or t.is_complex()):
            continue
        count += 1
        bad = ~torch.isfinite(t.detach())
        if bool(bad.any()):
            value = "NaN" if bool(t.detach().isnan().any()) else "infinite"
            return Check("finite", "fail",
                         f"the model's own {name} is {value} without any plan, so verify "
                         "cannot tell equal from unequal; fix the model, its loss or its "
                         "inputs first", compared=count, worst=name)
    return Check("finite", "pass", f"the plain model's {count} losses and gradients are "
                 "finite", compared=count)


def _guarded(fn: Callable[[], Any]) -> tuple[Any, str | None]:
    """``fn()``, or None and the error: a failing step is a finding, a usage error is not."""
    try:
        return fn(), None
    except UsageError:
        raise
    except Exception as err:
        return None, f"{type(err).__name__}: {err}"
