"""A loop that reads the gradients after optimizer.step() (a Siamese contrastive-loss tutorial logs
``p.grad.norm()`` there). Step 2's batch holds a NaN; watch skips that update. The script must still find
its gradients: it prints their norm each step and exits 0."""

import math

import torch

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=1e-2)
for step in range(5):
    x = torch.randn(16, 4)
    if step == 2:
        x[3, 1] = float("nan")
    opt.zero_grad()
    loss = ((model(x) - 1) ** 2).mean()
    loss.backward()
    opt.step()
    norm = sum(float(p.grad.norm()) for p in model.parameters())
    print(f"step {step} loss {float(loss):.4f} grad norm {norm:.4f} finite {math.isfinite(norm)}")
