"""An empty set: a masked policy over a state with no legal action.

A game-playing policy network masks illegal moves with ``-inf`` before
``log_softmax``, the standard trick: every masked entry gets probability 0.
The replay buffer also stores terminal states (the game is over), where the
legal-move mask is all False. For such a row every logit is ``-inf`` and
``log_softmax`` computes -inf - log(sum of nothing) = -inf - (-inf) = NaN; the
NaN reaches the policy-gradient loss. The masking is right; the row is empty.

Expected diagnosis: cause ``data`` (a state with no legal action), phase
``forward``, module ``policy``, step 4, the terminal sample named.
"""

from __future__ import annotations

import torch
from torch import nn

N_FEATURES, N_ACTIONS, BATCH_SIZE, N_STEPS, TERMINAL_STEP = 24, 9, 16, 8, 4


class MaskedPolicy(nn.Module):
    def __init__(self, n_actions: int = N_ACTIONS):
        super().__init__()
        self.logits = nn.Linear(64, n_actions)

    def forward(self, h: torch.Tensor, legal: torch.Tensor) -> torch.Tensor:
        return self.logits(h).masked_fill(~legal, float("-inf")).log_softmax(-1)


class Agent(nn.Module):
    def __init__(self, n_features: int = N_FEATURES):
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(n_features, 64), nn.ReLU())
        self.policy = MaskedPolicy()

    def forward(self, state: torch.Tensor, legal: torch.Tensor) -> torch.Tensor:
        return self.policy(self.trunk(state), legal)


def make_batches(seed: int = 0) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    batches = []
    for step in range(N_STEPS):
        legal = torch.rand(BATCH_SIZE, N_ACTIONS, generator=g) < 0.5
        legal[:, 0] |= ~legal.any(-1)                  # at least one legal move per live state
        action = torch.multinomial(legal.float(), 1, generator=g).squeeze(-1)
        if step == TERMINAL_STEP:
            legal[11] = False                          # a terminal state: no legal move at all
        batches.append({"state": torch.randn(BATCH_SIZE, N_FEATURES, generator=g), "legal_moves": legal,
                        "action": action, "advantage": torch.randn(BATCH_SIZE, generator=g)})
    return batches


def policy_gradient(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    logp = model(batch["state"], batch["legal_moves"])
    chosen = logp.gather(1, batch["action"][:, None]).squeeze(1)
    return -(chosen * batch["advantage"]).mean()


def target():
    torch.manual_seed(0)
    model = Agent()
    return {"model": model, "loss_fn": policy_gradient, "batches": make_batches(),
            "optimizer": torch.optim.Adam(model.parameters(), lr=1e-3), "precision": "fp32"}


if __name__ == "__main__":
    from plain_loop import train

    train(target(), steps=N_STEPS)
