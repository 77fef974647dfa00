"""Issue 26, step 1: why DP-MacAdam falls below DP-SGD at high noise — per-step diagnostics.

Trains DP-MacAdam (and DP-Adam as the reference) on MNIST at σ ∈ {0.5, 2} for a REDUCED number of steps
through the public API (:func:`dpopt.training.build_run` + the engine + ``DPOptimizer.step``; no run
directory is created) and records per step:

Released quantities (post-processing of the releases and the optimizer state; public):
  * ``frac_h1``, ``frac_h2``: fraction of coordinates whose variance estimate s_t/κ_t − Φ_t was clamped at
    h1 (below it) and at h2 (above it), Φ_t = b_{t−1}²σ²/B̄² (the release's noise variance);
  * ``phi_share_q50``: median over coordinates of Φ_t/(s_t/κ_t), the share of the noise term in the
    variance estimate (1 = pure noise, > 1: the estimate is negative before the clamp);
  * ``b_q*``: quantiles of the scale b_t;
  * ``noise_std_q*``: the per-coordinate noise std of g̃ after the map-back, b_{t−1}σ/B̄ (DP-Adam: σC/B̄);
  * ``update_norm``: ‖θ_t − θ_{t−1}‖; ``shift_norm``: ‖m̂_{t−1}‖ (the clip centre);
  * ``update_cos_lag{1,10,50}``: cosine between the update Δθ_t and Δθ_{t−k} (how long a direction, noise
    included, persists);
  * ``rho_b``: √(mean b² · mean b⁻²) ≥ 1, the factor by which a scale b that carries no information about
    the gradient's variance inflates the noise-to-signal ratio over a flat b (AdaClip's objective
    (Σ b_j²)(Σ v_j/b_j²) with v_j equal).

NON-PRIVATE research diagnostics (read the clean per-example gradients of the private batch; kept in memory
and written only to this script's --out, never into a run directory; they must not feed training):
  * ``np_frac_clipped``: fraction of the batch's examples with ‖w_i‖ > C (w-space, C = 1);
  * ``np_w_norm_q50``: median ‖w_i‖;
  * ``np_mean_cos``: mean pairwise cosine between the examples' clipped directions u_i = w_i/‖w_i‖,
    (‖Σu_i‖² − n)/(n(n−1));
  * ``np_common_share``: ‖mean_i w_i‖ / mean_i ‖w_i‖ (1: every example is the same offset, the shift error);
  * ``np_cos_shift_err``: cosine between Σu_i (the clipped signal) and ḡ − m̂_{t−1} mapped to w-space
    (ḡ the clean batch mean);
  * ``np_cos_update``: cosine between the update −Δθ and the clean batch-mean gradient ḡ.

Usage (from the repository root; put mnist.npz in data/ or pass --data-dir)::

    OMP_NUM_THREADS=1 nice -n 19 python experiments/macadam_diagnose.py --data-dir data --steps 200 --sigmas 2.0 0.5 \
        --out docs/results/macadam-high-noise
    python experiments/macadam_diagnose.py --plot-only --out docs/results/macadam-high-noise
    # the noise_subtraction="ema" option, DP-MacAdam only, 120 steps:
    OMP_NUM_THREADS=1 nice -n 19 python experiments/macadam_diagnose.py --data-dir data --steps 120 --sigmas 2.0 \
        --methods dp-macadam --hp noise_subtraction=ema --out docs/results/macadam-high-noise/ema

Writes OUT/diagnose.jsonl (one line per method, σ and step; appended as it goes; finished (method, σ)
pairs are skipped on a rerun) and OUT/diagnose_released.png, OUT/diagnose_nonprivate.png.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
from torch import nn

from dpopt.data import load_dataset
from dpopt.engine import iter_per_sample_sources
from dpopt.sampling import PoissonSampler
from dpopt.training import TrainConfig, build_run, evaluate
from dpopt.transforms.base import ClipGeometry

QUANTILES = (0.01, 0.1, 0.5, 0.9, 0.99)
LAGS = (1, 10, 50)


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out, target)


def _quantiles(tensors, prefix: str, row: dict, sample: int = 200_000) -> None:
    """Quantiles of the concatenated tensors (a fixed strided subsample: torch.quantile's size limit)."""
    flat = torch.cat([t.reshape(-1).double() for t in tensors])
    stride = max(1, flat.numel() // sample)
    q = torch.quantile(flat[::stride], torch.tensor(QUANTILES, dtype=torch.float64))
    for p, v in zip(QUANTILES, q.tolist()):
        row[f"{prefix}_q{int(round(p * 100)):02d}"] = v


class RecordingSource:
    """Wraps a per-sample source; computes NON-PRIVATE statistics of the batch in memory.

    Delegates everything to the wrapped source; ``sq_norms`` keeps the w-space norms and
    ``weighted_sum`` additionally computes Σ_i u_i (u_i = w_i/‖w_i‖), the clean mean gradient ḡ
    (identity geometry) and mean_i w_i = (ḡ − m)/b. Nothing here is released or written to a run directory.
    """

    def __init__(self, inner, stats: dict):
        self._inner, self._stats = inner, stats

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def sq_norms(self, geometry, groups, num_groups):
        sq = self._inner.sq_norms(geometry, groups, num_groups)
        self._stats["norms"] = sq.clamp_min(0).sqrt()[:, 0].detach().clone()
        return sq

    def weighted_sum(self, weights, geometry, groups):
        out = self._inner.weighted_sum(weights, geometry, groups)
        norms = self._stats["norms"]
        n = norms.numel()
        if n:
            ones = torch.ones_like(weights)
            self._stats["unit_sum"] = self._inner.weighted_sum(
                ones / norms.clamp_min(1e-30)[:, None].to(weights), geometry, groups
            )
            g_mean = self._inner.weighted_sum(ones / n, ClipGeometry(), groups)
            self._stats["g_mean"] = g_mean
            # mean_i w_i = (ḡ − m)/b: elementwise from ḡ (no third pass over the batch)
            shift = geometry.shift if geometry.shift is not None else [0.0] * len(g_mean)
            scale = geometry.scale if geometry.scale is not None else [1.0] * len(g_mean)
            self._stats["w_mean"] = [(g - m) / b for g, m, b in zip(g_mean, shift, scale)]
        return out


def _flat(ts) -> torch.Tensor:
    return torch.cat([t.reshape(-1).double() for t in ts])


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(a @ b / (a.norm() * b.norm()).clamp_min(1e-300))


def diagnose_run(
    method: str, sigma: float, steps: int, data, seed: int, eval_every: int, hparams: dict, on_row
) -> None:
    """Train ``method`` at ``sigma`` for ``steps`` steps, calling ``on_row(dict)`` once per step."""
    cfg = TrainConfig(
        dataset="mnist",
        model="mlp",
        method=method,
        noise_multiplier=sigma,
        batch_size=256,
        epochs=steps * 256 / data.n_train,
        seed=seed,
        hparams=dict(hparams),
    )
    run = build_run(cfg, data)  # no run directory: nothing of this script goes into one
    model, opt = run.model, run.optimizer
    params = [p for p in model.parameters() if p.requires_grad]
    sampler = PoissonSampler(run.data.n_train, run.sample_rate, run.steps, noise=run.noise)
    hp = run.hparams
    macadam = method.startswith("dp-macadam")
    bbar, clip = float(cfg.batch_size), float(hp["max_grad_norm"])
    history: list = []  # the last LAGS[-1] updates (released: post-processing of θ)
    for step in range(1, run.steps + 1):
        idx = sampler.sample()
        x, y = run.data.x_train[idx], run.data.y_train[idx]
        geo = opt.geometry()  # the geometry this step's release uses (released state)
        shift_norm = float(_flat(geo.shift).norm()) if geo.shift is not None else 0.0
        stats: dict = {}
        sources = (
            RecordingSource(s, stats)
            for s in iter_per_sample_sources(  # lazily: a fast source is freed when the next is drawn
                model, _loss, x, y, None, opt.evaluation_points()
            )
        )
        before = [p.detach().clone() for p in params]
        release = opt.step(sources)
        delta = _flat([p.detach() - b for p, b in zip(params, before)])
        row = {
            "method": method,
            "sigma": sigma,
            "step": step,
            "update_norm": float(delta.norm()),
            "shift_norm": shift_norm,
            "adam_noise_std": sigma * clip / bbar,
        }
        for lag in LAGS:  # persistence of the update direction: cos(Δθ_t, Δθ_{t−lag})
            if len(history) >= lag:
                row[f"update_cos_lag{lag}"] = _cos(delta, history[-lag].double())
        history = (history + [delta.float()])[-LAGS[-1] :]
        _quantiles(release.noise_std if macadam else [release.noise_std[0].reshape(1)], "noise_std", row)
        if macadam:
            states = [opt.state[p]["0.macadam"] for p in params]  # chain(MacAdam, lr): member 0
            kappa = 2 * (hp["betas"][0] - hp["betas"][0] ** step) / (1 + hp["betas"][0])
            if kappa > 1e-12:
                est = [st["var_ema"] / kappa for st in states]
                phi = [s * s for s in release.noise_std]
                raw = [e - f for e, f in zip(est, phi)]
                d = sum(r.numel() for r in raw)
                row["frac_h1"] = sum(int((r < hp["h1"]).sum()) for r in raw) / d
                row["frac_h2"] = sum(int((r > hp["h2"]).sum()) for r in raw) / d
                share = [f / e.clamp_min(1e-300) for f, e in zip(phi, est)]
                _quantiles(share, "phi_share", row)
            _quantiles([st["scale"] for st in states], "b", row)
            b = _flat([st["scale"] for st in states])
            # √(mean b² · mean b⁻²) ≥ 1: the noise-to-signal inflation of a scale b that carries no
            # information about the gradient's variance, relative to a flat b (AdaClip's objective)
            row["rho_b"] = float(((b * b).mean() * (1 / (b * b)).mean()).sqrt())
        # NON-PRIVATE (clean per-example gradients of the private batch): research diagnostic only
        norms = stats.get("norms")
        if norms is not None and norms.numel() > 1:
            n = norms.numel()
            unit = _flat(stats["unit_sum"])
            w_mean, g_mean = _flat(stats["w_mean"]), _flat(stats["g_mean"])
            row["np_frac_clipped"] = float((norms > clip).double().mean())
            row["np_w_norm_q50"] = float(norms.double().median())
            row["np_mean_cos"] = (float(unit @ unit) - n) / (n * (n - 1))
            row["np_common_share"] = float(w_mean.norm()) / float(norms.double().mean())
            row["np_cos_shift_err"] = _cos(unit, w_mean)
            row["np_cos_update"] = _cos(-delta, g_mean)
        if step % eval_every == 0 or step == run.steps:
            row["test_accuracy"], row["test_loss"] = evaluate(model, run.data.x_test, run.data.y_test)
        on_row(row)


def _done(path: Path) -> set:
    if not path.exists():
        return set()
    last: dict = {}
    for line in path.read_text().splitlines():
        r = json.loads(line)
        last[(r["method"], r["sigma"])] = max(last.get((r["method"], r["sigma"]), 0), r["step"])
    return {k for k, v in last.items() if v >= _done.steps}


def _series(rows, method, sigma, key):
    pts = [(r["step"], r[key]) for r in rows if r["method"] == method and r["sigma"] == sigma and key in r]
    return [p[0] for p in pts], [p[1] for p in pts]


def plot(out: Path) -> None:
    """Two PNGs from OUT/diagnose.jsonl: released quantities, and the NON-PRIVATE diagnostics."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in (out / "diagnose.jsonl").read_text().splitlines()]
    sigmas = sorted({r["sigma"] for r in rows})
    colors = {s: c for s, c in zip(sigmas, ("tab:blue", "tab:red", "tab:green", "tab:purple"))}
    mac = "dp-macadam"

    fig, ax = plt.subplots(3, 3, figsize=(15, 12))
    for s in sigmas:
        c = colors[s]
        for lag, ls in zip(LAGS, ("-", "--", ":")):
            ax[2, 0].plot(*_series(rows, mac, s, f"update_cos_lag{lag}"), color=c, ls=ls, label=f"σ={s} lag {lag}")
            ax[2, 1].plot(
                *_series(rows, "dp-adam", s, f"update_cos_lag{lag}"), color=c, ls=ls, label=f"σ={s} lag {lag}"
            )
        ax[2, 2].plot(*_series(rows, mac, s, "rho_b"), color=c, label=f"σ={s}")
        ax[2, 2].plot(*_series(rows, mac, s, "shift_norm"), color=c, ls="--", label=f"σ={s} ‖m̂‖ (centre)")
        ax[0, 0].plot(*_series(rows, mac, s, "frac_h1"), color=c, label=f"σ={s}: at h1")
        ax[0, 0].plot(*_series(rows, mac, s, "frac_h2"), color=c, ls="--", label=f"σ={s}: at h2")
        for q, ls in (("q01", ":"), ("q50", "-"), ("q99", ":")):
            ax[0, 1].plot(*_series(rows, mac, s, f"b_{q}"), color=c, ls=ls, label=f"σ={s} b {q}")
        ax[0, 2].plot(*_series(rows, mac, s, "phi_share_q50"), color=c, label=f"σ={s} median")
        ax[0, 2].plot(*_series(rows, mac, s, "phi_share_q10"), color=c, ls=":", label=f"σ={s} q10")
        ax[1, 0].plot(*_series(rows, mac, s, "noise_std_q50"), color=c, label=f"σ={s} MacAdam median")
        ax[1, 0].plot(*_series(rows, mac, s, "noise_std_q99"), color=c, ls=":", label=f"σ={s} MacAdam q99")
        ax[1, 0].plot(*_series(rows, "dp-adam", s, "noise_std_q50"), color=c, ls="--", label=f"σ={s} DP-Adam")
        ax[1, 1].plot(*_series(rows, mac, s, "update_norm"), color=c, label=f"σ={s} MacAdam")
        ax[1, 1].plot(*_series(rows, "dp-adam", s, "update_norm"), color=c, ls="--", label=f"σ={s} DP-Adam")
        ax[1, 2].plot(*_series(rows, mac, s, "test_accuracy"), color=c, marker="o", label=f"σ={s} MacAdam")
        ax[1, 2].plot(
            *_series(rows, "dp-adam", s, "test_accuracy"), color=c, marker="x", ls="--", label=f"σ={s} DP-Adam"
        )
    titles = [
        "fraction of coordinates clamped",
        "scale b (quantiles)",
        "Φ/(s/κ): noise share of the estimate",
        "noise std per coordinate after map-back",
        "update norm ‖Δθ‖",
        "test accuracy",
        "MacAdam: cos(Δθ_t, Δθ_{t−lag})",
        "DP-Adam: cos(Δθ_t, Δθ_{t−lag})",
        "ρ(b) = √(mean b²·mean b⁻²); ‖m̂‖",
    ]
    for a, t in zip(ax.flat, titles):
        a.set_title(t, fontsize=10)
        a.set_xlabel("step")
        a.legend(fontsize=7)
    for a in (ax[0, 1], ax[0, 2], ax[1, 0], ax[1, 1], ax[2, 2]):
        a.set_yscale("log")
    fig.suptitle("DP-MacAdam (paper hyperparameters, MNIST MLP, B̄=256): released quantities per step")
    fig.tight_layout()
    fig.savefig(out / "diagnose_released.png", dpi=90)
    plt.close(fig)

    fig, ax = plt.subplots(2, 3, figsize=(15, 8))
    keys = [
        ("np_frac_clipped", "fraction of examples clipped (w-space)"),
        ("np_mean_cos", "mean pairwise cosine of clipped directions"),
        ("np_common_share", "‖mean w‖ / mean ‖w‖ (common offset share)"),
        ("np_cos_shift_err", "cos(Σ u_i, mean w = (ḡ − m̂)/b)"),
        ("np_cos_update", "cos(−Δθ, clean batch-mean gradient)"),
        ("np_w_norm_q50", "median ‖w_i‖ (w-space; C = 1)"),
    ]
    for a, (k, t) in zip(ax.flat, keys):
        for s in sigmas:
            a.plot(*_series(rows, mac, s, k), color=colors[s], label=f"σ={s} MacAdam")
            a.plot(*_series(rows, "dp-adam", s, k), color=colors[s], ls="--", label=f"σ={s} DP-Adam")
        a.set_title(t, fontsize=10)
        a.set_xlabel("step")
        a.legend(fontsize=7)
    ax[1, 2].set_yscale("log")
    fig.suptitle(
        "NON-PRIVATE research diagnostics (clean per-example gradients of the private batch; never in a run directory)"
    )
    fig.tight_layout()
    fig.savefig(out / "diagnose_nonprivate.png", dpi=90)
    plt.close(fig)


def _value(text: str):
    """--hp VALUE: a number if it parses as one, true/false, else the string (e.g. noise_subtraction=ema)."""
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    try:
        return float(text)
    except ValueError:
        return text


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data-dir", default="data", help="directory with mnist.npz")
    ap.add_argument("--out", default="docs/results/macadam-high-noise")
    ap.add_argument("--steps", type=int, default=200, help="steps per run (reduced: 1 epoch = 234 steps)")
    ap.add_argument("--sigmas", type=float, nargs="+", default=[0.5, 2.0])
    ap.add_argument("--methods", nargs="+", default=["dp-macadam", "dp-adam"])
    ap.add_argument("--seed", type=int, default=0, help="model initialisation only (the noise is secret)")
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--hp", action="append", default=[], help="KEY=VALUE for every run (e.g. h1=1e-8)")
    ap.add_argument("--plot-only", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if not args.plot_only:
        hparams = {k: _value(v) for k, v in (kv.split("=", 1) for kv in args.hp)}
        data = load_dataset("mnist", args.data_dir)
        path = out / "diagnose.jsonl"
        _done.steps = args.steps
        done = _done(path)
        for sigma in args.sigmas:
            for method in args.methods:
                if (method, sigma) in done:
                    print(f"skip {method} σ={sigma}: finished")
                    continue
                if path.exists():  # drop a partial earlier attempt of this pair
                    keep = [
                        line
                        for line in path.read_text().splitlines()
                        if (json.loads(line)["method"], json.loads(line)["sigma"]) != (method, sigma)
                    ]
                    path.write_text("".join(line + "\n" for line in keep))
                t0 = time.perf_counter()
                with path.open("a") as f:

                    def on_row(row, f=f):
                        f.write(
                            json.dumps(
                                {
                                    k: (round(v, 8) if isinstance(v, float) and math.isfinite(v) else v)
                                    for k, v in row.items()
                                }
                            )
                            + "\n"
                        )
                        f.flush()

                    diagnose_run(
                        method,
                        sigma,
                        args.steps,
                        data,
                        args.seed,
                        args.eval_every,
                        hparams if method.startswith(("dp-macadam", "adaclip")) else {},
                        on_row,
                    )
                print(f"{method} σ={sigma}: {args.steps} steps in {time.perf_counter() - t0:.1f} s", flush=True)
    plot(out)


if __name__ == "__main__":
    main()
