"""Where a unit stands: one value, read by the report (its row's status) and by the session (whether
every decision is made, so that the run's steps from there on are its steady state)."""

from __future__ import annotations

import enum


class Status(enum.Enum):
    APPLIED = "applied"  # in force, and changed something the run keeps
    DECIDING = "deciding"  # in force, measuring or checking what changes the run's steps (a trial, a timing)
    WATCHING = "watching"  # in force, waiting for what it acts on (a loader, an optimizer, the step profile)
    NOT_NEEDED = "not needed"  # in force, and decided that nothing needs changing
    SKIPPED = "skipped"  # not applied to this run: switched off, another backend, refused, stepped aside
    FAILED = "failed"  # could not load, raised in apply, or raised at run time and was switched off
