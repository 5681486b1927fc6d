"""The step profiler: when it samples, what it publishes and the figures it reports.

``PAIRS`` pairs of steps right after warm-up, each pair a clean step and then a census step:

1. Clean step: timed boundary to boundary (optimizer steps), with the time spent waiting for
   DataLoader batches. Nothing is added to it.
2. Census step: runs under the census (:mod:`.census`), which counts the ops the step issues (every
   aten op: forward, backward and optimizer), adds up the time they compute, and records which
   top-level module produced the step (for graph capture).

The profile goes out as ``Event.STEP_PROFILED`` (graph_capture, channels_last, loader_workers). On a distributed run
each rank measures its own steps and all follow rank 0's classification (a broadcast after the last
census step), so every rank starts the same trials at the same step: ranks that decided apart would wait in
different collectives.
"""

from __future__ import annotations

from collections import Counter

import torch
import wrapt

from autogaudi.core.events import Event
from autogaudi.core.unit import ROUNDING, Unit, UnitSpec
from autogaudi.entry.paths import short_location
from autogaudi.entry.ranks import rank_zero_choice, several_ranks
from autogaudi.measure import machine_load
from autogaudi.measure.trials import median
from autogaudi.store.decisions import origin
from autogaudi.watch import steps

# What the census steps run and what they publish: loaded once warm-up is over, as the census starts.
census = wrapt.lazy_import("autogaudi.optimizations.step_profiler.census")
classification = wrapt.lazy_import("autogaudi.optimizations.step_profiler.classification")
step_profile = wrapt.lazy_import("autogaudi.optimizations.step_profiler.profile")
run_length = wrapt.lazy_import("autogaudi.watch.run_length")
training_model = wrapt.lazy_import("autogaudi.optimizations.step_profiler.training_model")

# The most of a run the census's one-off (the backend's ``census_one_off_s``) may cost: it starts once
# the run so far, with the steps a framework says are left, is long enough to carry it.
CENSUS_ONE_OFF_SHARE = 0.05
FP32_MATRIX_SHARE = 0.9  # a step whose matrix products run in float32 at least this often trains in fp32


class StepProfiler(Unit):
    spec = UnitSpec(
        reasons={
            "warming_up": "waiting for {steps} warm-up steps",
            "others_measuring": "waiting while another unit times its own work inside the steps ({units})",
            "census_waits": "the census's device timing costs about {one_off_s:g} s once on {backend}; it starts once "
            "the run has lasted {after_s:g} s, so that a shorter run pays nothing for it",
            "remembered_profile": "{bound}-bound, as measured in run {run} on {date} with the same script, model "
            "and inputs: {why}",
            **{f"{bound}_bound": f"{bound}-bound: {{why}}" for bound in ("input", "host", "communication", "device")},
            "unclear_bound": "{why}",
            "follows_rank_zero": "this rank measured {bound}-bound ({why}); every rank follows rank 0",
            "hpu_lazy_device_time": "HPU lazy: the device time is the wait in synchronize() after mark_step, "
            "which also "
            "drains the host's graph building; a host-bound run can read device-bound",
            "host_reads": "{per_step:g} host read(s) of device values per step (.item(), float(), bool(), .cpu()) at "
            "{sites}: each makes the host wait until the device has finished the step, so the next step cannot be "
            "queued behind it; read every N steps, or accumulate on the device",
            "fp32_products": "device-bound, and {share:.0%} of the step's matrix products run in float32: bf16 "
            "autocast "
            'runs them on the matrix units; try torch.autocast(device_type="{device}", dtype=torch.bfloat16) around '
            "the forward and the loss, and compare the loss curve",
        },
        acts_on=(
            "training steps and batch fetches (the session's step watcher)",
            "global module forward hooks and a TorchDispatchMode, during three to five census steps",
        ),
        exact_when="the script itself marks a step after each optimizer step",  # in HPU lazy mode
    )

    @classmethod
    def numerics_on(cls, backend) -> tuple:
        # In HPU lazy mode a census step ends with mark_step, cutting the graph where the script may
        # not (by reading). Elsewhere it only observes: the census runs the step's own ops.
        return (ROUNDING,) if backend.name == "hpu" and backend.is_lazy else ()

    # The step profile, as the measurement runner reads it: the run's bound is the decision every unit
    # acting on the profile waits for; once published the profiler watches, having decided nothing.
    deciding = property(lambda self: self.profile is None)
    done = False

    def apply(self) -> None:
        self.profile = None
        self._step_began = None
        self._waited = 0.0
        self._clean: list = []  # (seconds, seconds waiting for data) of each clean step
        self._census_step = None
        self._censuses: list = []  # what CensusStep.stop() gave for each census step
        self._census_s: list = []  # wall seconds of each census step, its profiler's start and stop included
        self._census_began = None
        self._roots: list = []
        self._calls: list = []  # calls of each root module (by id) in each census step
        self._reads: list = []  # host reads (device type, where) of each census step
        self._matrix_ops = Counter()  # input dtype -> matrix products, over the census steps
        self._inputs: dict = {}  # root module (by id) -> the shapes of its first inputs
        self._done = 0
        self._recall = None  # None: not yet looked; a Scope: identifying the model; False: done or none
        self._identify = None  # the root modules of the step that identifies the model
        self._known_end = None  # the training step a framework says the run ends at (looked up once)
        self._listening = self.scope.child()  # the step and batch listeners, closed once classified
        self._listening.on(Event.TRAINING_STEP, self._after_step)
        self._listening.on(Event.BATCH_FETCHED, self._after_batch)
        self.scope.add(self._abandon_census)
        self.run.trials.measuring(self, self)
        self.report.because("warming_up", steps=self.run.options.warmup_steps)

    def _after_batch(self, _iterator, _batch, waited: float) -> None:
        if self._step_began is not None:
            self._waited += waited

    def _after_step(self, optimizer) -> None:
        """Warm-up ends at ``done == 0``; odd ``done`` ends a clean step, even ``done`` a census step.
        Training steps are whole iterations (the session paces them on one optimizer, or on backward
        passes where no optimizer steps)."""
        if not self.run.steps.warmed_up:
            return
        if self._recall is not False and self._recalled(optimizer):
            return
        if self._done == 0 and (self._census_waits() or self._others_measuring()):
            return
        self.run.windows.take(self)  # the census's steps: held from its first to its last
        done, self._done = self._done, self._done + 1
        if done % 2:
            self._clean.append((steps.clock() - self._step_began, self._waited))
            self._step_began, self._census_began = None, steps.clock()
            self._census_step = census.CensusStep(self.run.backend, self._roots, self)
            return
        if done:
            census_step, self._census_step = self._census_step, None  # a failing stop is not undone twice
            self._censuses.append(census_step.stop())
            self._census_s.append(steps.clock() - self._census_began)
            self._calls.append(census_step.roots.calls)
            self._inputs = {**census_step.roots.inputs, **self._inputs}
            self._reads.append(census_step.census.host_reads)
            self._matrix_ops.update(census_step.census.matrix_ops)
        if done == 2 * classification.PAIRS or (
            done and not several_ranks() and classification.settled(self._clean, self._censuses)
        ):
            self._finish_census(optimizer)
        else:
            self._waited, self._step_began = 0.0, steps.clock()

    def _census_waits(self) -> bool:
        """Whether the census's one-off would still be more than ``CENSUS_ONE_OFF_SHARE`` of the run's
        length as known so far (its wall time, and the steps a framework says are left at this pace).
        A unit forced or put on trial by the user is the user taking its one-offs: no wait then. Nor
        with several ranks: each rank's clock would end the wait at its own step, and the census ends
        in a broadcast every rank must reach at the same step."""
        one_off = self.run.backend.census_one_off_s
        if not one_off or self.run.options.force or self.run.options.trial or several_ranks():
            return False
        watcher = self.run.steps
        if self._known_end is None:
            remaining = run_length.remaining_steps()
            self._known_end = watcher.steps + remaining[0] if remaining is not None else 0
        run_s = steps.clock() - watcher.began
        if watcher.timed is not None and self._known_end > watcher.steps:
            timed_steps, timed_s = watcher.timed
            run_s += (self._known_end - watcher.steps) * timed_s / timed_steps
        after_s = one_off / CENSUS_ONE_OFF_SHARE
        if run_s >= after_s:
            return False
        if self.report.reason.code != "census_waits":
            self.report.because("census_waits", one_off_s=one_off, backend=self.run.backend.name, after_s=after_s)
        return True

    def _others_measuring(self) -> bool:
        """Whether another measurement holds the steps (fused_optimizer's update timed against
        torch's, on copies; a trial): a census step would count that work as the step's, and its
        dispatch mode would slow what the other times. The census starts after it."""
        windows = self.run.windows
        if windows.take(self):
            return False
        if self.report.reason.code != "others_measuring":
            self.report.because("others_measuring", units=windows.holder_name())
        return True

    def _abandon_census(self) -> None:
        if self._census_step is not None:
            self._census_step.abandon()

    def _finish_census(self, optimizer) -> None:
        busy_machine = machine_load.slowdown() > 1
        figures, shares = classification.census_figures(self._clean, self._censuses, busy_machine)
        measured = classification.classify(*shares)
        bound, why = rank_zero_choice(measured)
        if bound != measured[0]:
            self.report.note("follows_rank_zero", bound=measured[0], why=measured[1])
        root = training_model.training_root(self._roots, optimizer)
        # ``is not None``: a module's truth is its length where it has one (an empty Sequential is
        # false; torch.compile's OptimizedModule asks the module it compiled, and raises without one).
        calls = max((step_calls.get(id(root), 0) for step_calls in self._calls), default=0) if root is not None else 0
        inputs = self._inputs.get(id(root), ())
        self.profile = step_profile.StepProfile(
            bound, why, figures, root, optimizer, calls_per_step=calls, inputs=inputs
        )
        self.report.figures.update(bound=bound, profiled_at_step=self.run.steps.steps, **figures.as_dict())
        self.report.figures["census_extra_s"] = round(classification.census_extra_s(self._clean, self._census_s), 3)
        self.report.because(f"{bound}_bound", why=why)
        if root is not None:
            self.report.figures["model"] = training_model.model_name(self.profile.model)
            self.report.figures["model_calls_per_step"] = calls
        if self.run.backend.name == "hpu" and self.run.backend.is_lazy:
            # The bridge's synchronize() marks a step and drains the host pipeline before it waits
            # (hpu/csrc/bindings.cpp): what is timed as device work includes the
            # host's graph building. Unverified on hardware; said rather than corrected.
            self.report.note("hpu_lazy_device_time")
        self._advise(root)
        self._publish()

    def _publish(self) -> None:
        self.run.windows.release(self)
        self._roots, self._calls = [], []  # hold none of the user's objects
        self.report.moment("profiled", bound=self.profile.bound)
        self._listening.close()  # classified once: no more work on every step and batch
        self.run.emit(Event.STEP_PROFILED, self.profile)

    def _recalled(self, optimizer) -> bool:
        """Where earlier runs with this set-up left decisions, the first step after warm-up runs with
        forward hooks only, to find the training model and its inputs; with an entry for them the
        remembered profile is published at once, and no census step runs (True). Otherwise
        profiling starts from here (False)."""
        memory = self.run.memory
        if self._recall is None:
            if memory is None or not memory.has_entries():
                self._recall = False
                return False
            self._recall = self.scope.child()
            self._identify = training_model.RootModules(self._roots, self._recall)
            return True
        self._recall.close()
        self._recall = False
        identify, self._identify = self._identify, None
        root = training_model.training_root(self._roots, optimizer)
        self._roots = []
        inputs = identify.inputs.get(id(root), ()) if root is not None else ()
        model = root.module if isinstance(root, torch.nn.parallel.DistributedDataParallel) else root
        entry = memory.recall(model, inputs)
        if entry is None:
            return False
        record = entry["profile"]
        calls = identify.calls.get(id(root), 0)
        self.profile = step_profile.StepProfile(
            record["bound"],
            record["why"],
            step_profile.StepFigures.from_dict(record["figures"]),
            root,
            optimizer,
            calls,
            inputs,
            remembered=record,
        )
        self.report.figures.update(
            bound=record["bound"],
            profiled_at_step=self.run.steps.steps,
            **record["figures"],
            remembered_from_run=record["run"],
        )
        self.report.figures.update(model=training_model.model_name(self.profile.model), model_calls_per_step=calls)
        self.report.because("remembered_profile", bound=record["bound"], why=record["why"], **origin(record))
        self._publish()
        return True

    def _advise(self, root) -> None:
        """Figures from what the census steps saw, and where they cost time on this backend, what the
        user could change (autogaudi changes neither: both change what the script computes or prints)."""
        device = next((p.device.type for p in root.parameters()), None) if root is not None else None
        device = device or self.run.backend.device_type  # reads of the training device's values only
        on_device = [
            Counter({where: count for (kind, where), count in reads.items() if kind == device}) for reads in self._reads
        ]
        per_step = median(sum(reads.values()) for reads in on_device)  # Counter.total(): 3.10+
        sites = sum(on_device, Counter())
        sites.pop(None, None)  # reads made outside any user frame
        self.report.figures["host_reads_per_step"] = per_step
        where = [f"{short_location(site)} ({count / len(self._reads):g}/step)" for site, count in sites.most_common(3)]
        if where:
            self.report.figures["host_read_sites"] = where
        if per_step >= 1 and self.run.backend.host_runs_ahead:
            self.report.recommend(
                "host_reads",
                per_step=per_step,
                sites=", ".join(where),
                do=f"read device values every N steps, not every step, at {where[0] if where else 'the script'}",
            )
        matrix = sum(self._matrix_ops.values())
        if not matrix:
            return
        fp32 = self._matrix_ops[torch.float32] / matrix
        # Also in the profile: what mixed_precision reads, remembered with it for a later run.
        self.report.figures["fp32_matrix_fraction"] = self.profile.measured.fp32_matrix_fraction = round(fp32, 3)
        if fp32 >= FP32_MATRIX_SHARE and self.profile.bound == "device" and self.run.backend.fast_bf16():
            self.report.recommend(
                "fp32_products",
                share=fp32,
                device=self.run.backend.device_type,
                do=f"--precision auto ({fp32:.0%} of the matrix products run in float32)",
                # bf16 matrix units run about twice the float32 rate: half the float32 matrix share
                saves=round(self.profile.measured.compute_fraction * fp32 / 2, 3),
            )
