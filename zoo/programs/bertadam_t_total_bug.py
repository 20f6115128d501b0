"""pytorch-pretrained-BERT's BERTAdam (warmup_linear applied inside step()) with t_total computed too small.

Source: https://github.com/huggingface/transformers, pytorch_pretrained_bert/optimization.py, commit 1de35b624b9d7998feb4d518e4f7e8e53abac4e1, license Apache-2.0.
Changed: BERTAdam and warmup_linear copied (the deprecated add_(scalar, tensor)/addcmul_(scalar, ...) calls
written with alpha=/value=); BERT itself is replaced by a small classifier (BertPooler-like Linear+Tanh,
dropout, classifier Linear) on scikit-learn's bundled 8x8 digits (batch 32, 300 steps, lr 1e-3, warmup 0.1);
t_total is computed from a count 3x too small, as in https://github.com/huggingface/transformers/issues/132
(run_squad.py counted training examples instead of features), so t_total = 109 for a 300-step run.
Kind: trajectory. t_total = int(500 / 32 * 7) = 109 for a 300-step run. warmup_linear
returns 1 - step/t_total, so the LR BERTAdam applies falls to 0 at step 109 and is negative after it
(-1.6e-3 by step 290): gradient ascent. The loss bottoms at ~0.05 around step 110, climbs past 0.85 at
step 140 and reaches ~100 (held-out CE 2.32 -> 102). The right t_total holds (held-out 0.24); a 1e-5 LR
only stops learning, and global clipping does not touch the sign of the LR (neither holds).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils import clip_grad_norm_
from torch.optim import Optimizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _data import digits  # noqa: E402

STEPS = 300
KIND = "trajectory"
FIXES = {"t_total": "t_total = the real number of optimizer steps (300, counted from the batches actually run)",
         "low_lr": "learning_rate 1e-5 (warmup 0.1 kept, t_total still 100)",
         "clip": "global clip_grad_norm_(model.parameters(), 0.1) before BERTAdam.step (t_total still 100)"}
TRUTH = {"cause": "lr_spike", "mechanism": "lr_schedule", "module": None, "onset": [109, 110],
         "how": "measure()'s applied_lr (lr * warmup_linear(step / t_total), what BERTAdam.step used) is "
                "3.7e-5 at step 105, 0 at step 109 and -9.2e-6 at step 110, then falls linearly to -1.6e-3; "
                "the loss climbs from ~0.07 to 0.85 by step 140 and ~100 at the end "
                "(zoo/truth/bertadam_t_total_bug.log)"}

LR, WARMUP, BATCH = 1e-3, 0.1, 32


def warmup_cosine(x, warmup=0.002):
    if x < warmup:
        return x/warmup
    return 0.5 * (1.0 + torch.cos(math.pi * x))


def warmup_constant(x, warmup=0.002):
    if x < warmup:
        return x/warmup
    return 1.0


def warmup_linear(x, warmup=0.002):
    if x < warmup:
        return x/warmup
    return 1.0 - x


SCHEDULES = {
    'warmup_cosine': warmup_cosine,
    'warmup_constant': warmup_constant,
    'warmup_linear': warmup_linear,
}


class BERTAdam(Optimizer):
    """Implements BERT version of Adam algorithm with weight decay fix (and no )."""
    def __init__(self, params, lr, warmup=-1, t_total=-1, schedule='warmup_linear',
                 b1=0.9, b2=0.999, e=1e-6, weight_decay_rate=0.01,
                 max_grad_norm=1.0):
        defaults = dict(lr=lr, schedule=schedule, warmup=warmup, t_total=t_total,
                        b1=b1, b2=b2, e=e, weight_decay_rate=weight_decay_rate,
                        max_grad_norm=max_grad_norm)
        super(BERTAdam, self).__init__(params, defaults)

    def get_lr(self):
        lr = []
        for group in self.param_groups:
            for p in group['params']:
                state = self.state[p]
                if len(state) == 0:
                    return [0]
                if group['t_total'] != -1:
                    schedule_fct = SCHEDULES[group['schedule']]
                    lr_scheduled = group['lr'] * schedule_fct(state['step']/group['t_total'], group['warmup'])
                else:
                    lr_scheduled = group['lr']
                lr.append(lr_scheduled)
        return lr

    def step(self, closure=None):
        loss = None
        if closure is not None:
            loss = closure()
        for group in self.param_groups:
            for p in group['params']:
                if p.grad is None:
                    continue
                grad = p.grad.data
                state = self.state[p]
                if len(state) == 0:
                    state['step'] = 0
                    state['next_m'] = torch.zeros_like(p.data)
                    state['next_v'] = torch.zeros_like(p.data)
                next_m, next_v = state['next_m'], state['next_v']
                beta1, beta2 = group['b1'], group['b2']
                # Add grad clipping
                if group['max_grad_norm'] > 0:
                    clip_grad_norm_(p, group['max_grad_norm'])
                next_m.mul_(beta1).add_(grad, alpha=1 - beta1)
                next_v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                update = next_m / (next_v.sqrt() + group['e'])
                if group['weight_decay_rate'] > 0.0:
                    update += group['weight_decay_rate'] * p.data
                if group['t_total'] != -1:
                    schedule_fct = SCHEDULES[group['schedule']]
                    lr_scheduled = group['lr'] * schedule_fct(state['step']/group['t_total'], group['warmup'])
                else:
                    lr_scheduled = group['lr']
                update_with_lr = lr_scheduled * update
                p.data.add_(-update_with_lr)
                state['step'] += 1
        return loss


class Classifier(nn.Module):
    """A BertForSequenceClassification-shaped head: pooler (dense + tanh), dropout, classifier."""

    def __init__(self, hidden=128, num_labels=10):
        super().__init__()
        self.embeddings = nn.Linear(64, hidden)
        self.dense = nn.Linear(hidden, hidden)
        self.activation = nn.Tanh()
        self.dropout = nn.Dropout(0.1)
        self.classifier = nn.Linear(hidden, num_labels)

    def forward(self, x):
        h = torch.relu(self.embeddings(x.flatten(1)))
        return self.classifier(self.dropout(self.activation(self.dense(h))))


def loss_fn(model, batch):
    x, y = batch
    return F.cross_entropy(model(x), y)


def target(config=None):
    fix = (config or {}).get("fix")
    torch.manual_seed(42)
    x, y = digits()
    x_tr, y_tr, x_va, y_va = x[:1500], y[:1500], x[1500:], y[1500:]
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x_tr, y_tr), batch_size=BATCH, shuffle=True,
                                         drop_last=True, generator=torch.Generator().manual_seed(42))
    model = Classifier()
    model.val = (x_va, y_va)
    num_train_epochs = math.ceil(STEPS / len(loader))
    # the bug: the step count comes from a number 3x smaller than the batches really run (examples vs features)
    num_counted = len(x_tr) // 3
    t_total = STEPS if fix == "t_total" else int(num_counted / BATCH * num_train_epochs)
    opt = BERTAdam(model.parameters(), lr=1e-5 if fix == "low_lr" else LR, warmup=WARMUP, t_total=t_total)
    model.optimizer_ref = opt  # for measure()
    return {"model": model, "loss_fn": loss_fn, "batches": loader, "epochs": num_train_epochs, "optimizer": opt,
            "max_grad_norm": 0.1 if fix == "clip" else None}


def measure(model, step):
    """Truth-side precursor: the LR multiplier BERTAdam applied at this step (warmup_linear(step/t_total))."""
    opt = model.optimizer_ref
    g = opt.param_groups[0]
    applied = g['lr'] * SCHEDULES[g['schedule']](step / g['t_total'], g['warmup'])
    return {"applied_lr": applied}


def evaluate(model):
    """Held-out cross-entropy on the last 297 digits."""
    model.eval()
    with torch.no_grad():
        v = float(F.cross_entropy(model(model.val[0]), model.val[1]))
    model.train()
    return v


if __name__ == "__main__":
    from _loop import main
    main(target, STEPS, FIXES)
