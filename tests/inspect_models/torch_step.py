"""A regression MLP with its own training step (SGD with momentum and gradient clipping)
and a function that makes the step's example arguments."""

import torch
import torch.nn as nn


class Regressor(nn.Module):
    def __init__(self, d_in=32, hidden=64):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d_in, hidden), nn.Tanh(), nn.Linear(hidden, 1))

    def forward(self, x):
        return self.net(x).squeeze(-1)


def train_step(model, opt, batch):
    loss = nn.functional.mse_loss(model(batch["x"]), batch["y"])
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad()
    return loss


def example_inputs():
    model = Regressor()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    batch = {"x": torch.randn(64, 32), "y": torch.randn(64)}
    return model, opt, batch
