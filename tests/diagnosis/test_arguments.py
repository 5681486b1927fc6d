"""The doctor on a model called with every kind of argument: it never fails on one, and it names a
Python number whose value changes from call to call (and only such a number)."""

import json
import textwrap

import pytest

import autogaudi

STEPS = 4
SCRIPT = """
import dataclasses

import torch
from torch import nn


@dataclasses.dataclass
class Batch:
    tensor: torch.Tensor
    step: int


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(4, 2)

    def forward(self, inputs, extra=None):
        return self.body(inputs)


torch.manual_seed(0)
model = Model()
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
for step in range(20):
    inputs = torch.randn(8, 4)
    loss = {call}.pow(2).mean()  # the call
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
"""

# (how the model is called, the argument the finding names, or None where none may be named)
CALLS = {
    "tensor": ("model(inputs, torch.randn(3))", None),
    "changing int": ("model(inputs, step)", "args[1]"),
    "constant int": ("model(inputs, 4)", None),
    "changing float": ("model(inputs, step * 0.5)", "args[1]"),
    "changing bool": ("model(inputs, step % 2 == 0)", "args[1]"),
    "None": ("model(inputs, None)", None),
    "changing string": ("model(inputs, f'step {step}')", None),
    "tuple nested with tensors": ("model(inputs, (torch.randn(2), [step, {'t': torch.randn(2)}]))", "args[1][1][0]"),
    "list of tensors": ("model(inputs, [torch.randn(2), torch.randn(3)])", None),
    "dict with a constant": ("model(inputs, {'t': torch.randn(2), 'scale': 1.0})", None),
    "dataclass-like object": ("model(inputs, Batch(torch.randn(2), step))", None),
    "keyword argument": ("model(inputs, extra=step)", None),
    "keyword tensor": ("model(inputs=inputs, extra=torch.randn(2))", None),
}


@pytest.mark.parametrize("kind", CALLS)
def test_the_doctor_never_fails_on_an_argument_and_names_a_changing_python_number(tmp_path, kind):
    call, named = CALLS[kind]
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(SCRIPT).replace("{call}", call))
    diagnosis = autogaudi.doctor(str(script), steps=STEPS)
    assert (diagnosis.outcome, diagnosis.steps_run) == ("stopped", STEPS), diagnosis.format()
    json.dumps(diagnosis.as_dict())  # the report is written whatever was passed
    diagnosis.format()
    found = [finding for finding in diagnosis.findings if finding.kind == "python_scalar"]
    assert "dynamic_shapes" not in diagnosis.kinds()  # a number is not a shape: named once, as itself
    if named is None:
        assert not found, diagnosis.format()
        return
    (finding,) = found
    line = next(number for number, text in enumerate(script.read_text().splitlines(), 1) if "# the call" in text)
    assert finding.location == (str(script), line)
    assert finding.evidence["argument"] == named and finding.evidence["module"] == "Model"
    assert finding.evidence["distinct_values"] == (2 if "bool" in kind else STEPS)
