"""An embedding whose "never used" row holds a finite 1e38 sentinel (its sum of squares overflows float32; the
weights stay finite). Twelve healthy SGD steps: watch must see no bad step."""

import torch

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Flatten(), torch.nn.Linear(8, 1))
with torch.no_grad():
    model[0].weight[9] = 1e38
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
for step in range(12):
    x = torch.randint(0, 9, (16, 2))
    opt.zero_grad()
    loss = ((model(x) - 1) ** 2).mean()
    loss.backward()
    opt.step()
print("done", float(model[0].weight[9, 0].detach()))
