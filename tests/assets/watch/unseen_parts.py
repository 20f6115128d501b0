"""A healthy run with parts `nanprobe watch` cannot see, which its summary and reports name: ``clip_grad_norm_``
called on gradients still scaled by the GradScaler (no ``scaler.unscale_`` first: a bug in the script, which clips
by the scaled norm), and the loss computed outside the model.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F


class SelfAttention(nn.Module):
    def __init__(self, d: int = 16, heads: int = 2):
        super().__init__()
        self.heads, self.qkv, self.out = heads, nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, t, d))


def main(steps: int = 12) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(32, 16), SelfAttention(), nn.Linear(16, 32))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    for step in range(steps):
        x = torch.randint(0, 32, (4, 8))
        opt.zero_grad()
        loss = F.cross_entropy(model(x).reshape(-1, 32), x.roll(-1, 1).reshape(-1))
        scaler.scale(loss).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)   # <- before scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()


if __name__ == "__main__":
    main()
