"""cuda_train.py's model and seeding: the CUDA call a script's own module makes (read by
gpu_migration before the script runs, with the script)."""

import torch


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))

    def forward(self, inputs):
        return self.body(inputs)


def seeded(seed: int) -> None:
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)
