"""Backend detection and primitives: plain CPU for real, HPU against the API-faithful double."""

import pytest
import torch

from autogaudi import backends
from autogaudi.backends.base import GB

CUDA = torch.cuda.is_available()


def test_auto_picks_the_best_device_present_and_the_reason_names_what_was_ruled_out():
    backend = backends.select("auto")
    assert backend.name == ("cuda" if CUDA else "cpu") and not backend.is_lazy
    assert "hpu: habana_frameworks.torch is not installed" in backend.reason
    if not CUDA:
        assert "cuda: torch.cuda.is_available() is False" in backend.reason


def test_cpu_memory_figures_come_from_the_process():
    memory = backends.select("cpu").memory_stats()
    assert 0 < memory.allocated <= memory.max_allocated < memory.total


def test_a_requested_device_that_is_missing_falls_back_with_the_reason():
    backend = backends.select("hpu")
    assert backend.name == ("cuda" if CUDA else "cpu")
    assert "requested hpu: habana_frameworks.torch is not installed" in backend.reason


@pytest.mark.skipif(CUDA, reason="this machine has CUDA")
def test_requesting_cuda_without_it_falls_back_to_cpu():
    backend = backends.select("cuda")
    assert backend.name == "cpu"
    assert backend.reason.startswith("always available; requested cuda: torch.cuda.is_available() is False")


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device (run on a lent GPU)")
def test_cuda_backend_on_a_real_gpu():
    backend = backends.select("cuda")
    assert backend.name == "cuda" and backend.device_name() == torch.cuda.get_device_name()
    block = torch.ones(1024, 1024, device="cuda")
    memory = backend.memory_stats()
    assert block.numel() * 4 <= memory.allocated <= memory.max_allocated < memory.total
    params = [torch.nn.Parameter(torch.ones(3, device="cuda"))]
    assert backend.fused_optimizer_refusal(torch.optim.AdamW, torch.optim.AdamW(params).defaults) is None


def test_cpu_fuses_through_torchs_own_kernels_where_torch_has_them():
    backend = backends.select("cpu")
    params = [torch.nn.Parameter(torch.ones(3))]
    adamw = torch.optim.AdamW(params).defaults
    assert backend.fused_optimizer_refusal(torch.optim.AdamW, adamw) is None
    assert backend.fused_optimizer(torch.optim.AdamW, params, adamw) is None  # no separate object: fused=True
    assert backend.fused_optimizer_refusal(torch.optim.Adadelta, {}) == "torch has no fused Adadelta"
    assert backend.fused_optimizer_refusal(torch.optim.AdamW, {**adamw, "foreach": True}) == (
        "foreach=True cannot be combined with fused=True"
    )


def test_hpu_lazy_mode_against_the_double(hpu_double):
    calls = hpu_double(lazy=True)
    import habana_frameworks.torch._calls as record

    record.MEMORY.update(InUse=2 * GB, MaxInUse=3 * GB)
    backend = backends.select("auto")
    assert (backend.name, backend.is_lazy, backend.device_name()) == ("hpu", True, "GAUDI2")
    assert backend.reason == "1 Gaudi device(s), lazy mode"
    assert backend.pin_memory_device == "hpu"
    assert torch.hpu.get_device_name() == "GAUDI2"  # the bridge registered torch.hpu
    backend.mark_step()
    backend.synchronize()
    assert calls.names() == ["mark_step", "mark_step", "synchronize"]  # synchronize marks a step in lazy mode
    assert backend.memory_stats().as_dict() == {
        "memory_allocated_gb": 2.0,
        "max_memory_allocated_gb": 3.0,
        "total_memory_available_gb": 96.0,
    }
    model = torch.nn.Linear(2, 2)
    replay = backend.graph_forward(model)
    assert "forward" not in vars(model)  # the module is left as it was
    batch = torch.randn(3, 2)
    torch.testing.assert_close(replay(batch), model(batch))
    assert calls.names()[-2:] == ["module_cacher", "module_cacher_capture"]


def test_hpu_eager_mode_has_no_marks_and_compiles(hpu_double, monkeypatch):
    calls = hpu_double(lazy=False)
    backend = backends.select("hpu")
    assert (backend.name, backend.is_lazy) == ("hpu", False)
    assert backend.reason == "1 Gaudi device(s), eager mode"
    backend.mark_step()
    assert calls.names() == []
    compiled = []
    monkeypatch.setattr(torch, "compile", lambda module, **kwargs: compiled.append(kwargs) or module)
    backend.graph_forward(torch.nn.Linear(2, 2))
    assert compiled == [{"backend": "hpu_backend"}]


def test_hpu_fused_adamw_gets_torchs_values_not_its_own_defaults(hpu_double):
    hpu_double(lazy=True)
    backend = backends.select("hpu")
    params = [torch.nn.Parameter(torch.ones(3))]
    defaults = torch.optim.AdamW(params).defaults  # eps 1e-8, weight_decay 1e-2
    fused = backend.fused_optimizer(torch.optim.AdamW, params, defaults)
    assert type(fused).__name__ == "FusedAdamW"
    assert (fused.defaults["eps"], fused.defaults["weight_decay"]) == (1e-8, 1e-2)
    assert backend.fused_optimizer(torch.optim.AdamW, params, {**defaults, "amsgrad": True}) is None
    assert backend.fused_optimizer_refusal(torch.optim.AdamW, {**defaults, "amsgrad": True, "maximize": True}) == (
        "FusedAdamW has no amsgrad=True, maximize=True"
    )
    adam_l2 = torch.optim.Adam(params, weight_decay=0.1).defaults
    assert backend.fused_optimizer_refusal(torch.optim.Adam, adam_l2) == (
        "no Gaudi fused optimizer for Adam with L2 weight decay (it decays like AdamW)"
    )
    assert (
        type(backend.fused_optimizer(torch.optim.SGD, params, torch.optim.SGD(params, lr=0.1).defaults)).__name__
        == "FusedSGD"
    )


def test_hpu_fused_adamw_matches_torch_adamw_numerically(hpu_double):
    hpu_double(lazy=True)
    backend = backends.select("hpu")
    torch.manual_seed(0)
    reference = torch.nn.Linear(8, 2)
    fused_model = torch.nn.Linear(8, 2)
    fused_model.load_state_dict(reference.state_dict())
    plain = torch.optim.AdamW(reference.parameters(), lr=0.01)
    fused = backend.fused_optimizer(torch.optim.AdamW, fused_model.parameters(), plain.defaults)
    for _ in range(25):
        batch = torch.randn(4, 8)
        for model, optimizer in ((reference, plain), (fused_model, fused)):
            model(batch).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
    torch.testing.assert_close(fused_model.weight, reference.weight, rtol=1e-5, atol=1e-6)
    assert isinstance(fused.state[fused_model.weight]["step"], int)  # a bridge quirk the double keeps


def test_hpu_fused_clip_norm_and_sdpa_match_torch(hpu_double):
    calls = hpu_double(lazy=True)
    backend = backends.select("hpu")
    torch.manual_seed(0)
    a, b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
    b.load_state_dict(a.state_dict())
    batch = torch.randn(4, 8)
    for model in (a, b):
        model(batch).pow(2).sum().backward()
    expected = torch.nn.utils.clip_grad_norm_(a.parameters(), 0.5)
    clip = backend.fused_clip_norm(list(b.parameters()), 0.5)
    total = clip(list(b.parameters()))
    torch.testing.assert_close(total, expected)
    torch.testing.assert_close(b.weight.grad, a.weight.grad)
    q, k, v = (torch.randn(2, 4, 16, 8) for _ in range(3))
    out = backend.fused_sdpa().apply(q, k, v, None, 0.0, True)
    torch.testing.assert_close(out, torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True))
    # lazy mode: the bridge's clip_norm marks a step before clipping and after
    assert calls.names() == ["FusedClipNorm", "mark_step", "FusedClipNorm.clip_norm", "mark_step", "FusedSDPA.apply"]
    with pytest.raises(RuntimeError, match="float32 and bfloat16 only"):
        backend.fused_sdpa().apply(q.half(), k.half(), v.half())


def test_cudas_replay_tier_is_torch_compiles_cudagraphs_backend(monkeypatch):
    """The replay tier records torch's own kernels (no inductor): built without a GPU, the call is checked here."""
    from autogaudi.backends import cuda

    calls = []
    monkeypatch.setattr(cuda, "compile_calls", lambda module, **options: calls.append((module, options)) or "graphed")
    backend = cuda.CudaBackend("test")
    module = torch.nn.Linear(2, 2)
    assert backend.graph_replay(module) == "graphed"
    assert calls == [(module, {"backend": "cudagraphs", "dynamic": False})]
    assert "cudagraphs" in backend.graph_kind() and backend.replay_one_off_rate_s < backend.capture_one_off_rate_s


def test_cudas_replay_tier_records_a_static_graph_for_each_new_batch_size(monkeypatch):
    """A smaller last batch must get a graph of its own shape: the cudagraphs backend cannot replay a
    graph made dynamic. The tier's own options, with a recording backend in place of CUDA graphs."""
    from autogaudi.backends import base, cuda

    graphs = []

    def recording(graph_module, example_inputs):
        graphs.append([value if isinstance(value, torch.Tensor) else "symbolic" for value in example_inputs])
        return graph_module.forward

    def compile_calls(module, backend, **options):
        return base.compile_calls(module, backend=recording, **options)

    monkeypatch.setattr(cuda, "compile_calls", compile_calls)
    module = torch.nn.Linear(3, 2)
    graphed = cuda.CudaBackend("test").graph_replay(module)
    try:
        for batch in (8, 5, 3):
            inputs = torch.randn(batch, 3)
            torch.testing.assert_close(graphed(inputs), module(inputs))
    finally:
        base.release_compiled_calls()
    assert len(graphs) == 3 and "symbolic" not in sum(graphs, [])
    assert [(batch, 3) in [tuple(value.shape) for value in graph] for graph, batch in zip(graphs, (8, 5, 3))] == [
        True
    ] * 3
