"""The PyTorch DQN tutorial (replay memory, policy/target nets, SmoothL1 TD loss) on CartPole, with the dynamics inline.

Source: https://github.com/pytorch/tutorials, intermediate_source/reinforcement_q_learning.py, commit deef00a631add29563846f231d59f454b2f7f007, license BSD-3-Clause; CartPole dynamics from https://github.com/Farama-Foundation/Gymnasium, gymnasium/envs/classic_control/cartpole.py, commit 3f0476a8cc224dcce2167cc4b6971ae0f04d5cfc, license MIT (Copyright (c) 2016 OpenAI, (c) 2022 Farama Foundation).
Changed: gym and its rendered screens are replaced by CartPoleEnv's Euler dynamics copied inline (the 4-number
state as input, 500-step time limit of CartPole-v1); the tutorial's conv DQN on screen differences, RMSprop,
grad clamp(-1, 1) and hard target copy every 10 episodes (this commit) are replaced by what the tutorial's
later CartPole-v1 revision does: the MLP DQN (layer1-3, 128 units), AdamW(amsgrad), clip_grad_value_(100)
and a soft target update with TAU 0.005 after every step, GAMMA 0.999 -> 0.99, EPS_DECAY 200 -> 1000 (also as
that revision); BATCH_SIZE 128, EPS 0.9 -> 0.05, ReplayMemory(10000) as this commit; lr 1e-3 (that revision
uses 1e-4; RMSprop's default here is 1e-2); the memory is pre-filled with 128 random transitions; one optimizer step per env step (step_fn), 4000 steps; python's random seeded.
Kind: healthy. As the agent learns, the Q-values grow toward the discounted return (mean Q(s,a) 2.8 at step 499
-> 17.2 at step 3999) and the TD targets move with the soft-updated target net, so the SmoothL1 loss RISES:
its 500-step mean goes 0.024 -> 0.041 -> 0.069 and single steps reach 0.32, while the mean return of the last
10 episodes climbs 14.5 -> 189 and the greedy policy's evaluated return goes 90.6 -> 206.6.
"""

from __future__ import annotations

import math
import random
import sys
from collections import deque, namedtuple
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

STEPS = 4000
KIND = "healthy"
FIXES: dict[str, str] = {}
TRUTH = {"cause": None, "mechanism": None, "module": None, "onset": None,
         "how": "measured (zoo/truth/dqn_cartpole.log): the SmoothL1 TD loss rises while the agent improves: 500-step "
                "mean 0.024 (steps 0-499) -> 0.041 (500-999) -> 0.049 (2500-2999) -> 0.069 (3500-3999), 500-step "
                "max 0.09 -> 0.32, as mean Q(s,a) grows 2.8 -> 17.2; the last-10-episode return rises 14.5 -> "
                "189 and the greedy evaluation return 90.6 -> 206.6. Finite throughout."}

BATCH_SIZE = 128
GAMMA = 0.99
EPS_START = 0.9
EPS_END = 0.05
EPS_DECAY = 1000
TAU = 0.005
LR = 1e-3
MAX_EPISODE_STEPS = 500


class CartPoleEnv:
    """Gymnasium's CartPoleEnv dynamics (euler integrator, default reward), without gym, spaces or rendering."""

    def __init__(self, rng: random.Random):
        self.gravity = 9.8
        self.masscart = 1.0
        self.masspole = 0.1
        self.total_mass = self.masspole + self.masscart
        self.length = 0.5  # actually half the pole's length
        self.polemass_length = self.masspole * self.length
        self.force_mag = 10.0
        self.tau = 0.02  # seconds between state updates
        self.theta_threshold_radians = 12 * 2 * math.pi / 360
        self.x_threshold = 2.4
        self.rng = rng
        self.state = None
        self.t = 0

    def step(self, action):
        x, x_dot, theta, theta_dot = self.state
        force = self.force_mag if action == 1 else -self.force_mag
        costheta = math.cos(theta)
        sintheta = math.sin(theta)
        temp = (force + self.polemass_length * theta_dot ** 2 * sintheta) / self.total_mass
        thetaacc = (self.gravity * sintheta - costheta * temp) / (
            self.length * (4.0 / 3.0 - self.masspole * costheta ** 2 / self.total_mass))
        xacc = temp - self.polemass_length * thetaacc * costheta / self.total_mass
        x = x + self.tau * x_dot
        x_dot = x_dot + self.tau * xacc
        theta = theta + self.tau * theta_dot
        theta_dot = theta_dot + self.tau * thetaacc
        self.state = (x, x_dot, theta, theta_dot)
        self.t += 1
        terminated = bool(x < -self.x_threshold or x > self.x_threshold
                          or theta < -self.theta_threshold_radians or theta > self.theta_threshold_radians)
        truncated = self.t >= MAX_EPISODE_STEPS   # CartPole-v1's TimeLimit
        return list(self.state), 1.0, terminated, truncated

    def reset(self):
        self.state = tuple(self.rng.uniform(-0.05, 0.05) for _ in range(4))
        self.t = 0
        return list(self.state)


Transition = namedtuple('Transition', ('state', 'action', 'next_state', 'reward'))


class ReplayMemory(object):

    def __init__(self, capacity, rng):
        self.memory = deque([], maxlen=capacity)
        self.rng = rng

    def push(self, *args):
        """Save a transition"""
        self.memory.append(Transition(*args))

    def sample(self, batch_size):
        return self.rng.sample(self.memory, batch_size)

    def __len__(self):
        return len(self.memory)


class DQN(nn.Module):

    def __init__(self, n_observations, n_actions):
        super(DQN, self).__init__()
        self.layer1 = nn.Linear(n_observations, 128)
        self.layer2 = nn.Linear(128, 128)
        self.layer3 = nn.Linear(128, n_actions)

    def forward(self, x):
        x = F.relu(self.layer1(x))
        x = F.relu(self.layer2(x))
        return self.layer3(x)


def evaluate(model) -> float:
    """Mean return of the greedy policy over 5 fixed-seed episodes (max 500)."""
    total = 0.0
    with torch.no_grad():
        for seed in range(5):
            env = CartPoleEnv(random.Random(1000 + seed))
            s = env.reset()
            while True:
                a = int(model(torch.tensor([s])).argmax(1))
                s, r, term, trunc = env.step(a)
                total += r
                if term or trunc:
                    break
    return total / 5


def target(config=None):
    torch.manual_seed(0)
    rng = random.Random(0)
    env = CartPoleEnv(rng)
    n_actions, n_observations = 2, 4
    policy_net = DQN(n_observations, n_actions)
    target_net = DQN(n_observations, n_actions)
    target_net.load_state_dict(policy_net.state_dict())
    optimizer = torch.optim.AdamW(policy_net.parameters(), lr=LR, amsgrad=True)
    memory = ReplayMemory(10000, rng)
    st = {"state": None, "steps_done": 0, "ep_return": 0.0, "returns": [0.0]}

    def tensor(s):
        return torch.tensor(s, dtype=torch.float32).unsqueeze(0)

    def env_step(action):
        observation, reward, terminated, truncated = env.step(action.item())
        reward = torch.tensor([reward])
        next_state = None if terminated else tensor(observation)
        memory.push(st["state"], action, next_state, reward)
        st["ep_return"] += reward.item()
        st["state"] = next_state
        if terminated or truncated:
            st["returns"].append(st["ep_return"])
            st["ep_return"] = 0.0
            st["state"] = tensor(env.reset())

    st["state"] = tensor(env.reset())
    while len(memory) < BATCH_SIZE:   # pre-fill the replay memory with random transitions
        env_step(torch.tensor([[rng.randrange(2)]], dtype=torch.long))
    st["returns"] = [0.0]

    def select_action(state):
        sample = rng.random()
        eps_threshold = EPS_END + (EPS_START - EPS_END) * math.exp(-1. * st["steps_done"] / EPS_DECAY)
        st["steps_done"] += 1
        if sample > eps_threshold:
            with torch.no_grad():
                return policy_net(state).max(1).indices.view(1, 1)
        return torch.tensor([[rng.randrange(2)]], dtype=torch.long)

    def optimize_model():
        transitions = memory.sample(BATCH_SIZE)
        batch = Transition(*zip(*transitions))
        non_final_mask = torch.tensor(tuple(map(lambda s: s is not None, batch.next_state)), dtype=torch.bool)
        non_final_next_states = torch.cat([s for s in batch.next_state if s is not None])
        state_batch = torch.cat(batch.state)
        action_batch = torch.cat(batch.action)
        reward_batch = torch.cat(batch.reward)
        state_action_values = policy_net(state_batch).gather(1, action_batch)
        next_state_values = torch.zeros(BATCH_SIZE)
        with torch.no_grad():
            next_state_values[non_final_mask] = target_net(non_final_next_states).max(1).values
        expected_state_action_values = (next_state_values * GAMMA) + reward_batch
        criterion = nn.SmoothL1Loss()
        loss = criterion(state_action_values, expected_state_action_values.unsqueeze(1))
        optimizer.zero_grad()
        loss.backward()
        # In-place gradient clipping
        torch.nn.utils.clip_grad_value_(policy_net.parameters(), 100)
        optimizer.step()
        return loss, state_action_values.detach().mean()

    def step_fn(model, batch, step):
        action = select_action(st["state"])
        env_step(action)
        loss, q_mean = optimize_model()
        # Soft update of the target network's weights: θ′ ← τ θ + (1 −τ )θ′
        target_net_state_dict = target_net.state_dict()
        policy_net_state_dict = policy_net.state_dict()
        for key in policy_net_state_dict:
            target_net_state_dict[key] = policy_net_state_dict[key] * TAU + target_net_state_dict[key] * (1 - TAU)
        target_net.load_state_dict(target_net_state_dict)
        recent = st["returns"][-10:]
        return {"loss": loss, "q_mean": q_mean, "return_last10": torch.tensor(sum(recent) / len(recent)),
                "episodes": torch.tensor(float(len(st["returns"]) - 1))}

    return {"model": policy_net, "step_fn": step_fn, "batches": lambda step: None, "optimizer": optimizer}


if __name__ == "__main__":
    from _loop import main
    main(target, STEPS, FIXES)
