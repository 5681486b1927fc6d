"""Where a training step's time goes — host, device or input — measured on a sampled window.

Why: the Gaudi guide's first rule is to profile the host: when the device waits for the host to
issue work (host-bound), graph capture removes that wait; when the device is the bottleneck it buys
nothing and costs compile time. The unit's sampling and what it publishes in :mod:`.unit`; the
census steps' observers in :mod:`.census`, the classification in :mod:`.classification`, the
training model and its inputs in :mod:`.training_model`, the published result in :mod:`.profile`.
"""
