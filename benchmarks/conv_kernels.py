"""Per-sample conv kernels side by side: im2col vs the grouped weight-gradient kernel, by layer shape.

Prints im2col time / grouped time per layer of cnn5 and WRN-16-4 (one thread, 8 examples, K = 1 and 4,
best of 3); the shape rule of ``dpopt.engine.layers.conv_method`` comes from it (docs/performance.md,
"Per-sample conv kernel"). Usage: ``python benchmarks/conv_kernels.py``.
"""

import time

import torch
from torch import nn

from dpopt.engine.layers import ConvPart

torch.set_num_threads(1)
shapes = [  # (cin, cout, k, stride, H) : cnn5 + wrn16-4
    (3, 32, 3, 1, 32),
    (32, 64, 3, 1, 16),
    (64, 64, 3, 1, 8),
    (3, 16, 3, 1, 32),
    (16, 64, 3, 1, 32),
    (64, 64, 3, 1, 32),
    (16, 64, 1, 1, 32),
    (64, 128, 3, 2, 32),
    (128, 128, 3, 1, 16),
    (64, 128, 1, 2, 32),
    (128, 256, 3, 2, 16),
    (256, 256, 3, 1, 8),
]
for views in (1, 4):
    for cin, cout, k, st, H in shapes:
        m = nn.Conv2d(cin, cout, k, st, k // 2, bias=False)
        b = 8
        x = torch.randn(b * views, cin, H, H)
        out = m(x)
        e = torch.randn_like(out)
        part = ConvPart(m, x, e, views=views)
        t = {}
        for meth in ("im2col", "grouped"):
            part.per_sample(0, b, meth)
            r = []
            for _ in range(3):
                t0 = time.perf_counter()
                part.per_sample(0, b, meth)
                r.append(time.perf_counter() - t0)
            t[meth] = min(r)
        d = cin * k * k
        print(
            f"K={views} cin={cin:3d} cout={cout:3d} k={k} s={st} H={H:2d} cin*k*k={d:5d} T={out.shape[2] * out.shape[3]:4d} im2col/grouped={t['im2col'] / t['grouped']:.2f}",
            flush=True,
        )
