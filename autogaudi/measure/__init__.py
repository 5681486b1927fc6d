"""Measurements: the one runner (trials) with its step windows and rule, numerics on copies, one-off costs,
step memory, the timeline."""
