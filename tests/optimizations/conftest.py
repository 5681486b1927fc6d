"""Fixtures of the optimization units' tests."""

import pytest
import torch.distributed as dist


@pytest.fixture
def process_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture
def capture_one_off(monkeypatch):
    """``given(BackendClass, seconds)``: every capture's one-off is estimated at ``seconds`` there (the
    floor, with a rate too small to lift any model above it), whatever the model and the cache hold."""

    def given(backend_class, seconds):
        monkeypatch.setattr(backend_class, "least_capture_one_off_s", seconds)
        monkeypatch.setattr(backend_class, "capture_one_off_rate_s", 1e-12)

    return given
