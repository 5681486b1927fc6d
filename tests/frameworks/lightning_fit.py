"""PyTorch Lightning's Trainer.fit on the CPU, as its docs write it: the LightningModule returns the
loss, Lightning calls backward and optimizer.step(closure). Prints the losses as one JSON line."""

import json

import lightning
import torch


class Classifier(lightning.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(20, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))
        self.losses = []

    def training_step(self, batch, _index):
        inputs, labels = batch
        loss = torch.nn.functional.cross_entropy(self.net(inputs), labels)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)


def main():
    lightning.seed_everything(0, verbose=False)
    generator = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(
        torch.randn(512, 20, generator=generator), torch.randint(0, 2, (512,), generator=generator)
    )
    loader = torch.utils.data.DataLoader(data, batch_size=16)
    model = Classifier()
    trainer = lightning.Trainer(
        max_epochs=2,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        gradient_clip_val=1.0,
    )
    trainer.fit(model, loader)
    print(json.dumps({"losses": model.losses}))


if __name__ == "__main__":
    main()
