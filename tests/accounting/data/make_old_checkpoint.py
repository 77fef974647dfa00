"""How old_engine_checkpoint.pt (+ its journal) was made: run with dpopt at commit fb334df (before issue 42: three per-release ledger copies).

Usage: python make_old_checkpoint.py OUT_DIR (not collected by pytest: no test_ prefix)."""

import sys
import warnings

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dpopt import PrivacyEngine

out = sys.argv[1]
torch.manual_seed(0)
model = nn.Linear(3, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
data = TensorDataset(torch.randn(40, 3), torch.randint(0, 2, (40,)))
loader = DataLoader(data, batch_size=8)
engine = PrivacyEngine(accountant="rdp")
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    model, opt, loader = engine.make_private(
        module=model, optimizer=opt, data_loader=loader, noise_multiplier=1.1, max_grad_norm=1.0
    )
n = 0
for _ in range(2):
    for x, y in loader:
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        n += 1
        if n == 3:
            opt.noise_multiplier = 1.5
print("releases", len(engine.ledger), "eps", engine.get_epsilon(1e-5))
engine.save_checkpoint(path=out + "/old_engine_checkpoint.pt", module=model, optimizer=opt)
