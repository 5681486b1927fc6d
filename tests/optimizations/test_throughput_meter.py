"""throughput_meter: samples/s consistent with steps/s × batch size; batch sizes found in nested batches."""

import torch
from torch.utils.data import DataLoader, TensorDataset

import autogaudi
from autogaudi.optimizations.throughput_meter import leading_dimension


def test_leading_dimension_of_collated_batches():
    assert leading_dimension(torch.zeros(5, 3)) == 5
    assert leading_dimension((torch.tensor(1.0), [torch.zeros(7)])) == 7
    assert leading_dimension({"input_ids": torch.zeros(4, 9), "labels": torch.zeros(4)}) == 4
    assert leading_dimension(("text", 3)) is None


def test_samples_per_second_follows_steps_per_second():
    autogaudi.enable(device="cpu", only="throughput_meter")
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = DataLoader(TensorDataset(torch.randn(160, 4)), batch_size=8)
    for (inputs,) in loader:
        model(inputs).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    report = autogaudi.report()
    steps_per_s = report.as_dict()["steps"]["steps_per_s"]
    samples_per_s = report.unit("throughput_meter")["figures"]["samples_per_s"]
    assert abs(samples_per_s / (8 * steps_per_s) - 1) < 0.15  # one batch of 8 per step
