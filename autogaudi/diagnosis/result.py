"""The doctor's result: the findings, ranked, the figures behind them, and the text and JSON of both."""

from __future__ import annotations

from autogaudi.diagnosis import gaudi_facts as facts
from autogaudi.diagnosis.findings import SCHEMA, judge, memory_projection
from autogaudi.diagnosis.memory_fit import MOST_BATCH
from autogaudi.entry.paths import short_location


class Diagnosis:
    """The doctor's result: findings (ranked), the figures behind them, and how the run went."""

    def __init__(self, script: str, steps_requested: int, observer, outcome: str, status: int = 0):
        self.script = script
        self.steps_requested = steps_requested
        self.steps_run = observer.steps
        self.outcome = outcome  # "stopped", "finished", "raised" or "exited" (sys.exit with a status)
        self.status = status  # the script's exit status
        self.device = _device_of(observer)
        step = observer.step_seconds()
        self.figures = {
            "step_ms": round(step * 1000, 3) if step else None,
            "steps_measured": len(observer.measured_steps),
        }
        self.findings = judge(observer)
        self.figures["memory"] = memory_projection(observer)

    def kinds(self) -> set:
        return {finding.kind for finding in self.findings}

    def as_dict(self) -> dict:
        return {
            "schema": SCHEMA,
            "script": self.script,
            "steps_requested": self.steps_requested,
            "steps_run": self.steps_run,
            "outcome": self.outcome,
            "exit_status": self.status,
            "device": self.device,
            "figures": self.figures,
            "facts_retrieved": facts.RETRIEVED,
            "findings": [finding.as_dict() for finding in self.findings],
        }

    def format(self) -> str:
        ending = {
            "stopped": "then stopped",
            "finished": "the script ended first",
            "raised": "the script raised (traceback above)",
            "exited": f"the script exited with status {self.status}",
        }[self.outcome]
        lines = [
            f"autogaudi doctor: {self.script}: {self.steps_run} of {self.steps_requested} training "
            f"steps observed on {self.device} ({ending}); nothing was changed or optimized"
        ]
        failed_first = self.steps_run == 0 and self.outcome in ("raised", "exited")
        if failed_first:  # nothing ran that could be judged: no "no findings"
            lines.append("  the script ended before a training step, so there is nothing to judge")
        elif self.steps_run == 0:
            lines.append("  no optimizer step was seen: is this a training script?")
        projected = self.figures["memory"]
        if projected:
            fits = ", ".join(
                f"{name} {_batch(row['largest_batch'])}"
                + (
                    f" ({_batch(row['largest_batch_checkpointed'])} checkpointed)"
                    if "largest_batch_checkpointed" in row
                    else ""
                )
                for name, row in projected["devices"].items()
            )
            lines.append(
                f"  memory: step peak {projected['peak_bytes'] / 1e6:.1f} MB at batch {projected['batch']} "
                f"(+{projected['per_sample_bytes'] / 1e6:.2f} MB a sample); largest batch that fits: {fits}"
            )
        if not self.findings and not failed_first:
            lines.append("  no findings: nothing here that is known to be slow on Gaudi")
        for number, finding in enumerate(self.findings, 1):
            where = f" at {short_location(finding.location)}" if finding.location else ""
            lines.append(f"{number:>3}. [{finding.severity}] {finding.kind}{where}: {finding.title}")
            lines.append(f"     evidence: {_evidence(finding.evidence)}")
            lines.append(f"     why: {finding.why}")
            fixed = f" (autogaudi fixes it automatically: {finding.fixed_by})" if finding.fixed_by else ""
            lines.append(f"     fix: {finding.fix}{fixed}")
        return "\n".join(lines) + "\n"


def _batch(largest) -> str:
    """A largest batch as the text says it: ``any`` where nothing grows with the batch, ``at least``
    where the projection stops (:data:`autogaudi.diagnosis.memory_fit.MOST_BATCH`)."""
    if largest is None:
        return "any"
    return f"at least {largest}" if largest >= MOST_BATCH else str(largest)


def _device_of(observer) -> str:
    for model in observer.models.values():
        for parameter in model.parameters():
            return parameter.device.type
    return "cpu"


def _evidence(evidence: dict) -> str:
    return "; ".join(f"{key}={value}" for key, value in evidence.items() if key != "facts")
