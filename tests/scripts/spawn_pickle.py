"""A Dataset class defined in the script, loaded by spawned DataLoader workers (needs pickling)."""

import torch
from torch.utils.data import DataLoader, Dataset


class Squares(Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, index):
        return torch.tensor([float(index) ** 2])


if __name__ == "__main__":
    loader = DataLoader(Squares(), batch_size=4, num_workers=2, multiprocessing_context="spawn")
    print(sum(float(batch.sum()) for batch in loader))
