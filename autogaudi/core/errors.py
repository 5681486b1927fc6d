"""Exceptions autogaudi raises on purpose (everything else it catches and reports)."""


class OptionsError(ValueError):
    """An option has a bad value; the message names the option, the value and the valid choices."""
