"""CleanRL's PPO (ppo.py) on CartPole-v1, with the CartPole dynamics copied inline from Gymnasium.

Source: https://github.com/vwxyzjn/cleanrl, cleanrl/ppo.py, commit fe8d8a03c41a7ef5b523e2e354bd01c363e786bb, license MIT.
Changed: gymnasium's SyncVectorEnv(CartPole-v1) is replaced by CartPoleVec below, whose dynamics are copied from
https://github.com/Farama-Foundation/Gymnasium, gymnasium/envs/classic_control/cartpole.py, commit
3f0476a8cc224dcce2167cc4b6971ae0f04d5cfc, license MIT (Copyright (c) 2016 OpenAI, (c) 2022 Farama Foundation;
CleanRL is Copyright (c) 2019 CleanRL developers, MIT) (the same Euler dynamics,
thresholds, reward, 500-step time limit and uniform(-0.05, 0.05) reset, vectorised in numpy, with the
old-gym same-step autoreset the script was written for); tyro/tensorboard/wandb removed. Agent, Adam
(lr 2.5e-4, eps 1e-5), linear LR annealing, GAE, clipped surrogate, clipped value loss, entropy bonus and
clip_grad_norm_(0.5) are CleanRL's defaults (4 envs x 128 steps, 4 minibatches, 4 epochs). One zoo step is
one minibatch update: step_fn collects a fresh rollout (and sets the annealed LR) every 16 steps; 100
iterations = 1600 steps = 51k env steps.
Kind: healthy. The mean training episodic return grows from ~25 (first iterations) to 127 by step 480 and
~210-235 at the end; the total loss is dominated by the value loss, which grows with the returns: the loss
level rises from its best 21.0 (step 62) to 47.5 (step 425, 2.3x) and then settles to ~27.5 as the critic
catches up and the LR anneals. The greedy policy's held-out return goes 31.8 -> 491.8 (of 500).
"""

from __future__ import annotations

import math
import random
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.optim as optim
from torch.distributions.categorical import Categorical

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SEED = 1
LEARNING_RATE = 2.5e-4
NUM_ENVS = 4
NUM_STEPS = 128
GAMMA = 0.99
GAE_LAMBDA = 0.95
NUM_MINIBATCHES = 4
UPDATE_EPOCHS = 4
CLIP_COEF = 0.2
ENT_COEF = 0.01
VF_COEF = 0.5
MAX_GRAD_NORM = 0.5
BATCH_SIZE = NUM_ENVS * NUM_STEPS
MINIBATCH_SIZE = BATCH_SIZE // NUM_MINIBATCHES
UPDATES_PER_ITER = UPDATE_EPOCHS * NUM_MINIBATCHES
NUM_ITERATIONS = 100

STEPS = NUM_ITERATIONS * UPDATES_PER_ITER
KIND = "healthy"
FIXES: dict[str, str] = {}
TRUTH = {"cause": None, "mechanism": None, "module": None, "onset": None,
         "how": ("PPO loss level rises 2.3x (best 21.0 at step 62 -> 47.5 at step 425, final 27.5) because the value "
                "loss grows with the returns it regresses (v_loss 50 -> up to 103); training episodic return "
                "~25 -> ~210-235, greedy held-out return 31.8 -> 491.8; pg_loss/entropy/approx_kl bounded, all finite")}

_STATS: dict[str, float] = {}


class CartPoleVec:
    """Gymnasium's CartPoleEnv.step/reset (Euler integrator), for n envs at once, with TimeLimit(500)."""

    def __init__(self, n, seed, max_episode_steps=500):
        self.n = n
        self.rng = np.random.default_rng(seed)
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
        self.max_episode_steps = max_episode_steps
        self.state = np.zeros((n, 4))
        self.elapsed = np.zeros(n, dtype=np.int64)
        self.ep_return = np.zeros(n)

    def _reset(self, idx):
        self.state[idx] = self.rng.uniform(low=-0.05, high=0.05, size=(len(idx), 4))
        self.elapsed[idx] = 0
        self.ep_return[idx] = 0.0

    def reset(self):
        self._reset(np.arange(self.n))
        return self.state.astype(np.float32)

    def step(self, action):
        x, x_dot, theta, theta_dot = self.state.T
        force = np.where(action == 1, self.force_mag, -self.force_mag)
        costheta = np.cos(theta)
        sintheta = np.sin(theta)
        temp = (force + self.polemass_length * np.square(theta_dot) * sintheta) / self.total_mass
        thetaacc = (self.gravity * sintheta - costheta * temp) / (
            self.length * (4.0 / 3.0 - self.masspole * np.square(costheta) / self.total_mass))
        xacc = temp - self.polemass_length * thetaacc * costheta / self.total_mass
        x = x + self.tau * x_dot
        x_dot = x_dot + self.tau * xacc
        theta = theta + self.tau * theta_dot
        theta_dot = theta_dot + self.tau * thetaacc
        self.state = np.stack((x, x_dot, theta, theta_dot), axis=1)
        terminated = (x < -self.x_threshold) | (x > self.x_threshold) | \
            (theta < -self.theta_threshold_radians) | (theta > self.theta_threshold_radians)
        reward = np.ones(self.n)
        self.elapsed += 1
        self.ep_return += reward
        truncated = (self.elapsed >= self.max_episode_steps) & ~terminated
        done = terminated | truncated
        finished = self.ep_return[done].tolist()
        if done.any():
            self._reset(np.nonzero(done)[0])  # autoreset: the returned obs is the new episode's first
        return self.state.astype(np.float32), reward, terminated, truncated, finished


def layer_init(layer, std=np.sqrt(2), bias_const=0.0):
    torch.nn.init.orthogonal_(layer.weight, std)
    torch.nn.init.constant_(layer.bias, bias_const)
    return layer


class Agent(nn.Module):
    def __init__(self, obs_dim=4, n_actions=2):
        super().__init__()
        self.critic = nn.Sequential(
            layer_init(nn.Linear(obs_dim, 64)),
            nn.Tanh(),
            layer_init(nn.Linear(64, 64)),
            nn.Tanh(),
            layer_init(nn.Linear(64, 1), std=1.0),
        )
        self.actor = nn.Sequential(
            layer_init(nn.Linear(obs_dim, 64)),
            nn.Tanh(),
            layer_init(nn.Linear(64, 64)),
            nn.Tanh(),
            layer_init(nn.Linear(64, n_actions), std=0.01),
        )

    def get_value(self, x):
        return self.critic(x)

    def get_action_and_value(self, x, action=None):
        logits = self.actor(x)
        probs = Categorical(logits=logits)
        if action is None:
            action = probs.sample()
        return action, probs.log_prob(action), probs.entropy(), self.critic(x)


def target(config=None):
    random.seed(SEED)
    np.random.seed(SEED)
    torch.manual_seed(SEED)
    _STATS.clear()
    envs = CartPoleVec(NUM_ENVS, SEED)
    agent = Agent()
    optimizer = optim.Adam(agent.parameters(), lr=LEARNING_RATE, eps=1e-5)
    np_rng = np.random.RandomState(SEED)
    recent: list[float] = []
    st = {"next_obs": torch.Tensor(envs.reset()), "next_done": torch.zeros(NUM_ENVS)}

    def collect(iteration):
        # Annealing the rate
        frac = 1.0 - (iteration - 1.0) / NUM_ITERATIONS
        optimizer.param_groups[0]["lr"] = frac * LEARNING_RATE
        obs = torch.zeros((NUM_STEPS, NUM_ENVS, 4))
        actions = torch.zeros((NUM_STEPS, NUM_ENVS))
        logprobs = torch.zeros((NUM_STEPS, NUM_ENVS))
        rewards = torch.zeros((NUM_STEPS, NUM_ENVS))
        dones = torch.zeros((NUM_STEPS, NUM_ENVS))
        values = torch.zeros((NUM_STEPS, NUM_ENVS))
        next_obs, next_done = st["next_obs"], st["next_done"]
        for step in range(0, NUM_STEPS):
            obs[step] = next_obs
            dones[step] = next_done
            with torch.no_grad():
                action, logprob, _, value = agent.get_action_and_value(next_obs)
                values[step] = value.flatten()
            actions[step] = action
            logprobs[step] = logprob
            next_obs, reward, terminations, truncations, finished = envs.step(action.numpy())
            recent.extend(finished)
            next_done = np.logical_or(terminations, truncations)
            rewards[step] = torch.tensor(reward).view(-1)
            next_obs, next_done = torch.Tensor(next_obs), torch.Tensor(next_done)
        st["next_obs"], st["next_done"] = next_obs, next_done
        # bootstrap value if not done
        with torch.no_grad():
            next_value = agent.get_value(next_obs).reshape(1, -1)
            advantages = torch.zeros_like(rewards)
            lastgaelam = 0
            for t in reversed(range(NUM_STEPS)):
                if t == NUM_STEPS - 1:
                    nextnonterminal = 1.0 - next_done
                    nextvalues = next_value
                else:
                    nextnonterminal = 1.0 - dones[t + 1]
                    nextvalues = values[t + 1]
                delta = rewards[t] + GAMMA * nextvalues * nextnonterminal - values[t]
                advantages[t] = lastgaelam = delta + GAMMA * GAE_LAMBDA * nextnonterminal * lastgaelam
            returns = advantages + values
        st["b_obs"] = obs.reshape((-1, 4))
        st["b_logprobs"] = logprobs.reshape(-1)
        st["b_actions"] = actions.reshape(-1)
        st["b_advantages"] = advantages.reshape(-1)
        st["b_returns"] = returns.reshape(-1)
        st["b_values"] = values.reshape(-1)
        order = []
        b_inds = np.arange(BATCH_SIZE)
        for _ in range(UPDATE_EPOCHS):
            np_rng.shuffle(b_inds)
            order += [b_inds[s:s + MINIBATCH_SIZE].copy() for s in range(0, BATCH_SIZE, MINIBATCH_SIZE)]
        st["order"] = order
        del recent[:-20]
        if recent:
            _STATS["episodic_return"] = float(np.mean(recent))

    def step_fn(agent, batch, step):
        k = step % UPDATES_PER_ITER
        if k == 0:
            collect(step // UPDATES_PER_ITER + 1)
        mb_inds = st["order"][k]
        b_obs, b_logprobs, b_actions = st["b_obs"], st["b_logprobs"], st["b_actions"]
        b_advantages, b_returns, b_values = st["b_advantages"], st["b_returns"], st["b_values"]

        _, newlogprob, entropy, newvalue = agent.get_action_and_value(b_obs[mb_inds], b_actions.long()[mb_inds])
        logratio = newlogprob - b_logprobs[mb_inds]
        ratio = logratio.exp()
        with torch.no_grad():
            approx_kl = ((ratio - 1) - logratio).mean()

        mb_advantages = b_advantages[mb_inds]
        mb_advantages = (mb_advantages - mb_advantages.mean()) / (mb_advantages.std() + 1e-8)

        # Policy loss
        pg_loss1 = -mb_advantages * ratio
        pg_loss2 = -mb_advantages * torch.clamp(ratio, 1 - CLIP_COEF, 1 + CLIP_COEF)
        pg_loss = torch.max(pg_loss1, pg_loss2).mean()

        # Value loss (clipped)
        newvalue = newvalue.view(-1)
        v_loss_unclipped = (newvalue - b_returns[mb_inds]) ** 2
        v_clipped = b_values[mb_inds] + torch.clamp(newvalue - b_values[mb_inds], -CLIP_COEF, CLIP_COEF)
        v_loss_clipped = (v_clipped - b_returns[mb_inds]) ** 2
        v_loss_max = torch.max(v_loss_unclipped, v_loss_clipped)
        v_loss = 0.5 * v_loss_max.mean()

        entropy_loss = entropy.mean()
        loss = pg_loss - ENT_COEF * entropy_loss + v_loss * VF_COEF

        optimizer.zero_grad()
        loss.backward()
        nn.utils.clip_grad_norm_(agent.parameters(), MAX_GRAD_NORM)
        optimizer.step()
        return {"loss": loss.detach(), "pg_loss": pg_loss.detach(), "v_loss": v_loss.detach(),
                "entropy": entropy_loss.detach(), "approx_kl": approx_kl}

    return {"model": agent, "step_fn": step_fn, "batches": lambda i: i, "optimizer": optimizer}


def measure(model, step):
    """Mean return of the last 20 finished training episodes (the LR is logged by the loop)."""
    return {"episodic_return": _STATS.get("episodic_return", float("nan"))}


def evaluate(model):
    """Greedy (argmax) policy's mean return over 10 fresh CartPole-v1 episodes (max 500)."""
    env = CartPoleVec(10, seed=12345)
    obs = env.reset()
    alive = np.ones(10, dtype=bool)
    total = np.zeros(10)
    with torch.no_grad():
        for _ in range(500):
            a = model.actor(torch.Tensor(obs)).argmax(-1).numpy()
            obs, r, term, trunc, _ = env.step(a)
            total += r * alive
            alive &= ~(term | trunc)
            if not alive.any():
                break
    return float(total.mean())


if __name__ == "__main__":
    from _loop import main
    main(target, STEPS, FIXES)
