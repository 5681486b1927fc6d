"""Graph capture for the training model, only when the step profiler measured the run host-bound,
and kept only when a trial measured it faster on this very run.

Why: a host-bound step spends its time issuing ops one by one; a captured graph replays the whole
forward (and, compiled, the backward) at once. Both the Gaudi guide's HPU graphs and torch's CUDA
graphs target exactly that case and do nothing for a device-bound step except cost compile time.
Backend mapping: :meth:`Backend.graph_forward`.

How: calls of the model that owns most of the optimizer's parameters (a DDP model's inner module)
run through the capture layer of the model's call route (:mod:`autogaudi.watch.model_call`), which
``torch.save``, ``pickle`` and ``copy.deepcopy`` drop: a saved model is a plain one. The gates (:meth:`_refusal`:
not host-bound, compiled by the script, outputs a replay would overwrite, a forward deciding on a
device value (HPU lazy), HPU graphs' gradient rules; :meth:`_too_short`: a run too short to pay back
this model's estimated one-off; under the defaults, any trial: it would change the numbers) each give a reason code;
a capture not kept is released with every reference; an exception from the captured call re-runs
the call eagerly and switches capture off; past ``MAX_SHAPES`` input shapes it switches off. The
rules, their measurements and what each figure means: docs/units/graph_capture.md.
"""

from __future__ import annotations

import time

import torch
import torch.utils.checkpoint
import wrapt

from autogaudi.core.candidate import Candidate, DecidesCandidate
from autogaudi.core.events import Event
from autogaudi.core.unit import RANDOM, ROUNDING
from autogaudi.entry.paths import short_location
from autogaudi.entry.ranks import rank_zero_choice
from autogaudi.measure import numerics
from autogaudi.optimizations.graph_capture.captured_call import CapturedCall, own_gradient_tensors
from autogaudi.watch.model_call import Layer, compiled_by_the_script, holder

# What the unit reads once the step is profiled: loaded then, so a run that is never profiled skips them.
one_offs = wrapt.lazy_import("autogaudi.measure.one_offs")
compile_counts = wrapt.lazy_import("autogaudi.optimizations.graph_capture.compile_counts")
host_reads = wrapt.lazy_import("autogaudi.optimizations.graph_capture.host_reads")
engines = wrapt.lazy_import("autogaudi.watch.engines")
run_length = wrapt.lazy_import("autogaudi.watch.run_length")

# What capture costs once, each measured where it happens: setting it up (importing the compiler
# included), the trial's warm-up beyond its steady steps, compiles for input shapes met later,
# and shutting down the compile workers it started, at exit.
ONE_OFF_PARTS = ("set_up_s", "warm_up_s", "later_compiles_s", "compile_workers_at_exit_s")


def uses_gradient_checkpointing(module) -> bool:
    """Hugging Face models say so with a ``gradient_checkpointing`` flag on the checkpointed modules."""
    return any(getattr(sub, "gradient_checkpointing", False) is True for sub in module.modules())


def _saved_per_step_s(profile) -> float:
    """The most a capture could save per step: every part of it that is not the ops computing."""
    return max(1e-9, profile.measured.ms_per_step / 1000 * (1 - profile.measured.compute_fraction))


class GraphCapture(CapturedCall, DecidesCandidate):
    spec = DecidesCandidate.spec.but(
        # Compiled kernels fuse and reorder; compiled dropout draws other masks (--exact-random: the same
        # masks, still not the same rounding). A rejected trial ran its steps captured.
        numerics=(ROUNDING, RANDOM),
        after=("mixed_precision",),  # decides first on a profile: a model it holds is not captured
        acts_for_device=True,
        reasons={
            "too_short": "not tried: {steps} steps left ({source}) could save at most {most:.2f} s, less than the "
            "{estimate:.1f} s (likely {low:.1f}-{high:.1f} s) a capture of {model} is estimated to cost on {backend} "
            "({basis})",
            "not_host_bound": "not captured: the step profile reads {bound} ({why})",
            "compiled_by_script": "stepped aside: the script (or its framework) already compiles the model with "
            "torch.compile",
            "fsdp2": "not captured: FSDP2 shards this model, gathering its parameters in hooks around each block; "
            "compile each block before fully_shard (as torchtitan does) instead",
            "mixed_precision": "stepped aside: {holder} holds this model's precision (its autocast would be traced "
            "into the graph)",
            "data_dependent_control_flow": "not captured: {module}.forward reads a device value at {where} (a branch "
            "on a tensor, .item()); {backend} graphs replay the ops they recorded, so a later batch would take the "
            "branch taken at capture; compute both sides and select with torch.where, or capture its static "
            "sub-modules yourself",
            "positional_forward": "not captured: {model}.forward takes *args or positional-only arguments, which "
            "ModuleCacher refuses",
            "cpu_fallback_ops": "not captured: {ops} ran on the CPU in this run (the bridge's cpu_fallback count), "
            "and an HPU graph capture asserts on a CPU fallback",
            "module_hooks": "not captured: module hooks on {where} would not run when HPU graphs replay",
            "called_several_times": "not captured: {model} is called {calls} times per step, and {backend} graphs "
            "overwrite an earlier call's outputs",
            "gradient_checkpointing": "not captured: the model uses gradient checkpointing, which HPU graphs "
            "cannot replay",
            "no_optimizer": "not captured: the loop updates its parameters without torch.optim, and HPU graphs need "
            "zero_grad(set_to_none=False)",
            "parameters_without_gradient": "not captured: {without} of {total} optimized parameters had no gradient in "
            "the profiled step; HPU graphs need zero_grad(set_to_none=False), which would make the optimizer update "
            "them",
            "captured_forced": "captured {model} (forced)",
            "captured_no_trials": "captured {model} (trials off)",
            "trial_running": "host-bound; trial running on {model}",
            "measured_faster": "captured {model}: measured faster",
            "rejected": "rejected: {model} captured was not faster in the trial; released",
            "dynamic_shapes": "switched off: dynamic shapes, {count} distinct input shapes (each one a "
            "recompilation), e.g. {shapes}",
            # notes
            "exact_random_no_effect": "--exact-random has no effect on {backend}: its graph compiler has no "
            "such setting",
            "captured_called_several_times": "{model} is called {calls} times per step: captured without graphs that "
            "replay into static outputs (CUDA graphs), which a later call would overwrite",
            "dropout_exact": "dropout draws eager's random masks (--exact-random)",
            "dropout_differs": "compiled dropout draws different random masks than eager (same distribution) and "
            "leaves the script's generator elsewhere, so later draws differ too, kept or rejected; --exact-random "
            "makes them the same, at a cost in speed",
            "gradients_reused": "zero_grad(set_to_none=False) while graphs are on: gradient tensors are reused, "
            "not freed",
            "graph_breaks": "torch.compile broke the captured code's graph {count}x at {where} ({reasons}): the "
            "code between breaks compiles apart, and the break itself runs eagerly",
            "recompiled": "torch.compile recompiled the captured code {count}x ({reasons})",
            "eager_outside_training": "calls outside training (eval mode or no_grad) run eagerly: only training steps "
            "were measured",
        },
        targets=("torch.utils.checkpoint.checkpoint",),  # HPU lazy only: calls counted (graphs refuse them)
        acts_on=(
            "<training model> call route, capture layer (in nn.Module's compiled-call slot, instance)",
            "HPU lazy: zero_grad of the optimizer's and the training model's classes (wrapt, acting on those "
            "two objects only)",
        ),
    )

    def apply(self) -> None:
        codes = {"forced": "captured_forced", "no_trials": "captured_no_trials"}
        self.candidate = Candidate(self, self._set_up, self._switch, self._params, codes, decided=self._decided)
        self._graphed = None
        self._numerics_pending = self._masks_differ = False
        self._shapes: list = []
        self._compiled_for = 0  # how many input shapes have been through the graphed call
        self._checkpoint_calls = 0
        self._estimate = None  # this model's one-off, predicted (autogaudi.measure.one_offs)
        self._artifacts_key = None  # what its compiled code depends on, naming the saved compile caches
        self._set_up_seconds = 0.0
        self._compile_mark = None  # torch's compile records when capture began (compile_counts.mark)
        if self.run.backend.graphs_hold_gradients:
            self.scope.wrap(torch.utils.checkpoint, "checkpoint", self._count_checkpoint)
        self.report.because("waiting_for_profile")
        self.scope.on(Event.STEP_PROFILED, self._profiled)

    def _params(self) -> dict:
        return {"model": type(self.candidate.model).__name__}

    def changes(self) -> list:
        if not self.in_use():
            return []
        text = f"{type(self.candidate.model).__name__} captured ({self.run.backend.graph_kind()}){self.trial_speedup()}"
        parts = {name: self.report.figures[name] for name in ONE_OFF_PARTS if name in self.report.figures}
        if parts:
            listed = ", ".join(
                f"{name.removesuffix('_s').replace('_', ' ')} {value} s" for name, value in parts.items()
            )
            text += f", one-off {round(sum(parts.values()), 3)} s ({listed})"
        if "one_off_actual_s" in self.report.figures and "one_off_predicted_s" in self.report.figures:
            text += f" (estimated {self.report.figures['one_off_predicted_s']} s before paying)"
        if "pays_back_after_steps" in self.report.figures:
            text += f", pays back after {self.report.figures['pays_back_after_steps']} steps"
        if self.report.figures.get("compile_cache") == "hit":
            text += ", compiled from the cache"
        return [text]

    def _count_checkpoint(self, wrapped, instance, args, kwargs):
        self._checkpoint_calls += 1
        return wrapped(*args, **kwargs)

    def _refusal(self, profile, any_bound: bool):
        """Why the profiled model is not captured (a Reason), or None (``any_bound``: whatever the step is bound by)."""
        if profile.bound != "host" and not any_bound:
            return self.report.reason_for("not_host_bound", bound=profile.bound, why=profile.why)
        if profile.model is None:
            return self.report.reason_for("no_training_model")
        if compiled_by_the_script(profile.model):
            return self.report.reason_for("compiled_by_script")
        if engines.fsdp2_managed(profile.model):
            return self.report.reason_for("fsdp2")
        precision = holder(profile.model, Layer.PRECISION)
        if precision is not None:
            return self.report.reason_for("mixed_precision", holder=precision.name)
        refusal = self._control_flow_refusal(profile.model) or self.run.backend.graph_refusal(profile.model)
        if refusal:
            code, params = refusal
            return self.report.reason_for(code, **params)
        if profile.calls_per_step > 1 and not self.run.backend.graphs_can_keep_outputs:
            return self.report.reason_for(
                "called_several_times",
                model=type(profile.model).__name__,
                calls=profile.calls_per_step,
                backend=self.run.backend.name,
            )
        if self.run.backend.graphs_hold_gradients:
            return self._gradient_refusal(profile)
        return None

    def _control_flow_refusal(self, model):
        """(code, params) where the backend's graphs would replay a decision the model's forward takes on a
        device value (the step profiler's host reads, located in a forward's source), or None. Forcing
        does not lift it: a replay of the other branch changes what the model computes."""
        if not self.run.backend.graphs_replay_recorded_branches:
            return None
        found = host_reads.forward_reading(model, host_reads.read_sites(self.run.profiler))
        if found is None:
            return None
        module, site = found
        return "data_dependent_control_flow", {
            "module": type(module).__name__,
            "where": short_location(site),
            "backend": self.run.backend.name,
        }

    def _profiled(self, profile) -> None:
        forced = self.name in self.run.options.force
        asked = self.name in self.run.options.trial  # --trial: measure it now, whatever the profile reads
        trial = not (forced or asked or self.run.options.no_trials)
        # First: a run too short to pay back any capture is so whatever the profile says. Every rank
        # takes rank 0's figures: ranks that decided apart would start trials apart.
        too_short = rank_zero_choice(self._too_short(profile)) if trial else None
        refusal = (
            self.report.reason_for("too_short", **too_short) if too_short else self._refusal(profile, forced or asked)
        )
        if refusal:
            self.candidate.refuse(refusal)
            return
        remembered = self.run.recalled_trial(self.name)
        if remembered is not None:  # the decision is known, the compile likely cached
            self.candidate.follow(remembered, profile)
            return
        if trial and self.candidate.untried():  # a trial would change the numbers: only where asked
            return
        # A trial, stopped where the capture's one-off runs past its estimate's high end.
        self.candidate.try_(profile, one_off_limit_s=self._estimate_one_off(profile)["high_s"])

    def _set_up(self, _scope) -> dict:
        """The candidate's set-up: capture, timed (a trial's record, or the figures, bring it)."""
        self._shapes, self._compiled_for = [], 0
        return {"set_up_s": self._set_up_capture(self.candidate.profile)}

    def _set_up_capture(self, profile) -> float:
        """Capture the profiled model; the seconds it took. The one-off's estimate goes in the figures
        first, to be set against what the first compile measures."""
        estimate = self._estimate_one_off(profile)
        self.report.figures.update(
            one_off_predicted_s=estimate["seconds"],
            one_off_predicted_range_s=[estimate["low_s"], estimate["high_s"]],
            one_off_predicted_basis=estimate["basis"],
        )
        started = time.perf_counter()
        self._capture(profile)
        self._set_up_seconds = time.perf_counter() - started
        return self._set_up_seconds

    def _capture(self, profile) -> None:
        """Capture the profiled model, into the candidate's scope."""
        module = profile.model
        self._training_mode = module.training
        if self.run.backend.graphs_hold_gradients:
            self._keep_gradient_tensors(profile.optimizer, module)
        name = type(module).__name__
        exact = self.run.options.exact_random and self.run.backend.graphs_can_draw_eager_random
        if self.run.options.exact_random and not exact:
            self.report.note("exact_random_no_effect", backend=self.run.backend.name)
        several = profile.calls_per_step > 1
        if several:
            self.report.note("captured_called_several_times", model=name, calls=profile.calls_per_step)
        # What an earlier run compiled for this script, model and inputs, into the compiler's caches first.
        self._compile_mark = self._compile_mark or compile_counts.mark()
        self.report.figures["compile_artifacts"] = one_offs.load_artifacts(
            self.run.cache, self._artifacts_key, self.run.backend
        )
        if self._estimate["tier"] == "regional":
            self._graphed = self._capture_regions(module, exact)
        elif self._estimate["tier"] == "replay":
            self._graphed = self.run.backend.graph_replay(module)
        else:
            self._graphed = self.run.backend.graph_forward(module, exact_random=exact, static_outputs=not several)
        self.candidate.scope.add(self._forget_graphs)
        self.candidate.scope.hold(module, Layer.CAPTURE, self._around)
        self.report.figures["model"] = name
        dropout = numerics.active_dropout(module)
        self._masks_differ = dropout and not exact
        self._numerics_pending = True  # measured on the first captured call
        if dropout:
            self.report.note("dropout_exact" if exact else "dropout_differs")

    def run_ending(self, error) -> None:
        """Graph breaks and recompiles since capture began, by torch's counters, with the lines torch
        names (none where graphs are not torch.compile's: HPU lazy's ModuleCacher)."""
        if self._compile_mark is None:
            return
        found = compile_counts.since(self._compile_mark)
        self.report.figures.update(graph_breaks=found["graph_breaks"], recompiles=found["recompiles"])
        breaks, recompiles = found["graph_breaks"], found["recompiles"]
        if breaks["count"]:
            reasons = "; ".join(f"{r['code'] or 'no code'}: {r['reason']} ({r['count']}x)" for r in breaks["reasons"])
            self.report.note(
                "graph_breaks", count=breaks["count"], where=", ".join(breaks["where"]) or "?", reasons=reasons
            )
        if recompiles["count"]:
            reasons = "; ".join(f"{r['where']}: {r['reason']}" for r in recompiles["reasons"])
            self.report.note("recompiled", count=recompiles["count"], reasons=reasons)

    def _too_short(self, profile):
        """None, or the figures of why no trial could pay for itself: where a framework says how many
        steps are left, a trial is worth running only if they could win back the one-off this model's
        capture is estimated to cost (:mod:`autogaudi.measure.one_offs`)."""
        remaining = run_length.remaining_steps()
        if profile.model is None or remaining is None:  # no training model: refused; a plain loop: unknown
            return None
        params = self._estimate_params(profile)
        # the tier chosen keeps only its share of what a whole capture could save
        saved_per_step_s = _saved_per_step_s(profile) * one_offs.keeps(self._estimate["tier"])
        steps, source = remaining
        if steps * saved_per_step_s >= params["estimate"]:
            return None
        return dict(steps=steps, source=source, most=steps * saved_per_step_s, **params)

    def _estimate_one_off(self, profile) -> dict:
        """This model's capture one-off, predicted once per run (:func:`autogaudi.measure.one_offs.estimate`)."""
        if self._estimate is None:
            exact = self.run.options.exact_random and self.run.backend.graphs_can_draw_eager_random
            self._artifacts_key = one_offs.artifacts_key(self.run.backend, profile.model, profile.inputs, exact)
            blob, _why, _changed = one_offs.artifacts_lookup(self.run.cache, self._artifacts_key)
            traits = one_offs.traits(profile.model, profile.measured.ops_per_step)
            records = one_offs.remembered(self.run.cache, self.run.backend)
            warm = blob is not None
            estimates = {"whole": one_offs.estimate(traits, records, self.run.backend, warm=warm)}
            if self.run.backend.graphs_by_region and traits["blocks_share"] >= one_offs.REGIONAL_SHARE:
                estimates["regional"] = one_offs.estimate(traits, records, self.run.backend, warm=warm, tier="regional")
            if self._replay_offered(profile, exact):
                estimates["replay"] = one_offs.estimate(traits, records, self.run.backend, warm=warm, tier="replay")
            if len(estimates) > 1:
                self.report.figures.update(
                    {f"one_off_predicted_{tier}_s": e["seconds"] for tier, e in estimates.items()}
                )
            remaining = run_length.remaining_steps()
            self._estimate = one_offs.choose(
                estimates.values(), _saved_per_step_s(profile), None if remaining is None else remaining[0]
            )
            self.report.figures["capture_tier"] = self._estimate["tier"]
        return self._estimate

    def _replay_offered(self, profile, exact: bool) -> bool:
        """Whether the backend's replay tier (device graphs without a compiler) can capture this model:
        one call per step (each replay writes its outputs over the last ones) and random ops left as
        the backend draws them (--exact-random is the compiler's option)."""
        return self.run.backend.replay_one_off_rate_s is not None and profile.calls_per_step == 1 and not exact

    def _estimate_params(self, profile) -> dict:
        """The estimate as the pay-back reasons name it."""
        estimate = self._estimate_one_off(profile)
        return dict(
            model=type(profile.model).__name__,
            estimate=estimate["seconds"],
            low=estimate["low_s"],
            high=estimate["high_s"],
            basis=estimate["basis"],
            backend=self.run.backend.name,
        )

    def _gradient_refusal(self, profile):
        """Why graphs that hold gradients cannot be used for this model and loop (a Reason), or None."""
        if self._checkpoint_calls or uses_gradient_checkpointing(profile.model):
            return self.report.reason_for("gradient_checkpointing")
        if profile.optimizer is None:
            return self.report.reason_for("no_optimizer")
        params = [p for group in profile.optimizer.param_groups for p in group["params"]]
        without = sum(p.grad is None for p in params)
        if without:
            return self.report.reason_for("parameters_without_gradient", without=without, total=len(params))
        return None

    def _keep_gradient_tensors(self, optimizer, model) -> None:
        """Make ``zero_grad`` keep gradient tensors while graphs are on."""
        # On the classes, checked by identity: nothing lands in the user's objects' __dict__.
        self.candidate.scope.wrap(type(optimizer), "zero_grad", self._zero_grad)
        self.candidate.scope.wrap(type(model), "zero_grad", self._zero_grad)
        self.report.note("gradients_reused")

    def _zero_grad(self, wrapped, instance, args, kwargs):
        candidate = self.candidate
        ours = instance is not None and (instance is candidate.model or instance is candidate.optimizer)
        return wrapped(set_to_none=False) if candidate.on and ours else wrapped(*args, **kwargs)

    def _switch(self, on: bool) -> None:
        if self.run.backend.graphs_hold_gradients and self.candidate.optimizer is not None:
            own_gradient_tensors(self.candidate.optimizer, on)

    def _decided(self, keep: bool, record: dict) -> None:
        self.report.figures.update(
            speedup=record["speedup"],
            set_up_s=record["set_up_s"],
            warm_up_s=round(record["one_off_s"] - record["set_up_s"], 3),
        )
        if "pays_back_after_steps" in record:
            self.report.figures["pays_back_after_steps"] = record["pays_back_after_steps"]
