"""The doctor's findings read from the script and its models: CUDA calls with what Intel's GPU
migration toolkit does with each, optimizers without a Gaudi fused kernel, hand-written attention,
and models ModuleCacher cannot capture (module hooks, *args forwards)."""

from autogaudi.diagnosis.findings import KINDS
from autogaudi.optimizations import gpu_migration
from tests.diagnosis.test_command import SCRIPTS, at_line, diagnose, marked_lines, only


def test_cuda_lines_say_what_the_toolkit_maps_them_to_and_a_cuda_library_is_high():
    diagnosis = diagnose("cuda_call.py")
    library, mapped = sorted(only(diagnosis, "cuda_call"), key=lambda finding: finding.severity != "high")
    assert (library.severity, library.evidence["library"]) == ("high", "flash_attn")
    assert at_line(library, "cuda_call.py", "cuda_call flash_attn")
    assert mapped.severity == "low" and mapped.fixed_by == "gpu_migration"
    assert at_line(mapped, "cuda_call.py", "cuda_call device")
    by_line = {call["line"]: call["toolkit"] for call in mapped.evidence["calls"]}
    marked = {
        line for marker, line in marked_lines(SCRIPTS / "cuda_call.py").items() if marker != "cuda_call flash_attn"
    }
    assert marked <= set(by_line)
    assert set(by_line.values()) <= set(gpu_migration.MAPPED.values())
    assert mapped.evidence["variable"] == "PT_HPU_GPU_MIGRATION=1"


def test_a_script_run_as_written_for_the_cpu_has_no_cuda_finding():
    assert not only(diagnose("clean.py"), "cuda_call")


def test_optimizers_without_a_fused_kernel_are_named_with_their_way_out():
    found = {
        finding.evidence["optimizer"]: finding
        for finding in only(diagnose("unfused_optimizer.py"), "unfused_optimizer")
    }
    assert set(found) == {"RMSprop", "Adam", "Adagrad"}
    assert "amsgrad=True" in found["Adam"].title
    assert "FusedAdagrad" in found["Adagrad"].fix and found["Adagrad"].fixed_by is None
    assert found["RMSprop"].fixed_by.startswith("fused_optimizer")


def test_hand_written_attention_is_found_and_sdpa_is_not():
    (finding,) = only(diagnose("manual_attention.py"), "manual_attention")
    assert finding.evidence == {"module": "HandAttention"}
    assert at_line(finding, "manual_attention.py", "manual_attention")
    assert finding.fixed_by.startswith("fused_sdpa")


def test_module_hooks_and_a_starred_forward_are_graph_blockers():
    found = {
        finding.evidence["blocker"]: finding for finding in only(diagnose("graph_blocker_hooks.py"), "graph_blocker")
    }
    assert set(found) == {"module_hooks", "positional_forward"}
    assert found["module_hooks"].evidence["where"] == "Linear"
    for blocker, finding in found.items():
        assert at_line(finding, "graph_blocker_hooks.py", f"graph_blocker {blocker}")


def test_a_read_inside_forward_is_a_graph_blocker_of_its_own_code():
    (finding,) = only(diagnose("graph_blocker.py"), "graph_blocker")
    assert finding.evidence["blocker"] == "host_read"


def test_the_new_kinds_are_known_to_the_command():
    assert {"cuda_call", "unfused_optimizer", "manual_attention"} <= set(KINDS)
