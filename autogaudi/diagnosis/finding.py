"""One finding of the doctor: what, where, the evidence, why it costs on Gaudi and the fix."""

from __future__ import annotations

SEVERITIES = ("high", "medium", "low")


class Finding:
    __slots__ = ("kind", "severity", "title", "location", "evidence", "why", "fix", "fixed_by", "score")

    def __init__(self, kind, severity, title, location, evidence, why, fix, fixed_by=None, score=0.0):
        self.kind = kind
        self.severity = severity
        self.title = title
        self.location = location  # (file, line) or None
        self.evidence = evidence
        self.why = why
        self.fix = fix
        self.fixed_by = fixed_by  # the autogaudi unit that fixes it automatically, if any
        self.score = score

    def as_dict(self) -> dict:
        where = {"file": self.location[0], "line": self.location[1]} if self.location else None
        return {
            "kind": self.kind,
            "severity": self.severity,
            "title": self.title,
            "location": where,
            "evidence": self.evidence,
            "why": self.why,
            "fix": self.fix,
            "fixed_by_unit": self.fixed_by,
        }
