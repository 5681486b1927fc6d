"""The capture layer at run time, mixed into GraphCapture: the captured call (compiling per new input
shape, timed to the end of its step; the first call's numerics; an eager re-run where it fails),
regional capture's per-block layers, and what the one-off teaches this machine's records."""

from __future__ import annotations

import atexit
import time
import warnings

import torch
import wrapt

from autogaudi.core.events import Event
from autogaudi.core.guard import PASSING_THROUGH
from autogaudi.entry.ranks import is_rank_zero
from autogaudi.measure import numerics
from autogaudi.optimizations.step_profiler import training_model
from autogaudi.watch.model_call import Layer

one_offs = wrapt.lazy_import("autogaudi.measure.one_offs")  # read once a capture is set up

MAX_SHAPES = 8


def own_gradient_tensors(optimizer, graphs_on: bool) -> None:
    """Graphs that hold gradients (HPU lazy) write them into static tensors. Before they go on, every
    parameter gets a gradient tensor of its own (zeros, where ``zero_grad`` had set None), so that
    the first graphed backward accumulates into it instead of adopting a static buffer as ``p.grad``;
    when they go off, each gradient is copied, so that eager steps and a later ``set_to_none`` never
    share a tensor with a graph. Zeros train as None here: capture requires that every optimized
    parameter had a gradient in the profiled step."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            if graphs_on and param.grad is None:
                param.grad = torch.zeros_like(param)
            elif not graphs_on and param.grad is not None:
                param.grad = param.grad.clone()


class CapturedCall:
    """GraphCapture's mechanisms, on its state (candidate, figures, graphed call, shapes seen)."""

    def _capture_regions(self, module, exact: bool):
        """Regional compilation through the call route: each repeated block holds a capture layer of its
        own that runs it compiled (one compiled code for the class) during the model's captured call,
        and eagerly otherwise; the model's call itself stays eager around them."""
        name, block_class, blocks, _share = one_offs.repeated_blocks(module)
        compiled = self.run.backend.graph_blocks(exact_random=exact)
        self.report.figures["regions"] = {"container": name, "block": block_class.__name__, "count": len(blocks)}
        in_call = []  # non-empty while the model's captured call runs

        def layer_of(block):
            def block_layer(call, args, kwargs):
                return compiled(block, *args, **kwargs) if in_call else call(*args, **kwargs)

            return block_layer

        for block in blocks:
            self.candidate.scope.hold(block, Layer.CAPTURE, layer_of(block))

        def graphed(*args, **kwargs):
            in_call.append(True)
            try:
                return module._call_impl(*args, **kwargs)
            finally:
                in_call.pop()

        return graphed

    def _forget_graphs(self) -> None:
        graphed, self._graphed = self._graphed, None
        if graphed is not None:
            self.run.backend.release_graphs(graphed)

    def _around(self, call, args, kwargs):
        """The capture layer: ``call`` is the model's own eager call."""
        module = self.candidate.model
        if not self.candidate.on:
            return call(*args, **kwargs)
        if module.training != self._training_mode or not torch.is_grad_enabled():
            # Evaluation: not what the trial measured, and each mode would be one more compilation.
            self.report.note("eager_outside_training")
            return call(*args, **kwargs)
        shapes = training_model.input_shapes(args, kwargs)
        if shapes not in self._shapes:
            self._shapes.append(shapes)
            if len(self._shapes) > MAX_SHAPES:
                self.run.trials.cancel(self)
                self.candidate.release("dynamic_shapes", count=len(self._shapes), shapes=self._shapes[:4])
                return call(*args, **kwargs)
        state = self._random_state_to_measure(module)
        try:
            if len(self._shapes) == self._compiled_for:
                result = self._graphed(*args, **kwargs)
            else:
                result = self._compile_for_new_shape(args, kwargs)
        except PASSING_THROUGH:
            raise
        except Exception as error:
            failure = error
        else:
            if state is not None:
                self._measure_numerics(module, args, kwargs, result, state)
            return result
        # Outside the handler, so that an error raised eagerly is not chained to the captured one.
        return self._eager_after(failure, call, args, kwargs)

    def _random_state_to_measure(self, module):
        """On the capture's first call, torch's generators before it: the eager copy draws from there."""
        if not self._numerics_pending:
            return None
        return numerics.random_state(
            numerics.random_devices(module, self.run.backend.device_type), self.run.backend.device_type
        )

    def _measure_numerics(self, module, args, kwargs, output, state) -> None:
        """The captured call's output, which the step uses anyway, against an eager forward of a copy
        of the model on the same inputs from the same generator state (no second captured call: in
        another mode it would compile again). Where dropout is active and the graph draws its own
        masks (not --exact-random), the figure includes the masks: the compiled masks cannot be
        replayed eagerly, so rounding alone is not separable, and ``of`` says so. With
        --exact-random the copy draws the same masks, and the figure is rounding."""
        self._numerics_pending = False
        with self.fail_open():  # the step has its output already: a failure here must not call again
            self.report.measure_numerics(
                module,
                args,
                kwargs,
                of="outputs, dropout masks drawn otherwise" if self._masks_differ else "outputs",
                against="an eager forward of a copy of the model on the same inputs",
                output=output,
                state=state,
            )

    def _compile_for_new_shape(self, args, kwargs):
        started = time.perf_counter()
        cached_before = self.run.backend.compile_cache_counts()
        self.run.backend.compiling_for_autogaudi()  # the device's signals: this step's compiles are ours
        with warnings.catch_warnings():  # compiling: torch.compile's advice is not the user's
            warnings.simplefilter("ignore", UserWarning)
            result = self._graphed(*args, **kwargs)
        self._compiled_for = len(self._shapes)
        seconds = time.perf_counter() - started
        first = self._compiled_for == 1
        if first:
            cached = self.run.backend.compile_cache_counts()
            if cached is not None:
                hits, misses = (cached[kind] - cached_before[kind] for kind in ("hits", "misses"))
                self.report.figures["compile_cache"] = "hit" if hits and not misses else "miss" if misses else "none"
            # The compiler is loaded now, its exit handlers registered; ours, registered after, runs first.
            atexit.register(self._stop_compile_workers)
            self.candidate.scope.add(lambda: atexit.unregister(self._stop_compile_workers))
        self._count_to_step_end(started, seconds, first)
        return result

    def _count_to_step_end(self, started: float, call_s: float, first: bool) -> None:
        """A compile goes on past the call: the compiler builds the backward at the step's first
        backward (AOTAutograd compiles it lazily: 7 of 28 s for minGPT's GPT on the 2-core CPU). So
        each compile is counted to the end of the step it started in, less what an eager step took
        (the profile's), and never less than the call's own compile; the first is the warm-up (a
        trial's record replaces it), later ones (new input shapes) come on top. Until the step ends (a
        run may end in it) the figures hold the call's compile; the machine's records learn only from
        the whole, and what was compiled is saved for the next run then, the backward included."""
        eager_s = self.candidate.profile.measured.ms_per_step / 1000
        if first:
            self.report.figures["warm_up_s"] = round(call_s, 3)
            self.report.figures["one_off_actual_s"] = round(self._set_up_seconds + call_s, 3)
        else:
            self._add_later_compile(call_s)

        def step_ended(_optimizer):
            handle.remove()
            seconds = max(call_s, time.perf_counter() - started - eager_s)
            if first:
                self.report.figures["warm_up_s"] = round(seconds, 3)
                self._learn_one_off(self._set_up_seconds + seconds)
            else:
                self._add_later_compile(seconds - call_s)
            if is_rank_zero():  # for the next run: compiled once, loaded after
                one_offs.save_artifacts(self.run.cache, self._artifacts_key, self.run.backend)

        handle = self.candidate.scope.on(Event.TRAINING_STEP, step_ended)

    def _add_later_compile(self, seconds: float) -> None:
        self.report.figures["later_compiles_s"] = round(self.report.figures.get("later_compiles_s", 0.0) + seconds, 3)

    def _learn_one_off(self, actual_s: float) -> None:
        """Set what the capture cost (set-up and first compile) against its estimate, in the figures
        and, on rank 0, in this machine's records that later estimates learn from."""
        self.report.figures["one_off_actual_s"] = round(actual_s, 3)
        if self._estimate is not None and is_rank_zero():
            one_offs.remember(self.run.cache, self.run.backend, one_offs.record_of(self._estimate, actual_s))

    def _stop_compile_workers(self) -> None:
        """At exit, with capture still on: shut down the compile workers it started, timed."""
        seconds = self.run.backend.stop_compile_workers()
        if seconds is not None:
            self.report.figures["compile_workers_at_exit_s"] = round(seconds, 3)

    def _eager_after(self, failure, call, args, kwargs):
        """The captured call raised: run the call as plain PyTorch would. If that raises too, the
        error is the user's own and propagates unchanged (capture stays as it was); if it does not,
        capture was at fault: it is switched off, reported, and the run goes on."""
        result = call(*args, **kwargs)
        self.failed_at_run_time(failure)
        return result
