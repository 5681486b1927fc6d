import time

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset


class Slow(Dataset):
    def __len__(self):
        return 1024

    def __getitem__(self, index):
        time.sleep(0.002)  # decoding, augmenting...
        return torch.randn(16), index % 4


torch.manual_seed(0)
model = nn.Linear(16, 4)
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
loader = DataLoader(Slow(), batch_size=16)  # doctor: input_bound
for inputs, labels in loader:
    loss = nn.functional.cross_entropy(model(inputs), labels)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
