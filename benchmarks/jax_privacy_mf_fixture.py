"""Compute the jax-privacy side of the DP matrix factorization cross-check (issue 36).

Run in a SEPARATE virtual environment that has jax-privacy (never dpopt's: jax is not a dpopt dependency)::

    python3 -m venv /tmp/jp && /tmp/jp/bin/pip install jax-privacy==2.0.0 dp-accounting
    /tmp/jp/bin/python benchmarks/jax_privacy_mf_fixture.py > tests/core/data/jax_privacy_mf.json

Everything is float64 (``jax_enable_x64``). The strategies are fixed inputs written in dpopt's
parameterisation (banded: the coefficients c of C; blt: ω, θ of C⁻¹, d_k = Σ ω_i θ_i^{k−1}); jax-privacy
computes, with its own code only: the Toeplitz coefficients of C and C⁻¹, a streamed C⁻¹z, the
sensitivities of C for each participation schema, the prefix-sum losses, its own optimised strategies'
losses, and ε of its accountants. ``tests/core/test_correlated_noise_jax_privacy.py`` compares dpopt
with these numbers (and recomputes them live when jax-privacy is importable: :func:`compute`).
"""

from __future__ import annotations

import json
import sys

import jax

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax_privacy.accounting import accountants, analysis  # noqa: E402
from jax_privacy.matrix_factorization import buffered_toeplitz, sensitivity, toeplitz  # noqa: E402

BANDED = {  # name -> (coefficients of C, T)
    "banded3": ([1.0, 0.6, 0.3], 12),
    "banded4_signed": ([1.0, -0.4, 0.25, 0.1], 12),
}
BLT = {  # name -> (omega, theta of C^-1, T)
    "blt1": ([-0.3], [0.6], 16),
    "blt2": ([-0.0491, -0.452], [0.8309, 0.2142], 16),  # near jax-privacy's optimum for T=64, 2 buffers, mean
}
PARTICIPATIONS = [(1, 1), (2, 4), (3, 4), (3, 2), (2, 6), (4, 3)]  # (k, min_separation)
SIGMA_OVER_SENS = [0.8, 1.5, 4.0]  # unamplified: ε of Gaussian(σ/Δ)
AMPLIFIED = [  # (nm = σ/‖c‖, num_samples, batch_size, cycle_length b', steps T)
    (1.0, 6000, 100, 6, 60),
    (0.7, 10000, 50, 4, 40),
]
OPTIMISED = [("banded", 64, 4), ("banded", 32, 8), ("blt", 64, 2), ("blt", 64, 3)]  # (kind, T, bands/buffers)
DELTA = 1e-5


def _strategy_coefs(name: str) -> tuple[np.ndarray, np.ndarray, int]:
    """(c, d, T): Toeplitz coefficients of C and C⁻¹ as jax-privacy computes them."""
    if name in BANDED:
        c, T = BANDED[name]
        c = jnp.array(c, dtype=jnp.float64)
        return np.asarray(toeplitz.pad_coefs_to_n(c, T)), np.asarray(toeplitz.inverse_coef(c, T)), T
    omega, theta, T = BLT[name]
    noising = buffered_toeplitz.BufferedToeplitz.build(buf_decay=theta, output_scale=omega)
    return np.asarray(noising.inverse().toeplitz_coefs(T)), np.asarray(noising.toeplitz_coefs(T)), T


def _streamed_inverse(name: str, z: np.ndarray) -> np.ndarray:
    """C⁻¹z through jax-privacy's streaming matrices (BLT buffers; banded: Toeplitz back-substitution)."""
    if name in BLT:
        omega, theta, _ = BLT[name]
        noising = buffered_toeplitz.BufferedToeplitz.build(buf_decay=theta, output_scale=omega)
        # C^-1 is the noising BLT itself: stream it as a matrix (its own buffers).
        stream = noising.as_streaming_matrix()
    else:
        c, T = BANDED[name]
        stream = toeplitz.inverse_as_streaming_matrix(jnp.array(c, dtype=jnp.float64))
    from jax_privacy.matrix_factorization import streaming_matrix

    return np.asarray(streaming_matrix.multiply_array(stream, jnp.asarray(z)))


def _sensitivities(C: jnp.ndarray, c: np.ndarray, T: int, banded_bands: int | None) -> list:
    out = []
    monotone = bool(np.all(c >= 0) and np.all(np.diff(c) <= 0))
    for k, sep in PARTICIPATIONS:
        if (k - 1) * sep >= T:
            continue
        row = {"k": k, "min_separation": sep}
        row["upper_bound_alg4"] = sensitivity.get_min_sep_sensitivity_upper_bound(C, sep, k)
        if k == 1:
            row["exact"] = float(sensitivity.single_participation_sensitivity(C))
        elif banded_bands is not None and banded_bands <= sep:
            row["exact"] = sensitivity.get_sensitivity_banded(C, sep, k)
        if monotone:  # McKenna 2024 (arXiv 2405.13763) Thm 2: exact for nonneg nonincreasing Toeplitz C
            row["toeplitz_thm2"] = float(np.sqrt(toeplitz.minsep_sensitivity_squared(jnp.asarray(c), sep, k, n=T)))
        if T % k == 0 and sep == T // k:  # (k, b)-fixed-epoch order: a subset of the min-sep patterns
            row["fixed_epoch"] = sensitivity.fixed_epoch_sensitivity(C, k)
        out.append(row)
    return out


def _accountant(kind: str) -> accountants.DpAccountantConfig:
    return accountants.PldAccountantConfig() if kind == "pld" else accountants.RdpAccountantConfig()


def _epsilons() -> dict:
    single = []
    for mu_inv in SIGMA_OVER_SENS:
        row = {"noise_multiplier": mu_inv}
        for acc in ("pld", "rdp"):
            params = analysis.DpParams(noise_multipliers=mu_inv, num_samples=1000, delta=DELTA, batch_size=10)
            row[acc] = float(analysis.SingleReleaseTrainingAccountant(_accountant(acc)).compute_epsilon(1, params))
        single.append(row)
    amplified = []
    for nm, n, bs, cycle, steps in AMPLIFIED:
        row = {"noise_multiplier": nm, "num_samples": n, "batch_size": bs, "cycle_length": cycle, "steps": steps}
        row["sample_rate"] = bs / float(n // cycle)
        for acc in ("pld", "rdp"):
            params = analysis.DpParams(
                noise_multipliers=nm, num_samples=n, delta=DELTA, batch_size=bs, cycle_length=cycle
            )
            row[acc] = float(analysis.DpsgdTrainingAccountant(_accountant(acc)).compute_epsilon(steps, params))
        amplified.append(row)
    return {"delta": DELTA, "single_release": single, "amplified_bandmf": amplified}


def _optimised() -> list:
    out = []
    for kind, T, size in OPTIMISED:
        for objective in ("mean", "max"):
            reduction = jnp.mean if objective == "mean" else jnp.max
            if kind == "banded":
                c = toeplitz.optimize_banded_toeplitz(T, size, reduction_fn=reduction, max_optimizer_steps=500)
                value = float(toeplitz.loss(c, T, reduction))
                params = {"coefficients": [float(x) for x in np.asarray(c)]}
            else:
                loss_fn = buffered_toeplitz.LossFn.build_min_sep(n=T, error=objective, min_sep=1, max_participations=1)
                blt, _ = buffered_toeplitz.optimize_loss(loss_fn=loss_fn, num_buffers=size)
                c = np.asarray(blt.toeplitz_coefs(T))
                value = float(toeplitz.loss(jnp.asarray(c), T, reduction))
                inv = blt.inverse()
                params = {
                    "omega": [float(x) for x in np.asarray(inv.output_scale)],
                    "theta": [float(x) for x in np.asarray(inv.buf_decay)],
                }
            out.append({"kind": kind, "steps": T, "size": size, "objective": objective, "loss": value, **params})
    return out


def compute(optimise: bool = True) -> dict:
    """The whole fixture as a JSON-ready dict (``optimise=False`` skips the slow strategy optimisation)."""
    import jax_privacy

    rng = np.random.default_rng(36)
    strategies = {}
    for name in list(BANDED) + list(BLT):
        c, d, T = _strategy_coefs(name)
        C = toeplitz.materialize_lower_triangular(jnp.asarray(c))
        z = rng.standard_normal((T, 3))
        w = _streamed_inverse(name, z)
        entry = {
            "steps": T,
            "C_column": c.tolist(),
            "C_inverse_column": d.tolist(),
            "z": z.tolist(),
            "streamed_noise": w.tolist(),
            "sensitivity": _sensitivities(C, c, T, len(BANDED[name][0]) if name in BANDED else None),
            "loss_mean": float(toeplitz.loss(jnp.asarray(c), T, jnp.mean)),
            "loss_max": float(toeplitz.loss(jnp.asarray(c), T, jnp.max)),
        }
        if name in BANDED:
            entry["coefficients"] = BANDED[name][0]
        else:
            entry["omega"], entry["theta"] = BLT[name][0], BLT[name][1]
            noising = buffered_toeplitz.BufferedToeplitz.build(buf_decay=BLT[name][1], output_scale=BLT[name][0])
            entry["blt_sensitivity_closed_form"] = float(
                np.sqrt(buffered_toeplitz.sensitivity_squared(noising.inverse(), T))
            )
        strategies[name] = entry
    out = {
        "jax_privacy_version": jax_privacy.__version__,
        "jax_version": jax.__version__,
        "script": "benchmarks/jax_privacy_mf_fixture.py",
        "strategies": strategies,
        "epsilon": _epsilons(),
    }
    if optimise:
        out["optimised"] = _optimised()
    return out


if __name__ == "__main__":
    json.dump(compute(optimise="--no-optimise" not in sys.argv), sys.stdout, indent=1)
    sys.stdout.write("\n")
