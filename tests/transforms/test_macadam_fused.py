"""DP-MacAdam's update over all parameters at once (``torch._foreach_*``) equals the per-parameter
form of Algorithm 1, lines 14–22, bit for bit, for every option (issue 23: fewer launches, same math).

The reference below is written per parameter and per line, directly from the algorithm as stated in
:mod:`dpopt.transforms.macadam` (``ALGORITHMS.md``), with the same elementwise operations.
"""

import itertools

import pytest
import torch

from dpopt.transforms.base import StepContext, chain
from dpopt.transforms.macadam import KAPPA_FLOOR, MacAdam
from dpopt.transforms.sgd import scale_by_lr

SHAPES = [(30, 20), (30,), (4, 30), (4,), ()]


def reference_step(mac: MacAdam, grads, states, stds, t):
    """One step of lines 14–22, one parameter at a time (state dicts changed in place)."""
    b1, b2 = mac.betas
    kappa = 2.0 * (b1 - b1**t) / (1.0 + b1)
    bc1, bc2 = 1 - b1**t, 1 - b2**t
    out, s_hat = [], []
    for g, st, std in zip(grads, states, stds):
        st["step"] = t
        phi = std * std
        if mac.center_shrinkage:
            m_prev = st["exp_avg"] / (1 - b1 ** (t - 1)) if t > 1 else torch.zeros_like(g)
            n = st["center_noise_var"]
            if t > 1:
                n.mul_(st["center_gain"].mul(1 - b1).div_(1 - b1 ** (t - 1)).add_(b1).square_())
            n.add_(phi * (1 - b1) ** 2)
        else:
            m_prev = st["center"]
        phi_v = phi
        if mac.noise_subtraction == "ema":
            st["noise_var_ema"].mul_(b1).add_(phi, alpha=1 - b1)
            st["noise_var_ema_sq"].mul_(b2).add_(phi, alpha=1 - b2)
            phi, phi_v = st["noise_var_ema"] / bc1, st["noise_var_ema_sq"] / bc2
        st["exp_avg"].mul_(b1).add_(g, alpha=1 - b1)  # 14
        st["exp_avg_sq"].mul_(b2).addcmul_(g, g, value=1 - b2)  # 15
        m_hat = st["exp_avg"] / bc1  # 16
        if mac.bias_correction:  # 17
            denom = (st["exp_avg_sq"] / bc2).sub_(phi_v).clamp_(min=mac.gamma_prime).sqrt_()
        else:
            denom = (st["exp_avg_sq"] / bc2).sqrt_().add_(mac.gamma)
        out.append(m_hat / denom)
        u = g - m_hat  # 18
        u = u.square_() if mac.variance_update == "paper" else u.mul_(g - m_prev)
        st["var_ema"].mul_(b1).add_(u, alpha=1 - b1)  # 19
        if mac.center_shrinkage:
            v = st["center_noise_var"] / (bc1 * bc1)
            gain = (1 - v / m_hat.square().clamp_min(1e-300)).clamp_(0.0, 1.0)
            st["center_gain"] = gain
            st["center"] = gain * m_hat
        else:
            st["center"] = m_hat
        if kappa > KAPPA_FLOOR and t > mac.b_warmup_steps:  # 20-21
            s_hat.append((st["var_ema"] / kappa).sub_(phi).clamp_(mac.h1, mac.h2))
    if s_hat:  # 22
        roots = [x.sqrt() for x in s_hat]
        total = sum(float(r.sum()) for r in roots) ** 0.5
        for st, r in zip(states, roots):
            st["scale"] = r.sqrt_().mul_(total)
    return out


OPTIONS = list(itertools.product(["paper", "unbiased"], [False, True], [False, True], ["last", "ema"]))


@pytest.mark.parametrize("variance_update,bc,shrink,subtract", OPTIONS)
def test_foreach_update_equals_the_per_parameter_algorithm(variance_update, bc, shrink, subtract):
    kw = dict(
        variance_update=variance_update,
        bias_correction=bc,
        center_shrinkage=shrink,
        noise_subtraction=subtract,
        b_warmup_steps=1,
        h1=1e-6,
        h2=1e-1,
    )
    mac, ref = MacAdam(**kw), MacAdam(**kw)
    tf = chain(mac, scale_by_lr(0.5))
    params = [torch.zeros(s, dtype=torch.float64) for s in SHAPES]
    st_new = [tf.init(p) for p in params]
    st_ref = [ref.init(p) for p in params]
    g = torch.Generator().manual_seed(7)
    for t in range(1, 6):
        grads = [torch.randn(s, generator=g, dtype=torch.float64) * 0.1 for s in SHAPES]
        stds = [torch.rand(s, generator=g, dtype=torch.float64) * 0.05 for s in SHAPES]
        mine = [s["0.macadam"] for s in st_new]
        geo = tf.geometry(st_new, params)
        ref.ensure_scale(st_ref, params)
        assert all(
            torch.equal(a, b["center"]) and torch.equal(c, b["scale"]) for a, c, b in zip(geo.shift, geo.scale, st_ref)
        )
        ctx = StepContext(step=t, noise_std=stds, lrs=[0.01, 0.02, 0.03, 0.04, 0.05])
        upd = tf.update(list(grads), st_new, params, ctx)
        want = reference_step(ref, [x.clone() for x in grads], st_ref, stds, t)
        lrs = [0.01, 0.02, 0.03, 0.04, 0.05]
        assert all(torch.equal(u, -(lr * 0.5) * w) for u, w, lr in zip(upd, want, lrs)), t
        for a, b in zip(mine, st_ref):
            assert a.keys() == b.keys()
            for k in a:
                assert (a[k] == b[k]) if not torch.is_tensor(a[k]) else torch.equal(a[k], b[k]), (t, k)
