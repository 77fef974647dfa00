"""One-run audits of correlated-noise runs (issue 36): white-box DP-SGD on digits at ε = 8, BLT and banded.

    OMP_NUM_THREADS=1 nice -n 5 python benchmarks/one_run_audit_correlated.py OUT.jsonl [--repeats R]

Each row trains one configuration once with m canaries (dpopt.auditing.one_run, Steinke, Nasr & Jagielski
2023) and prints the ledger's claimed ε (the mechanism's: ONE Gaussian at the strategy's sensitivity over
cyclic batches, or the amplified rounds of cyclic Poisson sampling), both lower bounds at confidence 0.95,
the claimed μ where the run is μ-GDP (cyclic batches: μ = Δ/σ) and the verdict. Then a control (mutant
``noise_half`` of tests/auditing/mutants.py: the noise halved while the ledger claims the original σ) and R
repeated 1-epoch BLT audits at m = 1000 with the number of EXCEEDS verdicts and the binomial p-value
P[Bin(R, 2β) ≥ that number] (2β: either estimator may exceed). Resumable: rows already in OUT.jsonl (by
name) are skipped; every row carries its CPU and wall seconds.
"""

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path

import torch
from scipy import stats

from dpopt.auditing import one_run
from dpopt.data import load_dataset
from dpopt.training import TrainConfig


def configs() -> dict:
    base = dict(method="dp-sgd", target_epsilon=8.0)
    return {
        "blt, 1 epoch (T=22, k=1)": TrainConfig(epochs=1, noise_mechanism="blt", **base),
        "banded:4, 1 epoch (T=22, k=1)": TrainConfig(epochs=1, noise_mechanism="banded:4", **base),
        "blt, 10 epochs (T=225, k=11)": TrainConfig(epochs=10, noise_mechanism="blt", **base),
        "banded:4 cyclic-poisson q=0.2, 10 epochs (T=220, 55 rounds)": TrainConfig(
            epochs=10, noise_mechanism="banded:4", sampling="cyclic-poisson", sample_rate=0.2, **base
        ),
    }


def _mutant(name: str):
    path = Path(__file__).resolve().parent.parent / "tests" / "auditing" / "mutants.py"
    spec = importlib.util.spec_from_file_location("dpopt_mutants", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["dpopt_mutants"] = mod
    spec.loader.exec_module(mod)
    return mod.activate(name)


def _row(name: str, cfg: TrainConfig, m: int, seed: int, data, beta: float) -> dict:
    t, c = time.perf_counter(), time.process_time()
    r = one_run(cfg, canaries=m, beta=beta, data=data, seed=seed)
    return {
        "run": name,
        "m": m,
        "seed": seed,
        "steps": r.details["steps"],
        "sigma": r.details["noise_multiplier"],
        "sampling": r.details.get("sampling"),
        "claimed": r.epsilon,
        "claimed_mu": r.claimed_mu,
        "steinke": r.bounds.steinke,
        "fdp": r.bounds.fdp,
        "mu_lower": r.bounds.mu,
        "fdp_judged": r.details["fdp_judged"],
        "verdict": r.verdict,
        "cpu_seconds": round(time.process_time() - c, 1),
        "wall_seconds": round(time.perf_counter() - t, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--beta", type=float, default=0.05)
    args = ap.parse_args()
    torch.set_num_threads(1)
    out = Path(args.out)
    done = {}
    if out.exists():
        for line in out.read_text().splitlines():
            row = json.loads(line)
            done[(row["run"], row["m"], row["seed"])] = row
    data = load_dataset("digits")
    plan = [(name, cfg, m, m) for name, cfg in configs().items() for m in (1000, 10000)]
    blt1 = configs()["blt, 1 epoch (T=22, k=1)"]
    plan += [("CONTROL noise_half: blt, 1 epoch", blt1, m, m) for m in (1000, 10000)]
    plan += [("repeat: blt, 1 epoch", blt1, 1000, 100 + i) for i in range(args.repeats)]
    for name, cfg, m, seed in plan:
        if (name, m, seed) in done:
            continue
        undo = _mutant("noise_half") if name.startswith("CONTROL") else None
        try:
            row = _row(name, cfg, m, seed, data, args.beta)
        finally:
            if undo is not None:
                undo()
        done[(name, m, seed)] = row
        with out.open("a") as f:
            f.write(json.dumps(row) + "\n")
        print(json.dumps(row), flush=True)
    reps = [r for k, r in done.items() if k[0].startswith("repeat")]
    over = sum(r["verdict"] != "PASS" for r in reps)
    p = float(stats.binom.sf(over - 1, len(reps), 2 * args.beta)) if over else 1.0
    print(json.dumps({"repeats": len(reps), "beta": args.beta, "exceedances": over, "binomial_p_value": p}))


if __name__ == "__main__":
    main()
