"""The per-sample conv kernel is chosen by layer shape, never by a timing (reproducible runs).

It used to be timed once per process (im2col vs the grouped kernel), so two runs of
``dpopt train --reproducible-noise`` could pick different kernels for a layer whose two kernels
were close, and the two exact kernels round differently: the runs were not bit-identical.
"""

from __future__ import annotations

import subprocess
import sys

from torch import nn

from dpopt.engine.layers import IM2COL_FAN_IN_UP_TO, ConvPart, conv_method
from dpopt.models import build_model


def _part(conv: nn.Conv2d):
    import torch

    x = torch.zeros(2, conv.in_channels, 8, 8)
    return ConvPart(conv, x, conv(x).detach())


def test_the_kernel_follows_the_fan_in():
    convs = [m for m in build_model("cnn5-ws").modules() if isinstance(m, nn.Conv2d)]
    assert [conv_method(_part(c)) for c in convs] == ["im2col", "grouped", "grouped"]  # fan-in 27, 288, 576
    edge = nn.Conv2d(IM2COL_FAN_IN_UP_TO, 4, 1)
    assert conv_method(_part(edge)) == "im2col"
    assert conv_method(_part(nn.Conv2d(IM2COL_FAN_IN_UP_TO + 1, 4, 1))) == "grouped"


CHILD = """
import hashlib, torch
from dpopt.engine import iter_per_sample_sources
from dpopt.models import build_model
from dpopt.types import ClipGeometry
torch.manual_seed(0)
m = build_model('cnn5-ws')
g = torch.Generator().manual_seed(1)
x, y = torch.randn(12, 3, 32, 32, generator=g), torch.randint(0, 10, (12,), generator=g)
h = hashlib.sha256()
for src in iter_per_sample_sources(m, torch.nn.functional.cross_entropy, x, y, 3, rows_per_example=2):
    n = src.num_params
    sq = src.sq_norms(ClipGeometry(), [0] * n, 1)
    h.update(sq.numpy().tobytes())
    for s in src.weighted_sum(torch.ones(sq.shape[0], 1), ClipGeometry(), [0] * n):
        h.update(s.detach().numpy().tobytes())
print(h.hexdigest())
"""


def test_two_processes_give_bit_identical_per_example_norms_and_sums():
    outs = {
        subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, check=True).stdout.strip()
        for _ in range(2)
    }
    assert len(outs) == 1
