"""A Hugging Face Trainer run as a user writes it: a tiny BERT built from a config (random weights,
no download), a torch Dataset of random token ids, Trainer's own AdamW and DataLoader. Prints the
logged losses as one JSON line. Dropout is off so that a compiled forward (graph_capture) draws no
random masks of its own and the losses are comparable step by step."""

import json
import sys

import torch
from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments


class RandomTokens(torch.utils.data.Dataset):
    def __init__(self, samples=160, length=16, vocab=100):
        generator = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab, (samples, length), generator=generator)
        self.labels = torch.randint(0, 2, (samples,), generator=generator)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, index):
        return {"input_ids": self.ids[index], "labels": self.labels[index]}


def main():
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=100,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=32,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    model = BertForSequenceClassification(config)
    arguments = TrainingArguments(
        output_dir=sys.argv[1],
        max_steps=20,
        per_device_train_batch_size=8,
        learning_rate=1e-3,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
        max_grad_norm=1.0,
    )
    trainer = Trainer(model=model, args=arguments, train_dataset=RandomTokens())
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    print(
        json.dumps(
            {
                "losses": losses,
                "optimizer": type(
                    trainer.optimizer.optimizer if hasattr(trainer.optimizer, "optimizer") else trainer.optimizer
                ).__name__,
            }
        )
    )


if __name__ == "__main__":
    main()
