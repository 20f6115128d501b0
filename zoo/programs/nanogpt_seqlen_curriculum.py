"""karpathy/nanoGPT ``GPT`` (tiny char-level config) trained with a sequence-length curriculum 16 -> 32 -> 64.

Source: https://github.com/karpathy/nanoGPT, model.py, commit 3adf61e154c3fe3fca428ad6bc3818b27a3b8291, license MIT.
Changed: the shakespeare_char data (a download) is replaced by zoo/_data.py's char_corpus(20000) (first 90%
train, last 10% held out), character vocabulary; the model classes are copied from model.py (LayerNorm,
CausalSelfAttention with F.scaled_dot_product_attention, MLP, Block, GPTConfig, GPT with weight tying and
the GPT-2 init), shrunk to n_layer 2, n_head 4, n_embd 64, block_size 64, dropout 0.0; the parameter-count
print, generate() and from_pretrained() are left out. Training as the same commit's train.py (get_lr,
get_batch, AdamW setup) with config/train_shakespeare_char.py:
AdamW via configure_optimizers (lr 1e-3, betas (0.9, 0.99), weight decay 0.1), get_lr's warm-up (50
iters here) + cosine decay to 1e-4, grad clip 1.0; batch 32. The curriculum (a common nanoGPT
modification): get_batch draws sequences of 16 tokens for steps 0-199, 32 for 200-399, 64 for 400-599.
Kind: healthy. Each stage puts the loss on positions whose learned position embeddings (wpe) were never
trained, so the loss jumps: 1.24 -> 1.57 at step 200 (16 -> 32 tokens, level 1.23 -> 1.55) and 0.66 ->
1.83 at step 400 (32 -> 64, level 0.68 -> 1.67, 2.4x), then falls again; the final level 0.85 stays above
the best 0.675 (step 396, short context). The held-out loss at the full 64 context goes 3.28 (init) ->
1.92 (step 200) -> 1.86 (step 400) -> 0.85 (end); attention logits stay bounded (max |logit| <= 9.0).
"""


import inspect
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _data import char_corpus  # noqa: E402

STEPS = 600
STAGES = [(0, 16), (200, 32), (400, 64)]
KIND = "healthy"
FIXES: dict[str, str] = {}
TRUTH = {"cause": None, "mechanism": None, "module": None, "onset": None, "how": ("loss jumps at each curriculum stage (level 1.23 -> 1.55 at step 200, 0.68 -> 1.67 at step 400, "
                "2.4x) because the new positions' wpe rows are untrained; final level 0.85 above the best 0.675 "
                "(a shorter-context loss); held-out 64-token loss 3.28 -> 1.86 (step 400) -> 0.85; max attention "
                "logit <= 9.0; finite throughout")}

batch_size = 32
learning_rate = 1e-3
warmup_iters = 50
lr_decay_iters = STEPS
min_lr = 1e-4
weight_decay = 1e-1
beta1, beta2 = 0.9, 0.99
grad_clip = 1.0


class LayerNorm(nn.Module):
    """ LayerNorm but with an optional bias. PyTorch doesn't support simply bias=False """

    def __init__(self, ndim, bias):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None

    def forward(self, input):
        return F.layer_norm(input, self.weight.shape, self.weight, self.bias, 1e-5)


class CausalSelfAttention(nn.Module):

    def __init__(self, config):
        super().__init__()
        assert config.n_embd % config.n_head == 0
        # key, query, value projections for all heads, but in a batch
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        # output projection
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        # regularization
        self.attn_dropout = nn.Dropout(config.dropout)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.dropout = config.dropout

    def forward(self, x):
        B, T, C = x.size()  # batch size, sequence length, embedding dimensionality (n_embd)
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        y = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=None, dropout_p=self.dropout if self.training else 0, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # re-assemble all head outputs side by side
        # output projection
        y = self.resid_dropout(self.c_proj(y))
        return y


class MLP(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        x = self.c_fc(x)
        x = self.gelu(x)
        x = self.c_proj(x)
        x = self.dropout(x)
        return x


class Block(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.ln_1 = LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


@dataclass
class GPTConfig:
    block_size: int = 1024
    vocab_size: int = 50304
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = True


class GPT(nn.Module):

    def __init__(self, config):
        super().__init__()
        assert config.vocab_size is not None
        assert config.block_size is not None
        self.config = config

        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            ln_f=LayerNorm(config.n_embd, bias=config.bias),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # https://paperswithcode.com/method/weight-tying

        # init all weights
        self.apply(self._init_weights)
        # apply special scaled init to the residual projections, per GPT-2 paper
        for pn, p in self.named_parameters():
            if pn.endswith('c_proj.weight'):
                torch.nn.init.normal_(p, mean=0.0, std=0.02/math.sqrt(2 * config.n_layer))

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx, targets=None):
        device = idx.device
        b, t = idx.size()
        assert t <= self.config.block_size, f"Cannot forward sequence of length {t}, block size is only {self.config.block_size}"
        pos = torch.arange(0, t, dtype=torch.long, device=device)  # shape (t)

        # forward the GPT model itself
        tok_emb = self.transformer.wte(idx)  # token embeddings of shape (b, t, n_embd)
        pos_emb = self.transformer.wpe(pos)  # position embeddings of shape (t, n_embd)
        x = self.transformer.drop(tok_emb + pos_emb)
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)

        if targets is not None:
            logits = self.lm_head(x)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        else:
            logits = self.lm_head(x[:, [-1], :])  # note: using list [-1] to preserve the time dim
            loss = None

        return logits, loss

    def configure_optimizers(self, weight_decay, learning_rate, betas, device_type):
        param_dict = {pn: p for pn, p in self.named_parameters()}
        param_dict = {pn: p for pn, p in param_dict.items() if p.requires_grad}
        # Any parameters that is 2D will be weight decayed, otherwise no.
        decay_params = [p for n, p in param_dict.items() if p.dim() >= 2]
        nodecay_params = [p for n, p in param_dict.items() if p.dim() < 2]
        optim_groups = [
            {'params': decay_params, 'weight_decay': weight_decay},
            {'params': nodecay_params, 'weight_decay': 0.0}
        ]
        fused_available = 'fused' in inspect.signature(torch.optim.AdamW).parameters
        use_fused = fused_available and device_type == 'cuda'
        extra_args = dict(fused=True) if use_fused else dict()
        return torch.optim.AdamW(optim_groups, lr=learning_rate, betas=betas, **extra_args)


def get_lr(it):
    # 1) linear warmup for warmup_iters steps
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    # 2) if it > lr_decay_iters, return min learning rate
    if it > lr_decay_iters:
        return min_lr
    # 3) in between, use cosine decay down to min learning rate
    decay_ratio = (it - warmup_iters) / (lr_decay_iters - warmup_iters)
    coeff = 0.5 * (1.0 + math.cos(math.pi * decay_ratio))  # coeff ranges 0..1
    return min_lr + coeff * (learning_rate - min_lr)


def block_size_at(step):
    return [b for s, b in STAGES if step >= s][-1]


def _data():
    text = char_corpus(20000)
    chars = sorted(set(text))
    stoi = {c: i for i, c in enumerate(chars)}
    data = torch.tensor([stoi[c] for c in text], dtype=torch.long)
    n = int(0.9 * len(data))
    return data[:n], data[n:], len(chars)


def loss_fn(model, batch):
    x, y = batch
    _, loss = model(x, y)
    return loss


def target(config=None):
    torch.manual_seed(1337)
    train_data, _, vocab = _data()
    g = torch.Generator().manual_seed(1337)

    def get_batch(step):
        block_size = block_size_at(step)
        ix = torch.randint(len(train_data) - block_size, (batch_size,), generator=g)
        x = torch.stack([train_data[i:i + block_size] for i in ix])
        y = torch.stack([train_data[i + 1:i + 1 + block_size] for i in ix])
        return x, y

    model = GPT(GPTConfig(block_size=64, vocab_size=vocab, n_layer=2, n_head=4, n_embd=64, dropout=0.0,
                          bias=True))
    optimizer = model.configure_optimizers(weight_decay, learning_rate, (beta1, beta2), "cpu")
    sched = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda it: get_lr(it) / learning_rate)
    return {"model": model, "loss_fn": loss_fn, "batches": get_batch, "optimizer": optimizer,
            "scheduler": sched, "max_grad_norm": grad_clip}


def measure(model, step):
    """The curriculum's sequence length at this step, and the largest pre-softmax attention logit of
    block 0 on a fixed held-out 64-token window (the attention scale stays bounded)."""
    _, val, _ = _data()
    x = val[:64].view(1, -1)
    tr = model.transformer
    emb = tr.wte(x) + tr.wpe(torch.arange(64))
    attn = tr.h[0].attn
    q, k, _ = attn.c_attn(tr.h[0].ln_1(emb)).split(attn.n_embd, dim=2)
    hs = attn.n_embd // attn.n_head
    q = q.view(1, 64, attn.n_head, hs).transpose(1, 2)
    k = k.view(1, 64, attn.n_head, hs).transpose(1, 2)
    att = (q @ k.transpose(-2, -1)) / math.sqrt(hs)
    return {"block_size": float(block_size_at(step)), "max_attn_logit": float(att.abs().max())}


def evaluate(model):
    """Held-out loss at the full 64-token context: mean over the held-out text's non-overlapping windows."""
    _, val, _ = _data()
    n = (len(val) - 1) // 64
    x = val[:n * 64].view(n, 64)
    y = val[1:n * 64 + 1].view(n, 64)
    model.eval()
    with torch.no_grad():
        _, loss = model(x, y)
    model.train()
    return float(loss)


if __name__ == "__main__":
    from _loop import main
    main(target, STEPS, FIXES)
