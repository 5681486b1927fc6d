"""REINFORCE on a tiny balance task, shaped like pytorch/examples' reinforce.py: the policy (with
dropout) is called once per environment step, an action is sampled from a Categorical and read with
``.item()``, and the policy takes one Adam step per episode, whose length depends on every action
before. Seeded; prints one JSON line: each episode's return and a checksum of the final weights.
Any change to a draw or a rounding moves later episodes, so the line tells whether two runs were
the same experiment."""

import hashlib
import json
import random

import torch

EPISODES, MAX_STEPS, GAMMA = 40, 60, 0.99


class Balance:
    """A pole at ``angle`` drifting away from upright; the action pushes it left or right. The episode
    ends when it falls past ``LIMIT`` or after ``MAX_STEPS``; each step upright earns 1."""

    LIMIT = 1.0

    def reset(self):
        self.angle, self.speed, self.steps = random.uniform(-0.1, 0.1), 0.0, 0
        return self.observe()

    def observe(self):
        return torch.tensor([self.angle, self.speed])

    def step(self, action: int):
        self.speed += 0.05 * self.angle + (0.03 if action else -0.03) + random.gauss(0.0, 0.005)
        self.angle += self.speed
        self.steps += 1
        done = abs(self.angle) > self.LIMIT or self.steps >= MAX_STEPS
        return self.observe(), 1.0, done


torch.manual_seed(0)
random.seed(0)
policy = torch.nn.Sequential(
    torch.nn.Linear(2, 32), torch.nn.Dropout(0.3), torch.nn.ReLU(), torch.nn.Linear(32, 2), torch.nn.Softmax(dim=-1)
)
optimizer = torch.optim.Adam(policy.parameters(), lr=1e-2)
environment = Balance()
episode_returns = []
for _ in range(EPISODES):
    state, log_probs, rewards, done = environment.reset(), [], [], False
    while not done:
        distribution = torch.distributions.Categorical(policy(state))
        action = distribution.sample()
        log_probs.append(distribution.log_prob(action))
        state, reward, done = environment.step(action.item())
        rewards.append(reward)
    returns, discounted = [], 0.0
    for reward in reversed(rewards):
        discounted = reward + GAMMA * discounted
        returns.insert(0, discounted)
    returns = torch.tensor(returns)
    returns = (returns - returns.mean()) / (returns.std() + 1e-6) if len(returns) > 1 else returns
    loss = -(torch.stack(log_probs) * returns).sum()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    episode_returns.append(sum(rewards))
weights = hashlib.sha256(b"".join(p.detach().contiguous().numpy().tobytes() for p in policy.parameters()))
print(json.dumps({"returns": episode_returns, "weights": weights.hexdigest()[:16]}))
