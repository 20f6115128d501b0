"""CleanRL's single-file PPO (CartPole) whose rollout size leaves a last minibatch of one sample.

Source: https://github.com/vwxyzjn/cleanrl, cleanrl/ppo.py, commit fe8d8a03c41a7ef5b523e2e354bd01c363e786bb, license MIT.
CartPole dynamics copied from https://github.com/Farama-Foundation/Gymnasium, gymnasium/envs/classic_control/cartpole.py, commit 3f0476a8cc224dcce2167cc4b6971ae0f04d5cfc, license MIT.
Changed: gymnasium's vector env is replaced by the CartPole dynamics inline (one env, no wrappers); num_envs 1
and num_steps 129 (instead of 4 x 128) with the default num_minibatches 4, so batch_size 129 and
minibatch_size 32 leave a fifth minibatch of ONE sample (ppo.py slices b_inds[start:start+32]); one zoo
step is one minibatch update; 3 iterations.
Kind: broken. The fifth minibatch normalises its advantages with ``mb_advantages.std()`` of one element,
which is NaN (unbiased std, 0/0), so the policy loss and every gradient are NaN at step 4 after four finite
minibatch updates. Skipping the normalisation for a one-sample minibatch (stable-baselines3's fix) holds.
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

STEPS = 60
KIND = "broken"
FIXES = {"skip_norm_single": "normalise advantages only when the minibatch holds more than one sample "
                             "(stable-baselines3 PR 1028)"}
TRUTH = {"cause": "div", "mechanism": None, "module": "(loss_fn)", "onset": None,
         "how": ('Public report: https://github.com/DLR-RM/stable-baselines3/issues/325 (NaNs if a single observation '
                 'is sampled: advantages.std() of a batch of size 1; fixed in PR 1028). Op: (mb_advantages - '
                 'mb_advantages.mean()) / (mb_advantages.std() + 1e-8) in the PPO loss: the fifth minibatch '
                 '(minibatch=1, step 4) has std() of one element = NaN (unbiased 0/0), so pg_loss and every gradient '
                 'are NaN while v_loss stays finite (63.6); steps 0-3 (minibatch 32) are finite.')}


class CartPoleEnv:
    """Gymnasium's CartPole-v1 dynamics (euler), reward 1 per step, terminated past 12 deg / 2.4, truncated at 500."""

    def __init__(self, seed):
        self.gravity, self.masscart, self.masspole = 9.8, 1.0, 0.1
        self.total_mass = self.masspole + self.masscart
        self.length = 0.5
        self.polemass_length = self.masspole * self.length
        self.force_mag, self.tau = 10.0, 0.02
        self.theta_threshold_radians = 12 * 2 * math.pi / 360
        self.x_threshold = 2.4
        self.np_random = np.random.default_rng(seed)
        self.state, self.t = None, 0

    def reset(self):
        self.state = self.np_random.uniform(low=-0.05, high=0.05, size=(4,))
        self.t = 0
        return np.array(self.state, dtype=np.float32)

    def step(self, action):
        x, x_dot, theta, theta_dot = self.state
        force = self.force_mag if action == 1 else -self.force_mag
        costheta, sintheta = math.cos(theta), math.sin(theta)
        temp = (force + self.polemass_length * theta_dot**2 * sintheta) / self.total_mass
        thetaacc = (self.gravity * sintheta - costheta * temp) / (
            self.length * (4.0 / 3.0 - self.masspole * costheta**2 / self.total_mass))
        xacc = temp - self.polemass_length * thetaacc * costheta / self.total_mass
        x = x + self.tau * x_dot
        x_dot = x_dot + self.tau * xacc
        theta = theta + self.tau * theta_dot
        theta_dot = theta_dot + self.tau * thetaacc
        self.state = (x, x_dot, theta, theta_dot)
        self.t += 1
        terminated = bool(x < -self.x_threshold or x > self.x_threshold
                          or theta < -self.theta_threshold_radians or theta > self.theta_threshold_radians)
        truncated = self.t >= 500
        return np.array(self.state, dtype=np.float32), 1.0, terminated, truncated


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


class Args:
    seed = 1
    learning_rate = 2.5e-4
    num_envs = 1
    num_steps = 129
    anneal_lr = False
    gamma = 0.99
    gae_lambda = 0.95
    num_minibatches = 4
    update_epochs = 4
    norm_adv = True
    clip_coef = 0.2
    clip_vloss = True
    ent_coef = 0.01
    vf_coef = 0.5
    max_grad_norm = 0.5
    batch_size = num_envs * num_steps
    minibatch_size = batch_size // num_minibatches


def target(config=None):
    fix = (config or {}).get("fix")
    args = Args()
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    env = CartPoleEnv(args.seed)
    agent = Agent()
    optimizer = optim.Adam(agent.parameters(), lr=args.learning_rate, eps=1e-5)
    st = {"next_obs": torch.tensor(env.reset()), "next_done": torch.zeros(1), "queue": []}

    def rollout():
        obs = torch.zeros((args.num_steps, 4))
        actions = torch.zeros(args.num_steps)
        logprobs = torch.zeros(args.num_steps)
        rewards = torch.zeros(args.num_steps)
        dones = torch.zeros(args.num_steps)
        values = torch.zeros(args.num_steps)
        next_obs, next_done = st["next_obs"], st["next_done"]
        for step in range(args.num_steps):
            obs[step] = next_obs
            dones[step] = next_done
            with torch.no_grad():
                action, logprob, _, value = agent.get_action_and_value(next_obs.unsqueeze(0))
                values[step] = value.flatten()
            actions[step] = action
            logprobs[step] = logprob
            o, reward, terminated, truncated = env.step(int(action))
            if terminated or truncated:
                o = env.reset()
            rewards[step] = reward
            next_obs, next_done = torch.tensor(o), torch.tensor([float(terminated or truncated)])
        st["next_obs"], st["next_done"] = next_obs, next_done
        with torch.no_grad():
            next_value = agent.get_value(next_obs.unsqueeze(0)).reshape(1, -1)
            advantages = torch.zeros_like(rewards)
            lastgaelam = 0
            for t in reversed(range(args.num_steps)):
                if t == args.num_steps - 1:
                    nextnonterminal = 1.0 - next_done
                    nextvalues = next_value
                else:
                    nextnonterminal = 1.0 - dones[t + 1]
                    nextvalues = values[t + 1]
                delta = rewards[t] + args.gamma * nextvalues * nextnonterminal - values[t]
                advantages[t] = lastgaelam = delta + args.gamma * args.gae_lambda * nextnonterminal * lastgaelam
            returns = advantages + values
        b = dict(obs=obs, logprobs=logprobs, actions=actions, advantages=advantages.reshape(-1),
                 returns=returns.reshape(-1), values=values)
        b_inds = np.arange(args.batch_size)
        for epoch in range(args.update_epochs):
            np.random.shuffle(b_inds)
            for start in range(0, args.batch_size, args.minibatch_size):
                end = start + args.minibatch_size
                st["queue"].append((b, b_inds[start:end].copy()))

    def step_fn(model, _batch, step):
        if not st["queue"]:
            rollout()
        b, mb_inds = st["queue"].pop(0)
        _, newlogprob, entropy, newvalue = agent.get_action_and_value(b["obs"][mb_inds], b["actions"].long()[mb_inds])
        logratio = newlogprob - b["logprobs"][mb_inds]
        ratio = logratio.exp()
        mb_advantages = b["advantages"][mb_inds]
        if args.norm_adv and not (fix == "skip_norm_single" and len(mb_inds) < 2):
            mb_advantages = (mb_advantages - mb_advantages.mean()) / (mb_advantages.std() + 1e-8)
        pg_loss1 = -mb_advantages * ratio
        pg_loss2 = -mb_advantages * torch.clamp(ratio, 1 - args.clip_coef, 1 + args.clip_coef)
        pg_loss = torch.max(pg_loss1, pg_loss2).mean()
        newvalue = newvalue.view(-1)
        v_loss_unclipped = (newvalue - b["returns"][mb_inds]) ** 2
        v_clipped = b["values"][mb_inds] + torch.clamp(newvalue - b["values"][mb_inds], -args.clip_coef, args.clip_coef)
        v_loss_clipped = (v_clipped - b["returns"][mb_inds]) ** 2
        v_loss = 0.5 * torch.max(v_loss_unclipped, v_loss_clipped).mean()
        entropy_loss = entropy.mean()
        loss = pg_loss - args.ent_coef * entropy_loss + v_loss * args.vf_coef
        optimizer.zero_grad()
        loss.backward()
        nn.utils.clip_grad_norm_(agent.parameters(), args.max_grad_norm)
        optimizer.step()
        return {"loss": loss.detach(), "pg_loss": pg_loss.detach(), "v_loss": v_loss.detach(),
                "minibatch": torch.tensor(float(len(mb_inds)))}

    return {"model": agent, "step_fn": step_fn, "batches": lambda i: i, "optimizer": optimizer}


if __name__ == "__main__":
    from _loop import main
    main(target, STEPS, FIXES)
