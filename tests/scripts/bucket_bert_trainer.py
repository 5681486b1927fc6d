"""Hugging Face Trainer with DataCollatorWithPadding on a tiny BERT built from a config (no
download): sequences of 8-64 tokens, each batch padded to its longest, an evaluation pass at the
end. Dropout is off, so that a padded run's losses can be set against plain's. Prints the losses
the Trainer logged (repr) and the evaluation loss. STEPS (default 32)."""

import os
import sys
import tempfile

import torch
import transformers

VOCAB, SAMPLES = 200, 512


def tokenizer(folder: str):
    path = os.path.join(folder, "vocab.txt")
    with open(path, "w") as file:
        file.write("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *(f"w{i}" for i in range(VOCAB - 5))]))
    return transformers.BertTokenizerFast(vocab_file=path)


def dataset(count: int, seed: int) -> list:
    generator = torch.Generator().manual_seed(seed)
    items = []
    for length in torch.randint(8, 65, (count,), generator=generator).tolist():
        ids = [2, *torch.randint(5, VOCAB, (length - 2,), generator=generator).tolist(), 3]
        items.append({"input_ids": ids, "token_type_ids": [0] * length, "label": sum(ids[1:4]) % 2})
    return items


def model():
    config = transformers.BertConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=128,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        num_labels=2,
    )
    torch.manual_seed(0)
    return transformers.BertForSequenceClassification(config)


def trainer(folder: str, steps: int):
    args = transformers.TrainingArguments(
        output_dir=folder,
        per_device_train_batch_size=16,
        per_device_eval_batch_size=16,
        max_steps=steps,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
    )
    return transformers.Trainer(
        model=model(),
        args=args,
        train_dataset=dataset(SAMPLES, 0),
        eval_dataset=dataset(64, 1),
        data_collator=transformers.DataCollatorWithPadding(tokenizer(folder)),
    )


def main() -> None:
    with tempfile.TemporaryDirectory() as folder:
        run = trainer(folder, int(os.environ.get("STEPS", "32")))
        run.train()
        for entry in run.state.log_history:
            if "loss" in entry:
                print(f"loss {entry['loss']!r}")
        print(f"eval {run.evaluate()['eval_loss']!r}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
