"""What a unit reads of the run, in one place: ``unit.run``.

A unit used to reach into the session for whatever it needed, a service locator no import showed.
The view names each part a unit may use (the backend, the options, the step watcher, the measuring
windows and trial runner, the step profile, the cache and remembered decisions, where the model
is) and nothing else; it is read-only, so no unit can rebind a part of the session under the others.
Each part is read live: the session sets some up (the cache, the profile) after the units start.
"""

from __future__ import annotations


class RunView:
    __slots__ = ("_session",)

    def __init__(self, session):
        self._session = session

    @property
    def backend(self):
        """The :class:`~autogaudi.backends.base.Backend` the run is on."""
        return self._session.backend

    @property
    def options(self):
        """The run's options (:mod:`autogaudi.core.options`), read-only to units."""
        return self._session.options

    @property
    def steps(self):
        """The step watcher (:class:`autogaudi.watch.steps.TrainingSteps`): steps so far, loaders, timeline."""
        return self._session.steps

    @property
    def windows(self):
        """Who measures the steps now (:class:`autogaudi.measure.windows.StepWindows`): take one, release it."""
        return self._session.windows

    @property
    def trials(self):
        """The measurement runner (:mod:`autogaudi.measure.trials`): submit a trial or a check, cancel it."""
        return self._session.trials

    @property
    def profiler(self):
        """The step profiler unit (whose ``profile`` is the classified step), or None where it is off."""
        return self._session.profiler

    @property
    def step_memory(self):
        """The measured and forecast peak memory of a step (:mod:`autogaudi.measure.step_memory`), or None."""
        return self._session.step_memory

    @property
    def cache(self):
        """The cache folder (:mod:`autogaudi.store.cache`), or None (--no-cache, or not usable)."""
        return self._session.cache

    @property
    def memory(self):
        """Remembered decisions of earlier runs (:mod:`autogaudi.store.decisions`), or None without a cache."""
        return self._session.memory

    @property
    def placement(self):
        """Where the training model is (:mod:`autogaudi.watch.placement`)."""
        return self._session.placement

    @property
    def migration(self):
        """What gpu_migration decided before the Gaudi bridge loaded, or None."""
        return self._session.migration

    def emit(self, event, *args) -> None:
        """Tell every listener of ``event`` (the profiler's ``STEP_PROFILED``), in start order."""
        self._session.events.emit(event, *args)

    def recalled_trial(self, name: str):
        """Unit ``name``'s trial as a run with the same set-up (``--trial`` included), model and inputs
        decided it; None where there is none, or this run holds no trial (``--force``, ``--no-trials``)."""
        memory, options = self._session.memory, self._session.options
        if memory is None or memory.recalled is None or options.no_trials or name in options.force:
            return None
        return memory.recalled.get("trials", {}).get(name)
