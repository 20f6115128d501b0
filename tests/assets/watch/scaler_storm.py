"""Gradients beyond fp16 even unscaled (a loss multiplied by 1e6): GradScaler skips every step and its
scale falls from 65536 below 1 after 17 skips."""
import torch

torch.manual_seed(0)
model = torch.nn.Linear(4, 4)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
scaler = torch.amp.GradScaler("cpu")
for step in range(40):
    x = torch.randn(8, 4)
    with torch.autocast("cpu", dtype=torch.float16):
        out = model(x)
    loss = out.float().sum() * 1e6
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
print("done")
