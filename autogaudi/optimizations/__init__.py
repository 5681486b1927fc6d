"""One module per optimization unit; the list of them is ``autogaudi.core.registry.UNITS``."""
