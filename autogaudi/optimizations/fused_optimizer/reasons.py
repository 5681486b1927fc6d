"""The fused optimizer's reason codes: why it is where it is, and why one optimizer runs unfused."""

REASONS = {
    "torch_fused": "torch fused=True kernels",
    "hpex": "hpex fused optimizers",
    "timing": "the fused update timed beside torch's on copies; the run keeps torch's until it is decided",
    # why one optimizer runs unfused (figure kernel_refusals, and the notes)
    "parameter_type": "a parameter is a {type}, which the fused kernel does not take",
    "parameter_device": "a parameter is on {device}; the fused kernel runs on {devices}",
    "parameter_dtype": "a parameter is {dtype}; the fused kernel takes floating-point tensors only",
    "dtensor_parameters": "its parameters are DTensors (FSDP2), which {kernel} does not take",
    "sparse_gradients": "a gradient is sparse ({layout}), which the fused kernel does not take",
    "fused_step_raised": "the fused step raised {error!r}",
    # notes: an optimizer left unfused, why (the code above in refusal, where the kernel refused)
    "optimizer_kept": "{optimizer} kept as is: {why}",
    "optimizer_unfused": "{optimizer} runs unfused from its next step on: {why}",
    # the fused update timed slower than torch's unfused one (note; the unit's reason once none is fused)
    "fused_slower": "fused update measured slower: not used ({optimizer}: {fused} ms against {unfused} ms "
    "unfused, medians of {steps} updates)",
    "gain_not_material": "fused update measured faster but by too little to change the run's numbers for: not "
    "used ({optimizer}: {gain} ms saved of a {step} ms step, under {share:.0%}, or within the two arms' spread "
    "of {spread} ms)",
    "remembered_timing": "{decision}, as timed in run {run} on {date} ({speedup}x the update) with the same script, "
    "model and inputs: taken at the step that run took it",
    "not_timed_several_ranks": "the fused update kept untimed: with several ranks each would decide on its own "
    "timings, and replicas updated by different kernels would drift apart",
    # notes: the rounding the fused update adds was not measured (the report says "not measured")
    "rounding_not_measured_memory": "rounding not measured: a copy of {optimizer}'s parameters, gradients "
    "and state ({gb:.2f} GB) would take more than {share:.0%} of the memory free",
    "rounding_not_measured_dtensor": "rounding not measured: {optimizer}'s parameters are DTensors, whose "
    "comparison would be a collective",
    "rounding_not_measured_shared": "rounding not measured: {optimizer}'s parameters are in shared memory, "
    "where other processes may update them during the step (Hogwild)",
}
