"""Gaudi: Intel's GPU migration toolkit switched on for a script written for CUDA.

Why: most public training scripts target CUDA (``device = "cuda" if torch.cuda.is_available() else
"cpu"``, ``.cuda()``). On a Gaudi such a script trains on the CPU, and every Gaudi unit would act on a
CPU run. Intel ships the answer, ``habana_frameworks.torch.gpu_migration``: it maps ``torch.cuda.*``,
``device="cuda"`` arguments, Apex and pynvml onto HPU, and (its docs say) optimizes nothing: step
marks and fused kernels are still to be added, which is what the other units do. This unit switches
the real toolkit on; it re-implements nothing.

How: the toolkit must be on before the bridge loads (``PT_HPU_GPU_MIGRATION=1``, read by the bridge at
import; hpu-api.md), which since torch 2.5 is during ``import torch``: the decision is taken at the
start of the script's import of torch or of the bridge (:mod:`autogaudi.entry.before_bridge`), from the
script (``__main__``'s file) and the modules of its own folder it imports; the variable is set
where they use CUDA. It is inherited by the processes the script
starts (torchrun workers, loader workers), which then map the same calls. A script or environment that
switched it on itself is left as it is (and reported). The unit then reports how many calls were
mapped, where the toolkit counts them, and names the CUDA-bound libraries the script uses that the
toolkit does not map (:data:`autogaudi.entry.script_source.NOT_MAPPED`). Where the script uses CUDA
only at run time in a way the source does not show, the toolkit could not be switched on: the unit notes the first
``torch.cuda.is_available()`` call and recommends ``PT_HPU_GPU_MIGRATION=1``.
Undo: ``disable()`` takes the variable back off (for processes started later); the toolkit's mapping
stays in this process, as the bridge has no way to unload it (said in the row's notes).
``--disable gpu_migration`` runs the script as written: on a Gaudi its model then stays on the CPU and
the device units step aside (``model_not_on_device``).
"""

from __future__ import annotations

import os
import sys

import torch

from autogaudi.core.unit import ROUNDING, Unit, UnitSpec
from autogaudi.entry.before_bridge import MIGRATION_TOOLKIT, MIGRATION_VARIABLE
from autogaudi.entry.main_script import script_path
from autogaudi.entry.script_source import NOT_MAPPED

TOOLKIT = MIGRATION_TOOLKIT
VARIABLE = MIGRATION_VARIABLE
# What the toolkit maps, as the docs below list it: what a script uses -> what it runs as.
MAPPED = {
    "torch.cuda": "torch.hpu's call of the same name",
    "cuda device": "hpu ('cuda' device arguments, .cuda(), .to('cuda'))",
    "apex": "Apex on hpu, with limitations",
    "pynvml": "pynvml answered for the Gaudi device",
}


def _asked_by_the_script() -> bool:
    """Whether the call being served came from the script's own folder (not from torch, a library,
    or autogaudi): the first caller outside autogaudi, wrapt and torch."""
    path = script_path()
    if path is None:
        return False
    folder = os.path.dirname(os.path.abspath(path)) + os.sep
    skipped = (os.path.dirname(os.path.dirname(os.path.abspath(__file__))), os.path.dirname(torch.__file__))
    frame = sys._getframe(1)
    while frame is not None:
        name = os.path.abspath(frame.f_code.co_filename)
        if not name.startswith(skipped) and "wrapt" not in name:
            return name.startswith(folder)
        frame = frame.f_back
    return False


class GpuMigration(Unit):
    spec = UnitSpec(
        # The math runs on the device instead of the host: other kernels, other rounding
        numerics=(ROUNDING,),
        exact_when="never: the device's kernels round otherwise than the host's",
        reasons={
            "mapped": "the script asked for cuda; it ran on hpu through Intel's GPU migration ({by})",
            "other_device": "--device names another backend",
            "exact": "off under --exact: the script runs where it asked",
            "no_bridge": "the Gaudi bridge is not installed",
            "bridge_loaded_first": "the Gaudi bridge was loaded (by `import torch` since torch 2.5) before autogaudi "
            "started: the toolkit can only be switched on before it (PT_HPU_GPU_MIGRATION=1)",
            "no_script": "no script file to read (python -c, an interactive session)",
            "script_not_cuda": "the script and its own modules do not use CUDA",
            "failed_before_bridge": "could not read the script before the bridge loaded: {error}",
            # notes and recommendations
            "not_mapped": "{library} ({what}, imported at {where}) is CUDA-bound and not mapped by the toolkit",
            "mapping_stays": "the toolkit's mapping stays in this process after disable(): the bridge cannot unload it",
            "cuda_asked_at_run_time": "the script asked torch.cuda.is_available() at run time without the toolkit on: "
            "its CUDA code ran on the CPU",
            "set_variable": "set PT_HPU_GPU_MIGRATION=1 before the script starts, so Intel's toolkit maps its "
            "CUDA calls",
            "enable_before_torch": "start autogaudi before torch loads the Gaudi bridge: `python -m autogaudi "
            "script.py`, "
            "AUTOGAUDI=1, or autogaudi.enable() above the script's `import torch`",
        },
        changed_figure=("mapped_calls", "{} CUDA calls mapped to hpu by Intel's GPU migration"),
        targets=("torch.cuda.is_available",),
        acts_on=("PT_HPU_GPU_MIGRATION, set as the script starts importing torch or the Gaudi bridge (before_bridge)",),
        states=("watching", "failed", "disabled"),
    )

    def apply(self) -> None:
        decided = self.run.migration or {"switched_on_by": None, "why_not": "no_script"}
        self._decided = decided
        self._toolkit = sys.modules.get(TOOLKIT)
        self.report.figures["switched_on_by"] = decided.get("switched_on_by")
        for library, where in decided.get("not_mapped", {}).items():
            self.report.note("not_mapped", library=library, what=NOT_MAPPED[library], where=where)
        if self._toolkit is not None:
            self.report.figures["script_uses_cuda_at"] = decided.get("cuda", [])
            if decided.get("switched_on_by") == "autogaudi":
                self.scope.add(self._unset_variable)
            self.report.because("mapped", by=f"switched on by {decided.get('switched_on_by') or 'the script'}")
        elif "error" in decided:
            self.report.because("failed_before_bridge", error=decided["error"])
        else:
            self.report.because(decided.get("why_not", "no_script"))
            if decided.get("why_not") == "bridge_loaded_first":
                self.report.recommend("enable_before_torch", do="python -m autogaudi script.py")
        self.scope.wrap(torch.cuda, "is_available", self._is_available)

    def _is_available(self, wrapped, instance, args, kwargs):
        answer = wrapped(*args, **kwargs)
        if self._toolkit is None and "cuda_asked_at" not in self.report.figures and _asked_by_the_script():
            self.report.figures["cuda_asked_at"] = self.run.steps.steps
            self.report.note("cuda_asked_at_run_time")
            self.report.recommend("set_variable", do=f"{VARIABLE}=1")
        return answer

    def _unset_variable(self):
        if os.environ.get(VARIABLE) == "1":
            del os.environ[VARIABLE]
        return self.report.reason_for("mapping_stays")

    def mapped_calls(self):
        """The toolkit's count of mapped calls, where it keeps one it can be asked for (the test double
        does; whether the bridge's toolkit does is unconfirmed: its log, GPU_MIGRATION_LOG_LEVEL, lists them)."""
        count = getattr(self._toolkit, "mapped_calls", None) if self._toolkit is not None else None
        try:
            return int(count()) if callable(count) else None
        except Exception:
            return None

    def changes(self) -> list:
        self.report.figures["mapped_calls"] = self.mapped_calls()
        if self._toolkit is None:
            return []
        count = self.report.figures["mapped_calls"]
        return [self.spec.changed_figure[1].format(count if count is not None else "its")]

    def facts(self):
        """For the report's first line: where the script asked the math to run and where it ran: the
        device, or the host where the script put its model there itself (mapped calls or not)."""
        if getattr(self, "_toolkit", None) is None:
            return None
        on_device = getattr(self.run.placement, "on_device", None)
        return {
            "asked_for": "cuda",
            "ran_on": self.run.backend.device_type if on_device is not False else "cpu",
            "through": "Intel's GPU migration",
            "switched_on_by": self._decided.get("switched_on_by"),
            "mapped_calls": self.mapped_calls(),
            "not_mapped": sorted(self._decided.get("not_mapped", {})),
        }
