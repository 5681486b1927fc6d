"""Measurements: trials, the step windows, numerics, one-off costs, step memory."""
