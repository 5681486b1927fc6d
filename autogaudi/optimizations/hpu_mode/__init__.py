"""Lazy or eager on a Gaudi, measured and remembered: the mechanisms in :mod:`.modes` (torch-free, run
before the bridge loads), the decision in :mod:`.unit`."""
