"""transformers.Trainer on a tiny GPT-2 whose SFT batch has every label ignored; the only nanprobe line
is the callback.

    pip install -e ".[transformers]" && python examples/integrations/transformers_sft_all_ignored.py

Prompt tokens carry label -100; some samples lost their completion, so all their labels are -100.
When a batch holds only such samples the Trainer's loss divides a sum of 0 tokens by 0: NaN.
NanprobeCallback skips that update, diagnoses the step with the Trainer's own compute_loss and
writes the report to nanprobe-reports/. Nothing is downloaded: the model is built from a config.
"""

import os
import tempfile

import torch
import transformers

from nanprobe.integrations.transformers import NanprobeCallback

os.environ.setdefault("HF_HUB_OFFLINE", "1")


class SFTData(torch.utils.data.Dataset):
    def __init__(self, n=12, seq=8, vocab=64, lost=(2, 5, 7, 9)):
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab, (n, seq), generator=g)
        self.labels = self.ids.clone()
        self.labels[:, :4] = -100        # the prompt
        self.labels[list(lost)] = -100   # samples whose completion was lost

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


def main() -> None:
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, bos_token_id=0, eos_token_id=0,
                                                                 n_positions=16))
    args = transformers.TrainingArguments(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=2,
                                          num_train_epochs=2, use_cpu=True, report_to=[], save_strategy="no",
                                          logging_strategy="no", seed=0, learning_rate=1e-3, disable_tqdm=True)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=SFTData(),
                                   callbacks=[NanprobeCallback()])   # <- the one line nanprobe needs
    trainer.train()


if __name__ == "__main__":
    main()
