"""One ordering of import torch / enable / disable per run; prints what is patched, as JSON.

Usage: python guard_matrix.py SCENARIO. Run in a fresh interpreter so each ordering starts clean.
"""

import json
import sys

import autogaudi


def patch_depth(function):
    import wrapt

    depth = 0
    while isinstance(function, wrapt.FunctionWrapper):
        depth, function = depth + 1, function.__wrapped__
    return depth


def state():
    import torch
    from torch.optim.optimizer import _global_optimizer_post_hooks

    # destroy_process_group: the session's own patch (ranks post their report rows before it)
    depths = {patch_depth(torch.autograd.backward), patch_depth(torch.distributed.destroy_process_group)}
    assert len(depths) == 1, depths
    return {"depth": depths.pop(), "post_hooks": len(_global_optimizer_post_hooks)}


scenario = sys.argv[1]
seen = {}
if scenario == "torch_first":
    import torch

    original = torch.autograd.backward
    original_destroy = torch.distributed.destroy_process_group
    autogaudi.enable()
    autogaudi.enable()
    seen["enabled_twice"] = state()
    autogaudi.disable()
    seen["disabled"] = state()
    seen["identity_restored"] = (
        torch.autograd.backward is original and torch.distributed.destroy_process_group is original_destroy
    )
    autogaudi.enable()
    seen["enabled_again"] = state()
    autogaudi.disable()
    seen["identity_restored_again"] = (
        torch.autograd.backward is original and torch.distributed.destroy_process_group is original_destroy
    )
elif scenario == "enable_first":
    autogaudi.enable()
    seen["torch_loaded_by_enable"] = "torch" in sys.modules
    seen["report_before_torch"] = str(autogaudi.report())
    import torch

    seen["after_import"] = state()
    autogaudi.disable()
    seen["disabled"] = state()
    seen["plain_function"] = type(torch.autograd.backward).__name__
elif scenario == "reconfigure":
    import torch

    autogaudi.enable()
    autogaudi.enable(log_every=5)
    seen["after"] = state()
    seen["log_every"] = autogaudi.active_options().log_every
elif scenario == "everything_at_once":  # run under the launcher with AUTOGAUDI=1 as well
    autogaudi.enable()
    import torch

    seen["after"] = state()
    seen["log_every"] = autogaudi.active_options().log_every
print(json.dumps(seen))
