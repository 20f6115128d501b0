"""Stanford Alpaca's supervised fine-tuning (prompt tokens masked with -100) on a tiny GPT-2, one prompt too long.

Source: https://github.com/tatsu-lab/stanford_alpaca, train.py, commit 761dc5bfbdeeffa89b8bff5d038781a4055f796a, license Apache-2.0.
Changed: the LLaMA checkpoint and tokenizer are replaced by a GPT2LMHeadModel built from a tiny config
(2 layers, 64 wide) and a character tokenizer made here (model_max_length 512); alpaca_data.json is replaced
by 40 copy-the-input instructions made from the zoo's char corpus, one of which has a 600-character input;
Trainer's loop is the zoo loop with per-device batch 1 and gradient accumulation 4, AdamW 1e-3, cosine with
3% warm-up. PROMPT_DICT, _tokenize_fn and preprocess (label[:source_len] = IGNORE_INDEX) are the Alpaca code.
Kind: broken. The long example's prompt alone fills model_max_length, so truncation leaves no response
token and preprocess sets every label to -100; GPT-2's mean cross-entropy over zero tokens is 0/0 = NaN on
the micro-batch holding it, at step 5 (loss 3.68 -> 3.29 over steps 0-4). Dropping examples whose prompt
fills the context holds (final level 2.87).
"""

from __future__ import annotations

import copy
import random
import sys
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _data import char_corpus  # noqa: E402

STEPS = 30
KIND = "broken"
FIXES = {"drop_truncated": "drop examples whose prompt alone fills model_max_length (no response token left)"}
TRUTH = {"cause": "data", "mechanism": None, "module": "(loss_fn)", "onset": None,
         "how": ("Public report: https://github.com/pytorch/pytorch/issues/116349 (CrossEntropyLoss(reduction='mean') "
                 'returns nan when every target equals ignore_index=-100). Op: the causal-LM cross-entropy inside '
                 "GPT2LMHeadModel.forward (transformers' ForCausalLMLoss, F.cross_entropy mean, ignore_index -100) on "
                 "the micro-batch holding the 600-character input: its prompt fills model_max_length 512, so Alpaca's "
                 'preprocess sets all labels to -100 and the mean is 0/0 = NaN at step 5 (loss 3.68 -> 3.29 over steps '
                 "0-4). The logits are finite; the NaN is made by the loss op (in the model's forward, outside every "
                 'submodule).')}

IGNORE_INDEX = -100
PROMPT_DICT = {
    "prompt_input": (
        "Below is an instruction that describes a task, paired with an input that provides further context. "
        "Write a response that appropriately completes the request.\n\n"
        "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:"
    ),
    "prompt_no_input": (
        "Below is an instruction that describes a task. "
        "Write a response that appropriately completes the request.\n\n"
        "### Instruction:\n{instruction}\n\n### Response:"
    ),
}


class CharTokenizer:
    """Stands in for the LLaMA tokenizer: one id per character, [PAD]=0, </s>=1."""

    def __init__(self, model_max_length=512):
        chars = sorted(set(PROMPT_DICT["prompt_input"] + char_corpus(20000) + "Copy the input text exactly."))
        self.stoi = {c: i + 2 for i, c in enumerate(chars)}
        self.pad_token_id, self.eos_token = 0, "</s>"
        self.model_max_length = model_max_length
        self.vocab_size = len(chars) + 2

    def __call__(self, text, return_tensors="pt", padding="longest", max_length=None, truncation=True):
        eos = text.endswith(self.eos_token)
        body = text[: -len(self.eos_token)] if eos else text
        ids = [self.stoi[c] for c in body] + ([1] if eos else [])
        if truncation and max_length is not None:
            ids = ids[:max_length]
        return transformers.BatchEncoding({"input_ids": torch.tensor([ids])})


def _tokenize_fn(strings, tokenizer):
    """Tokenize a list of strings."""
    tokenized_list = [
        tokenizer(
            text,
            return_tensors="pt",
            padding="longest",
            max_length=tokenizer.model_max_length,
            truncation=True,
        )
        for text in strings
    ]
    input_ids = labels = [tokenized.input_ids[0] for tokenized in tokenized_list]
    input_ids_lens = labels_lens = [
        tokenized.input_ids.ne(tokenizer.pad_token_id).sum().item() for tokenized in tokenized_list
    ]
    return dict(input_ids=input_ids, labels=labels, input_ids_lens=input_ids_lens, labels_lens=labels_lens)


def preprocess(sources, targets, tokenizer):
    """Preprocess the data by tokenizing."""
    examples = [s + t for s, t in zip(sources, targets)]
    examples_tokenized, sources_tokenized = [_tokenize_fn(strings, tokenizer) for strings in (examples, sources)]
    input_ids = examples_tokenized["input_ids"]
    labels = copy.deepcopy(input_ids)
    for label, source_len in zip(labels, sources_tokenized["input_ids_lens"]):
        label[:source_len] = IGNORE_INDEX
    return dict(input_ids=input_ids, labels=labels)


def make_data(n=48, long_index=21, seed=0):
    rng = random.Random(seed)
    sentences = [s.strip() + "." for s in char_corpus(40000, seed=seed).split(".") if len(s.strip()) > 10]
    data = []
    for i in range(n):
        text = sentences[i]
        if i == long_index:
            text = " ".join(sentences[100:120])[:600]
        data.append({"instruction": "Copy the input text exactly.", "input": text, "output": text})
    rng.shuffle(data)
    return data


def build(tokenizer, list_data_dict):
    prompt_input = PROMPT_DICT["prompt_input"]
    sources = [prompt_input.format_map(example) for example in list_data_dict]
    targets = [f"{example['output']}{tokenizer.eos_token}" for example in list_data_dict]
    return preprocess(sources, targets, tokenizer)


def loss_fn(model, batch):
    input_ids, labels = batch
    return model(input_ids=input_ids, labels=labels).loss


def target(config=None):
    fix = (config or {}).get("fix")
    torch.manual_seed(0)
    tok = CharTokenizer()
    data = make_data()
    train, held = data[:40], data[40:]
    d = build(tok, train)
    pairs = list(zip(d["input_ids"], d["labels"]))
    if fix == "drop_truncated":
        pairs = [(i, l) for i, l in pairs if bool((l != IGNORE_INDEX).any())]
    g = torch.Generator().manual_seed(1)
    order = torch.randperm(len(pairs), generator=g).tolist()

    def batches(i):
        ids, lab = pairs[order[i % len(pairs)]]
        return ids.unsqueeze(0), lab.unsqueeze(0)

    config = transformers.GPT2Config(vocab_size=tok.vocab_size, n_positions=512, n_embd=64, n_layer=2, n_head=4,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=1, eos_token_id=1, pad_token_id=0)
    model = transformers.GPT2LMHeadModel(config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    sched = transformers.get_cosine_schedule_with_warmup(opt, num_warmup_steps=1, num_training_steps=STEPS)
    target.held = build(tok, held)
    return {"model": model, "loss_fn": loss_fn, "batches": batches, "optimizer": opt, "scheduler": sched,
            "accumulate": 4}


def evaluate(model):
    h = getattr(target, "held", None)
    with torch.no_grad():
        losses = [float(model(input_ids=i.unsqueeze(0), labels=l.unsqueeze(0)).loss)
                  for i, l in zip(h["input_ids"], h["labels"])]
    return sum(losses) / len(losses)


if __name__ == "__main__":
    from _loop import main
    main(target, STEPS, FIXES)
