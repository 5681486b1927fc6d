"""One module per optimization unit; the list of them is ``autogaudi.registry.UNITS``."""
