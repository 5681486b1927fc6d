"""RL-shaped: REINFORCE on a cart-pole written here. The policy net runs once per environment step,
episodes end at different lengths, actions come from ``torch.distributions.Categorical`` and reach
the environment through ``.item()`` every step, and the optimizer steps once per episode.

No other workload has this shape: many tiny forwards and host reads between two backward passes,
a different number each time. One timed "step" is one episode. The hand-tuned script acts without
autograd and recomputes the episode's log-probabilities in one batched forward for the update (the
same numbers, one forward instead of one per environment step), with the fused optimizer."""

import argparse
import math
import random

import torch
from timing import DEVICE, add_arguments, report_steps
from torch import nn
from torch.distributions import Categorical


class CartPole:
    """The classic cart-pole (Barto, Sutton and Anderson, 1983; gym's constants): push the cart left
    or right, Euler steps of 20 ms; an episode ends when the pole leans past 12 degrees, the cart
    leaves the track, or after ``limit`` steps. Plain Python, as a simulator on the host would be."""

    def __init__(self, seed: int, limit: int):
        self.random, self.limit = random.Random(seed), limit

    def reset(self) -> list:
        self.state, self.steps = [self.random.uniform(-0.05, 0.05) for _ in range(4)], 0
        return list(self.state)

    def step(self, action: int) -> tuple:
        x, speed, angle, spin = self.state
        force = 10.0 if action else -10.0
        cos, sin = math.cos(angle), math.sin(angle)
        lean = (force + 0.05 * spin * spin * sin) / 1.1
        spin_change = (9.8 * sin - cos * lean) / (0.5 * (4.0 / 3.0 - 0.1 * cos * cos / 1.1))
        speed_change = lean - 0.05 * spin_change * cos / 1.1
        self.state = [x + 0.02 * speed, speed + 0.02 * speed_change, angle + 0.02 * spin, spin + 0.02 * spin_change]
        self.steps += 1
        done = abs(self.state[0]) > 2.4 or abs(self.state[2]) > 12 * math.pi / 180 or self.steps >= self.limit
        return list(self.state), done


def discounted(rewards: list, gamma: float = 0.99) -> torch.Tensor:
    """Each step's discounted return, normalised over the episode (REINFORCE's usual baseline)."""
    returns, total = [], 0.0
    for reward in reversed(rewards):
        total = reward + gamma * total
        returns.append(total)
    returns = torch.tensor(returns[::-1])
    return ((returns - returns.mean()) / (returns.std() + 1e-8)).to(DEVICE)


def main():
    parser = argparse.ArgumentParser()
    # Host-bound on a GPU too (a forward and a .item() per environment step): plain ran 4.6 episodes/s on
    # an H100, so 60 timed episodes keep a GPU battery's nine runs within its part's minutes.
    add_arguments(parser, steps=40, warmup=10, gpu_steps=60)
    parser.add_argument("--limit", type=int, default=200, help="the longest episode, in environment steps")
    args = parser.parse_args()
    torch.manual_seed(0)
    policy = nn.Sequential(nn.Linear(4, 64), nn.Tanh(), nn.Linear(64, 2)).to(DEVICE)
    optimizer = torch.optim.Adam(policy.parameters(), lr=1e-2, **({"fused": True} if args.hand_tuned else {}))
    env = CartPole(seed=0, limit=args.limit)

    def step(_index):
        observation, done = env.reset(), False
        observations, actions, log_probs = [], [], []
        while not done:
            observations.append(torch.tensor(observation, device=DEVICE))
            with torch.no_grad() if args.hand_tuned else torch.enable_grad():
                distribution = Categorical(logits=policy(observations[-1]))
                action = distribution.sample()
            actions.append(action)
            if not args.hand_tuned:
                log_probs.append(distribution.log_prob(action))
            observation, done = env.step(action.item())
        if args.hand_tuned:
            log_probs = Categorical(logits=policy(torch.stack(observations))).log_prob(torch.stack(actions))
        else:
            log_probs = torch.stack(log_probs)
        loss = -(log_probs * discounted([1.0] * len(actions))).sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        return loss.item()

    report_steps(step, args.warmup, args.steps)


if __name__ == "__main__":
    main()
