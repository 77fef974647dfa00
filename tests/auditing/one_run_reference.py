"""Cross-check of dpopt's one-run estimators against jax-privacy's (prints JSON; not a test).

Run in an environment with jax-privacy (it needs JAX; CPU is enough) and
dpopt's source on the path, e.g.::

    python3 -m venv /tmp/jaxvenv && /tmp/jaxvenv/bin/pip install jax jaxlib jax-privacy
    PYTHONPATH=src /tmp/jaxvenv/bin/python tests/auditing/one_run_reference.py

It prints, for the count cases and score sets of :data:`COUNT_CASES` and
:func:`score_sets`, jax-privacy's ε next to dpopt's. The numbers stored in
``tests/auditing/test_one_run_stats.py`` were produced by this command
(jax-privacy 2.0.0, jax 0.10.2).
"""

import json

import numpy as np

#: (m, guesses, correct, significance, delta)
COUNT_CASES = [
    (1000, 100, 90, 0.05, 1e-5),
    (1000, 100, 100, 0.05, 1e-5),
    (1000, 500, 400, 0.05, 0.0),
    (10000, 1000, 950, 0.05, 1e-5),
    (10000, 256, 256, 0.002, 1e-5),
    (10000, 2000, 1500, 0.01, 1e-6),
    (100, 20, 19, 0.1, 1e-5),
]


def score_sets():
    """Seeded score sets: m canaries, included w.p. 1/2, in-scores shifted by mu (name -> (in, out))."""
    out = {}
    for name, m, mu, seed in [("m1000_mu2", 1000, 2.0, 0), ("m2000_mu1.67", 2000, 1.666, 1), ("m500_mu4", 500, 4.0, 2)]:
        rng = np.random.default_rng(seed)
        inc = rng.random(m) < 0.5
        s = rng.normal(0, 1, m) + mu * inc
        out[name] = (s[inc], s[~inc])
    return out


def main():
    from jax_privacy import auditing as jp

    from dpopt.auditing import one_run_stats as ours

    rows = {"counts": [], "scores": []}
    for m, k, c, sig, delta in COUNT_CASES:
        rows["counts"].append(
            {
                "case": [m, k, c, sig, delta],
                "jax_steinke": float(jp._epsilon_one_run(0.0, m, k, c, sig, delta)),
                "ours_steinke": ours.steinke_epsilon(m, k, c, delta, sig),
                "jax_fdp": float(jp._epsilon_one_run_fdp(0.0, m, k, c, sig, delta)) if delta > 0 else None,
                "ours_fdp": ours.fdp_epsilon(m, k, c, delta, sig) if delta > 0 else None,
            }
        )
    for name, (sin, sout) in score_sets().items():
        a = jp.CanaryScoreAuditor(sin, sout)
        tau = float(np.quantile(np.concatenate([sin, sout]), 0.85))
        k = int(np.sum(sin >= tau) + np.sum(sout >= tau))
        ex = ours.one_run_bounds(sin, sout, 1e-5, 0.05, guess_counts=[k], sides="upper")
        al = ours.one_run_bounds(sin, sout, 1e-5, 0.05, guess_counts="all")
        rows["scores"].append(
            {
                "name": name,
                "threshold": tau,
                "k": k,
                "jax_explicit_steinke": float(a.epsilon_one_run(0.05, 1e-5, threshold_strategy=jp.Explicit(tau))),
                "ours_explicit_steinke": ex.steinke,
                "jax_explicit_fdp": float(a.epsilon_one_run_fdp(0.05, 1e-5, threshold_strategy=jp.Explicit(tau))),
                "ours_explicit_fdp": ex.fdp,
                "jax_bonferroni_steinke": float(a.epsilon_one_run(0.05, 1e-5)),
                "jax_bonferroni_fdp": float(a.epsilon_one_run_fdp(0.05, 1e-5)),
                "jax_bonferroni_tries": int(len(a._fn_counts)),
                "ours_all_steinke": al.steinke,
                "ours_all_fdp": al.fdp,
                "ours_all_tries": al.tries,
            }
        )
    print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
