"""Mixed precision (bf16 or fp16 autocast, TF32), opt-in with ``--precision``, checked on the run
before it is kept and watched after.

Why: autocast runs matrix products in bf16 or fp16 on tensor cores and Gaudi's MME, and TF32 runs
float32 matmuls on Ampere's tensor cores: the largest single speed-ups in both guides. All change numerics,
so nothing happens unless the user asks, and what is asked is checked on the user's own steps:

- the guard, before anything changes: on ``GUARD_CHECKS`` forward/backward pairs of the user's run
  (which itself stays in float32), a copy of the training model runs the same forward twice, in
  float32 and in the candidate precision, with the same inputs and random draws, and backpropagates
  the gradient the user's loss gave the real output. Outputs, the first-order loss change and the
  gradients must agree within ``BOUNDS``, or the precision is not used;
- ``auto`` then also runs a speed trial and keeps it only when it measured faster;
- the watch, once on: losses are checked for NaN/Inf and spikes against the run's float32 losses
  (read every ``WATCH_EVERY`` backward passes: no host read per step); on either, the run goes back
  to float32 from that step on.

Mechanism (:func:`autocast_call`): the precision layer of the training model's call route
(:mod:`autogaudi.watch.model_call`, nothing of it travels with the model) runs the call under autocast and
hands low-precision outputs back as float32, as accelerate's ``convert_outputs_to_fp32`` does: the
user's loss and backward run as in the float32 script. The guard sees the training forwards through
the route's observe layer. Parameters, optimizer state and checkpoints stay float32. fp16, whose
range is narrow enough for small gradients to underflow, adds loss scaling (:class:`LossScale`) that
the script does not see. The measured story and what the guard cannot promise:
docs/units/mixed_precision.md.
"""

from __future__ import annotations

import contextlib
import math
import time

import torch

from autogaudi.core.candidate import Candidate, DecidesCandidate
from autogaudi.core.events import Event
from autogaudi.core.unit import PRECISION
from autogaudi.measure import numerics
from autogaudi.measure.trials import median
from autogaudi.optimizations.mixed_precision.guard import (
    Guard,
    autocast_call,
    within_bounds,
)
from autogaudi.optimizations.mixed_precision.loss_scale import SKIPS_IN_A_ROW, LossScale
from autogaudi.optimizations.step_profiler.unit import FP32_MATRIX_SHARE
from autogaudi.watch.engines import fsdp2_managed
from autogaudi.watch.model_call import Layer, compiled_by_the_script

GUARD_CHECKS = 3  # forward/backward pairs compared before a precision is used
GUARD_PATIENCE = 30  # backward passes the guard waits for them; after that the precision is not used
WATCH_EVERY = 10  # backward passes between host reads of the watched losses
SPIKE = 4.0  # a loss this many times the median of the run's recent losses is a spike
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
GUARD_SCALES = (2.0**16, 2.0**12, 2.0**8, 2.0**4, 1.0)  # the fp16 shadow step's loss scales, until finite


def chosen_precision(asked: str, has_bf16: bool) -> str:
    """The precision a run asking for ``asked`` gets: as asked, and for ``auto`` bf16 where the
    device has it (CPU, Gaudi, CUDA from compute capability 8.0), else fp16 with loss scaling."""
    if asked != "auto":
        return asked
    return "bf16" if has_bf16 else "fp16"


def set_tf32(on: bool) -> tuple:
    """Set CUDA's TF32 switches for matmuls and cuDNN; return what they were (for :func:`restore_tf32`)."""
    matmul, cudnn = torch.backends.cuda.matmul, torch.backends.cudnn
    before = matmul.allow_tf32, cudnn.allow_tf32
    matmul.allow_tf32 = cudnn.allow_tf32 = on
    return before


def restore_tf32(before: tuple) -> None:
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


@contextlib.contextmanager
def tf32(on: bool):
    """CUDA's TF32 switches set to ``on`` inside, put back after."""
    before = set_tf32(on)
    try:
        yield
    finally:
        restore_tf32(before)


class MixedPrecision(DecidesCandidate):
    spec = DecidesCandidate.spec.but(
        numerics=(PRECISION,),
        reasons={
            "no_bf16": "this GPU has no bf16 (compute capability < 8.0): --precision fp16 runs fp16 with loss scaling",
            "no_fp16": "Gaudi's autocast is documented for bf16 (its op lists are bf16/float32): --precision bf16",
            "script_scaler": "stepped aside: the script scales its loss itself (GradScaler)",
            "script_low_precision": "stepped aside: {share:.0%} of the step's matrix products already run below "
            "float32 "
            "(the script's own autocast or model dtype)",
            "script_tf32": "stepped aside: the script already switched TF32 on",
            "compiled_by_script": "stepped aside: the script compiles the model (torch.compile); autocast it inside "
            "the compiled model's forward instead",
            "no_matrix_products": "nothing to speed up: the step runs no matrix products",
            "fsdp2": "stepped aside: FSDP2 shards this model (its copy for the guard cannot be made); give fully_shard "
            "mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) instead",
            "no_copy": "not checked, so not used: the model could not be copied for the guard ({error})",
            "not_checked": "not used: in {passes} backward passes the model's outputs never got the gradient of a "
            "loss the guard could compare against",
            "checking": "{precision}: checking {checks} steps against float32 on a copy of the model",
            "guard_failed": "not used: {precision} differed from float32 beyond the bounds ({outside})",
            "on": "{model} forward in {precision}, checked against float32",
            "trial_running": "{precision} checked; trial running on {model}",
            "measured_faster": "{model} forward in {precision}: checked, and measured faster",
            "rejected": "float32 kept: {precision} was checked but not faster in the trial",
            "fell_back": "back to float32 from training step {step}: {what}",
            "losses_read_every": "losses are read every {every} backward passes: the steps between the bad loss "
            "and its "
            "read ran in {precision}",
        },
        targets=("torch.amp.GradScaler.scale",),  # only seen: a script that scales its loss keeps fp16 off
        states=("watching", "checking", "in_use", "trial", "kept", "rejected", "failed", "disabled"),
        acts_on=(
            "<training model> call route: precision layer (autocast, float32 outputs), observe layer while checked",
            "CUDA TF32 switches (torch.backends.cuda.matmul / cudnn allow_tf32), --precision tf32",
            "losses before each backward (the session's step watcher), watched for NaN/Inf and spikes",
            "fp16: a hook on each backpropagated tensor and every gradient before and after each backward "
            "(loss scaling), before and after each optimizer step (the step watcher's; steps skipped on overflow)",
        ),
    )

    def skip_reason(self):
        reason = super().skip_reason()
        if reason is not None:
            return reason
        precision = self.run.options.precision
        if precision == "tf32" and self.run.backend.name != "cuda":
            why = ": TF32 is a matmul mode of CUDA devices (Ampere and later)"
            return self.report.reason_for("other_backend", backends="cuda", backend=self.run.backend.name, why=why)
        if precision == "bf16" and self.run.backend.name == "cuda" and not torch.cuda.is_bf16_supported():
            return self.report.reason_for("no_bf16")
        if self.run.backend.name == "hpu" and self._chosen() == "fp16":
            return self.report.reason_for("no_fp16")
        return None

    def _chosen(self) -> str:
        has_bf16 = self.run.backend.name != "cuda" or torch.cuda.is_bf16_supported()
        return chosen_precision(self.run.options.precision, has_bf16)

    def apply(self) -> None:
        self._precision = self._chosen()
        self.candidate = Candidate(
            self, self._set_up, self._switch, self._params, codes={"forced": "on", "no_trials": "on"},
            try_again=self._try_again,
        )  # fmt: skip
        self.candidate.needs_trial = self.run.options.precision == "auto"  # asked for by name: on once checked
        self._guard = None  # checking on a copy of the model, before the precision may switch on
        self._guarding = None  # the guard's hooks and listeners, closed once it decided
        self._loss_scale = None  # fp16, while it is a candidate
        self._scaled_key, self._scaled = None, []  # what _scaled_parameters found, and for which optimizers
        self._tf32_before = None  # TF32 switches as they were, while tf32 is on
        self._losses: list = []  # watched loss tensors since the last read
        self._history: list = []  # losses read so far (the guard's float32 ones first)
        self._remembered = None  # auto: the speed trial of an earlier run with this set-up, model and inputs
        self._script_scales = False
        self.scope.wrap(torch.amp.GradScaler, "scale", self._seen_scaling)
        self.report.because("waiting_for_profile")
        self.scope.on(Event.STEP_PROFILED, self._profiled)

    def _params(self) -> dict:
        return {"precision": self._precision, "model": type(self.candidate.model).__name__}

    def _seen_scaling(self, wrapped, instance, args, kwargs):
        if instance.is_enabled() and not self._script_scales:
            self._script_scales = True
            if self._loss_scale is not None and self.candidate.on:  # scaled twice: the script's scaler stays
                self._fall_back("the script began scaling its loss itself (GradScaler)")
            elif self._loss_scale is not None:  # still being checked or tried
                self.run.trials.cancel(self)
                self.candidate.release("script_scaler")
        return wrapped(*args, **kwargs)

    def changes(self) -> list:
        if not self.in_use():
            return []
        checked = f"checked against float32 (one-off {self.report.figures['guard_s']} s)"
        scaled = " with loss scaling" if self._loss_scale is not None else ""
        model = type(self.candidate.model).__name__
        return [f"{model} in {self._precision}{scaled}, {checked}{self.trial_speedup()}"]

    def _refusal(self, profile):
        if profile.model is None:
            return self.report.reason_for("no_training_model")
        share = profile.measured.fp32_matrix_fraction
        if share is None:
            return self.report.reason_for("no_matrix_products")
        if share < FP32_MATRIX_SHARE:  # the script already runs its matrix products below float32
            return self.report.reason_for("script_low_precision", share=1 - share)
        if self._precision == "tf32" and torch.backends.cuda.matmul.allow_tf32:
            return self.report.reason_for("script_tf32")
        if self._precision == "fp16" and self._script_scales:
            return self.report.reason_for("script_scaler")
        if fsdp2_managed(profile.model):
            return self.report.reason_for("fsdp2")
        if self._precision != "tf32" and compiled_by_the_script(profile.model):
            return self.report.reason_for("compiled_by_script")  # hooks added under its graphs would recompile them
        return None

    def _profiled(self, profile, recall: bool = True) -> None:
        refusal = self._refusal(profile)
        if refusal:
            self.candidate.refuse(refusal)
            return
        self._remembered = (
            self.run.recalled_trial(self.name) if recall and self.run.options.precision == "auto" else None
        )
        if self._remembered is not None and self._remembered["decision"] != "kept":
            # Not faster in an earlier run with this set-up, model and inputs: no guard, nothing set up;
            # where this run's steps differ from that trial's, it is checked and tried after all.
            self.candidate.follow(self._remembered, profile)
            return
        device_type = self.run.backend.device_type
        if self._precision == "tf32":
            reference, candidate = (lambda: tf32(False)), (lambda: tf32(True))
        else:
            dtype = DTYPES[self._precision]
            reference, candidate = contextlib.nullcontext, (lambda: torch.autocast(device_type, dtype=dtype))
        scales = GUARD_SCALES if self._precision == "fp16" else (1.0,)
        started = time.perf_counter()
        try:
            guard = Guard(profile.model, candidate, reference, device_type, scales, self.run.steps.unseen)
        except Exception as error:  # a model deepcopy refuses (an open file, a lock)
            self.candidate.refuse(self.report.reason_for("no_copy", error=repr(error)))
            return
        self._guard = guard
        self.candidate.set_up(profile)
        self.candidate.checking()
        guard.seconds += time.perf_counter() - started
        self.report.because("checking", precision=self._precision, checks=GUARD_CHECKS)

    def _set_up(self, scope) -> None:
        """The precision layer, fp16's loss scaling, and the guard's observe layer and listeners (a
        scope of their own, closed once it decided)."""
        model = self.candidate.model
        scope.add(self._forget)
        scope.hold(model, Layer.PRECISION, self._in_precision)
        if self._precision == "fp16":
            device = next((p.device for p in model.parameters()), torch.device(self.run.backend.device_type))
            self._loss_scale = LossScale(self._scaled_parameters, device, lambda: self.candidate.on, self._overflowing)
            self._loss_scale.install(scope)
        self._guarding = scope.child()
        # The shadow steps on a copy are work inside the user's steps: no measurement times those steps.
        self.run.windows.take(self)
        self._guarding.add(lambda: self.run.windows.release(self))
        self._guarding.hold(model, Layer.OBSERVE, self._guard_forward)
        self._guarding.on(Event.BEFORE_BACKWARD, self._guard_loss)
        self._guarding.on(Event.AFTER_BACKWARD, self._guard_check)

    def _forget(self) -> None:
        """The candidate undone: nothing of it kept (its guard, loss scaling, the parameters it scaled)."""
        self._guard = self._guarding = self._loss_scale = None
        self._scaled_key, self._scaled = None, []

    def _try_again(self) -> None:
        """A remembered decision's check differed: checked by the guard first where nothing was set
        up (a remembered rejection), else tried at once."""
        if self.candidate.scope is None:
            self._profiled(self.candidate.profile, recall=False)
        else:
            self.candidate.try_()

    def _scaled_parameters(self) -> list:
        """The parameters whose gradients a scaled backward may write: the training model's and every
        optimizer's (a head or a second model outside the forward), each once; rebuilt when an
        optimizer or a parameter group is added."""
        optimizers = list(self.run.steps.optimizers)
        key = tuple((id(o), len(o.param_groups), sum(len(g["params"]) for g in o.param_groups)) for o in optimizers)
        if self._scaled_key != key:
            groups = [group["params"] for optimizer in optimizers for group in optimizer.param_groups]
            everything = [*self.candidate.model.parameters(), *(p for params in groups for p in params)]
            self._scaled = list({id(p): p for p in everything if p.requires_grad}.values())
            self._scaled_key = key
        return self._scaled

    def _overflowing(self, skipped: int) -> None:
        self.report.figures["skipped_steps"] = skipped
        self._fall_back(f"{SKIPS_IN_A_ROW} optimizer steps in a row had inf/NaN gradients ({skipped} skipped in all)")

    def _in_precision(self, call, args, kwargs):
        """The precision layer: autocast while on (TF32 is a process-wide switch: nothing per call)."""
        if self.candidate.on and self._precision in DTYPES:
            return autocast_call(call, args, kwargs, self.run.backend.device_type, DTYPES[self._precision])
        return call(*args, **kwargs)

    def _guard_forward(self, call, args, kwargs):
        """The observe layer while the guard checks: the training forwards' inputs, and the gradients
        their outputs get."""
        training = self.candidate.model.training and torch.is_grad_enabled()
        if training:
            self._guard.before_forward(args, kwargs)
        output = call(*args, **kwargs)
        if training and self._guard.pending:
            for tensor, keep in self._guard.after_forward(output):
                self._guarding.hook(tensor.register_hook, keep)
        return output

    def _guard_loss(self, tensors) -> None:
        if isinstance(tensors, torch.Tensor) and tensors.numel() == 1:
            self._guard.loss = float(tensors.detach())
            self._history.append(self._guard.loss)

    def _guard_check(self) -> None:
        self.run.windows.take(self)  # still checking: the hold stays fresh
        self._guard.check()
        if len(self._guard.figures) >= GUARD_CHECKS:
            self._guarded()
        elif self._guard.backward_passes >= GUARD_PATIENCE:
            self.candidate.release("not_checked", passes=GUARD_PATIENCE)

    def _guarded(self) -> None:
        guard, guarding, self._guard, self._guarding = self._guard, self._guarding, None, None
        guarding.close()
        checks = guard.figures
        self.report.figures.update(
            guard_checks=len(checks),
            guard_output_error=round(max(f["output_error"] for f in checks), 5),
            guard_loss_change=round(max(f["loss_change"] for f in checks), 5),
            guard_grad_norm_ratio=round(max((f["grad_norm_ratio"] for f in checks), key=lambda r: abs(r - 1)), 5),
            guard_grad_cosine=round(min(f["grad_cosine"] for f in checks), 5),
            guard_s=round(guard.seconds, 3),
            numerics_measured=numerics.measured(
                max(f["output_error"] for f in checks),
                of="outputs",
                steps=len(checks),
                against="float32 on a copy of the model",
            ),
        )
        outside = sorted({name for figures in checks for name in within_bounds(figures)})
        if outside:
            self.candidate.release("guard_failed", precision=self._precision, outside=", ".join(outside))
        else:
            self._use()

    def _use(self) -> None:
        """Checked: on now (``bf16``, ``tf32``), or through a speed trial (``auto``: the trial of an
        earlier run with the same set-up, model and inputs where there is one; the guard above runs in
        every run, since numerics depend on this run's weights); watched from here."""
        self.candidate.scope.on(Event.BEFORE_BACKWARD, self._watch)
        if self._remembered is not None:
            self.candidate.follow(self._remembered)
        else:
            self.candidate.try_()

    def _switch(self, on: bool) -> None:
        """TF32 is a process-wide switch; autocast is the precision layer's, per call."""
        if self._precision == "tf32" and on:
            self._tf32_before = set_tf32(True)
        elif self._precision == "tf32":
            restore_tf32(self._tf32_before)

    def _watch(self, tensors) -> None:
        """Keep each loss on the device; every WATCH_EVERY, read them at once and fall back to
        float32 on a NaN/Inf or a spike."""
        if not self.candidate.on or not isinstance(tensors, torch.Tensor) or tensors.numel() != 1:
            return
        self._losses.append(tensors.detach().reshape(()).float())
        if len(self._losses) < WATCH_EVERY:
            return
        if self._loss_scale is not None:  # read with the losses: no host read of its own
            self._losses.append(self._loss_scale.scale.to(self._losses[0].device))
        values, self._losses = torch.stack(self._losses).tolist(), []
        if self._loss_scale is not None:
            self.report.figures.update(loss_scale=values.pop(), skipped_steps=self._loss_scale.skipped)
        for value in values:
            trend = median(self._history[-50:]) if len(self._history) >= 5 else None
            if not math.isfinite(value):
                return self._fall_back(f"a {value} loss")
            if trend is not None and trend > 0 and value > SPIKE * trend:
                return self._fall_back(f"a loss of {value:.4g}, {value / trend:.1f}x the median of the last losses")
            self._history.append(value)
        self.report.figures["losses_watched"] = self.report.figures.get("losses_watched", 0) + len(values)

    def _fall_back(self, what: str) -> None:
        step = self.run.steps.steps
        self.run.trials.cancel(self)
        self.report.figures["fell_back_at_step"] = step
        self.report.moment("fell_back")
        self.report.note("losses_read_every", every=WATCH_EVERY, precision=self._precision)
        self.candidate.release("fell_back", step=step, what=what)
