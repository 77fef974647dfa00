"""Issue 38: the validation choice of each method's lr, the test config, the table and the plot (docs/results/finetune-vit).

``check CHECK_JSON --out FILE``: the per-run verdicts of ``dpopt check --json``, compactly.

``select TUNE_RESULTS --config TOML --md MD``: per (method, target ε) the lr with the best ``val_accuracy`` of the
seed-0 tuning sweep (ties: the smaller lr); writes the grid as Markdown and the test sweep config: per (method, ε)
the chosen lr with seeds 1 and 2 (the seed-0 tuning run at that lr is the cell's third seed: its test accuracy played
no part in the choice), then from-scratch runs of the same ViT (no ``init_from``) at the same lr, seed 0. The choice
is NOT charged to any ε.

``report TEST_RESULTS... --tuning TUNE_RESULTS --out DIR``: per (method, start, ε) the mean ± sample std of
``test_accuracy`` over the seeds (``table.md``/``table.json``), the optimizer state per method (every tensor of the
``optimizer`` and ``privatizer`` entries of a run's ``checkpoint.pt``: what the method keeps between steps, in bytes,
and over the 4 bytes × trainable parameters of the float32 model), the wall time per step (median of the runs'
``wall_seconds / steps``, evaluation included, on a loaded shared CPU) and ``accuracy-vs-epsilon.png`` (error bars:
the sample std over seeds).

Usage (repository root)::

    python experiments/finetune-vit/report.py select runs/sweeps/finetune-vit-tune/results.jsonl \\
        --config experiments/finetune-vit-test.toml --md docs/results/finetune-vit/tuning.md
    python experiments/finetune-vit/report.py report runs/sweeps/finetune-vit-test/results.jsonl \\
        runs/sweeps/finetune-vit-seeds/results.jsonl \\
        --tuning runs/sweeps/finetune-vit-tune/results.jsonl --out docs/results/finetune-vit

After a library fix that changes some methods (the Muon routing fix, commit d97a7eb), those methods are re-run and
their new result files passed with ``--rerun-tuning`` (to ``select`` and ``report``) and ``--rerun`` (to ``report``):
a method with rows there keeps only those rows (``experiments/finetune-vit/run_all.sh`` has the commands).

Issue 40: DP-SGD with ``clipping = "auto"`` (AUTO-S) is its own entry, ``dp-sgd-auto``, in the choice, the generated
config (which writes the ``clipping``) and the table; ``select --no-scratch`` writes a test config of full fine-tunes
only and ``report --suffix S`` writes ``table{S}.md``/``.json`` and ``accuracy-vs-epsilon{S}.png``
(``experiments/finetune-vit/run-issue40.sh`` has the commands).
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

#: table order; "dp-sgd-auto" is DP-SGD with clipping = "auto" (AUTO-S, issue 40), "dp-muon-bc" dpopt's DP-MuonBC
METHODS = ("dp-sgd", "dp-sgd-auto", "dp-adam", "dp-muon", "dp-muon-bc", "dp-muon-s", "dp-macadam")
STARTS = {"full": "public ViT, full fine-tune", "scratch": "from scratch (no public data)"}
TEST_SEEDS = (1, 2)


def _rows(path: str) -> list[dict]:
    p = Path(path)
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()] if p.exists() else []


def _load(paths: Sequence[str], rerun: Sequence[str]) -> list[dict]:
    """The rows of ``paths``, except that an entry (method, AUTO-S apart: :func:`_entry`) with rows in ``rerun``
    (result files of a re-run after a library fix, e.g. the Muon routing fix of commit d97a7eb) keeps only its
    ``rerun`` rows: its earlier ones are superseded."""
    new = [r for path in rerun for r in _rows(path)]
    redone = {_entry(r) for r in new}
    return [r for path in paths for r in _rows(path) if _entry(r) not in redone] + new


def _eps(r: dict) -> float:
    return float(r["point"].get("target_epsilon", r.get("target_epsilon") or round(r["epsilon"])))


def _entry(r: dict) -> str:
    """The table's method name: the method, plus ``-auto`` for automatic clipping (AUTO-S, issue 40)."""
    return r["method"] + ("-auto" if r.get("clipping") == "auto" else "")


def _start(r: dict) -> str:
    cfg = json.loads((Path(r["run_dir"]) / "config.json").read_text())
    return "full" if cfg.get("init_from") else "scratch"


def select(
    results: str,
    config: str | None,
    md: str | None,
    rerun: Sequence[str] = (),
    seeds: Sequence[int] = TEST_SEEDS,
    scratch: bool = True,
) -> dict:
    """Best val_accuracy per (entry, target ε) among the seed-0 tuning runs; returns {(entry, ε): row}, the entry
    being the method plus ``-auto`` for AUTO-S (see :func:`_entry`).

    ``rerun``: tuning result files whose entries supersede theirs in ``results`` (see :func:`_load`); the test config
    then holds only the re-run entries, at ``seeds``. ``scratch=False``: the test config has the full fine-tunes
    only."""
    groups: dict = defaultdict(list)
    redone = {_entry(r) for path in rerun for r in _rows(path)}
    for r in _load([results], list(rerun)):
        groups[(_entry(r), _eps(r))].append(r)
    best = {k: max(sorted(v, key=lambda r: r["lr"]), key=lambda r: r["val_accuracy"]) for k, v in groups.items()}
    lines = [
        "| method (full fine-tune) | target ε | σ | lr: val_accuracy (chosen in bold) |",
        "|---|---|---|---|",
    ]
    for (m, e), v in sorted(groups.items(), key=lambda kv: (-kv[0][1], METHODS.index(kv[0][0]))):
        v = sorted(v, key=lambda r: r["lr"])
        cells = [
            f"**{r['lr']:g}: {r['val_accuracy']:.3f}**"
            if r is best[(m, e)]
            else f"{r['lr']:g}: {r['val_accuracy']:.3f}"
            for r in v
        ]
        edge = " (edge of the grid)" if best[(m, e)]["lr"] in (v[0]["lr"], v[-1]["lr"]) and len(v) > 1 else ""
        lines.append(f"| {m} | {e:g} | {v[0]['noise_multiplier']:.3f} | " + "; ".join(cells) + edge + " |")
    text = "\n".join(lines) + "\n\nval_accuracy on the 500 held-out private training records (seed 0, one run each)."
    if redone:
        text += f" {', '.join(sorted(redone))}: re-run after the Muon routing fix (commit d97a7eb)."
    text += "\n"
    print(text)
    if md:
        Path(md).parent.mkdir(parents=True, exist_ok=True)
        Path(md).write_text(text)
    if config:
        _write_config(
            {k: v for k, v in best.items() if not redone or k[0] in redone},
            config,
            results,
            list(seeds),
            bool(redone),
            scratch,
        )
    return best


def _write_config(
    best: dict, config: str, results: str, seeds: list[int], rerun: bool = False, scratch: bool = True
) -> None:
    name = Path(config).stem
    out = [
        "# GENERATED by experiments/finetune-vit/report.py select from the validation choice of",
        f"# {results} (best val_accuracy per method and target ε, seed 0; NOT charged to any ε).",
        "# Same protocol as the tuning runs (4,500 private training records, the 500 validation records held out).",
        *(
            ["# RE-RUN of the methods below after the Muon routing fix (commit d97a7eb); their tuning sweep:"]
            if rerun
            else []
        ),
        *([f"# experiments/{Path(config).stem.replace('-test', '-tune')}.toml."] if rerun else []),
        f"# Part 1: full fine-tunes at the chosen lr, seeds {seeds} (the seed-0 tuning run is one more seed;",
        "# every weight comes from the public model, so the seed initialises nothing: the runs differ by their secret",
        "# noise and Poisson masks only)."
        + (
            " Part 2: the same ViT FROM SCRATCH (no init_from: the random initialisation saved in"
            " hf:runs/finetune-vit/vit-init, no public data), same lr, seed 0 (not tuned for scratch: a reduction)."
            if scratch
            else " Full fine-tunes only (no from-scratch runs)."
        ),
        f"# Run:  OMP_NUM_THREADS=1 nice -n 5 dpopt sweep {config} --jobs 1",
        "",
        "[sweep]",
        f'name = "{name}"',
        f'out = "runs/sweeps/{name}"',
        "threads = 1",
        "",
        "[base]",
        'dataset = "cifar10"',
        'data_dir = "runs/finetune-vit-data/private"',
        'model = "hf:runs/finetune-vit/vit-init"',
        "batch_size = 125",
        "epochs = 1",
        "delta = 1e-5",
        "validation_fraction = 0.1",
        "",
    ]
    order = sorted(best.items(), key=lambda kv: (-kv[0][1], METHODS.index(kv[0][0])))
    starts = (("full", seeds), ("scratch", [0])) if scratch else (("full", seeds),)
    for start, start_seeds in starts:
        for (m, e), r in order:
            for s in start_seeds:
                out += ["[[variant]]", f'method = "{r["method"]}"']
                if r.get("clipping", "flat") != "flat":
                    out.append(f'clipping = "{r["clipping"]}"')
                out += [f'label = "{m}/{start}"', f"target_epsilon = {e!r}", f"lr = {r['lr']!r}", f"seed = {s}"]
                if start == "full":
                    out.append('init_from = "runs/finetune-vit/public/model.pt"')
                out += [f"# chosen: val_accuracy {r['val_accuracy']:.4f}", ""]
    Path(config).write_text("\n".join(out))
    print(f"wrote {config}")


def state_bytes(run_dir: str) -> dict:
    """Bytes of the tensors a method keeps between steps (``optimizer`` and ``privatizer`` of RUN/checkpoint.pt)."""
    import torch

    ck = torch.load(Path(run_dir) / "checkpoint.pt", map_location="cpu", weights_only=False)

    def size(o) -> int:
        if isinstance(o, torch.Tensor):
            return o.numel() * o.element_size()
        if isinstance(o, dict):
            return sum(size(v) for v in o.values())
        if isinstance(o, (list, tuple)):
            return sum(size(v) for v in o)
        return 0

    return {"optimizer": size(ck.get("optimizer", {}).get("state", {})), "privatizer": size(ck.get("privatizer", {}))}


def report(
    results: list[str],
    tuning: str,
    out: str,
    rerun: Sequence[str] = (),
    rerun_tuning: Sequence[str] = (),
    suffix: str = "",
) -> dict:
    """table{suffix}.md, table{suffix}.json and accuracy-vs-epsilon{suffix}.png in ``out`` from the test runs plus
    the chosen tuning runs; ``rerun`` / ``rerun_tuning``: test / tuning result files whose entries supersede theirs
    (see :func:`_load`)."""
    chosen = select(tuning, None, None, rerun_tuning)
    rows = list(chosen.values())
    for r in _load(results, list(rerun)):
        if _start(r) == "scratch" or r["lr"] == chosen[(_entry(r), _eps(r))]["lr"]:
            rows.append(r)
    cells: dict = defaultdict(list)
    info: dict = {}
    for r in rows:
        key = (_entry(r), _start(r), _eps(r))
        cells[key].append(r)
        i = info.setdefault(_entry(r), {"trainable": r["num_parameters"], "per_step": []})
        i["per_step"].append(r["wall_seconds"] / max(1, r["steps"]))
        if "optimizer" not in i and (Path(r["run_dir"]) / "checkpoint.pt").exists():
            i.update(state_bytes(r["run_dir"]))
    epss = sorted({k[2] for k in cells})
    table: dict = {}
    lines = [
        "| method | start | " + " | ".join(f"test acc, ε = {e:g}" for e in epss) + " |",
        "|---|---|" + "---|" * len(epss),
    ]
    for start in STARTS:
        for m in METHODS:
            line = []
            for e in epss:
                v = cells.get((m, start, e))
                if not v:
                    line.append("–")
                    continue
                acc = [r["test_accuracy"] for r in v]
                sd = statistics.stdev(acc) if len(acc) > 1 else None
                line.append(
                    f"{statistics.mean(acc):.4f}"
                    + (f" ± {sd:.4f}" if sd is not None else "")
                    + f" (n={len(acc)}, lr {v[0]['lr']:g})"
                )
                table.setdefault(f"{m}/{start}", {})[f"eps{e:g}"] = {
                    "test_accuracy": acc,
                    "seeds": [r["seed"] for r in v],
                    "mean": statistics.mean(acc),
                    "std": sd,
                    "lr": v[0]["lr"],
                    "epsilon": max(r["epsilon"] for r in v),
                    "noise_multiplier": v[0]["noise_multiplier"],
                    "steps": v[0]["steps"],
                }
            if any(c != "–" for c in line):
                lines.append(f"| {m} | {STARTS[start]} | " + " | ".join(line) + " |")
    mem = [
        "| method | trainable params | optimizer state | × parameter bytes | wall s/step (median) |",
        "|---|---|---|---|---|",
    ]
    for m in METHODS:
        if m not in info:
            continue
        i = info[m]
        opt = i.get("optimizer")
        ratio = None if opt is None else opt / (4 * i["trainable"])
        i["wall_s_per_step"] = statistics.median(i.pop("per_step"))
        i["state_over_param_bytes"] = ratio
        mem.append(
            f"| {m} | {i['trainable']:,} | "
            + ("–" if opt is None else f"{opt:,} B ({opt / 2**20:.2f} MiB)")
            + f" | {'–' if ratio is None else f'{ratio:.2f}'} | {i['wall_s_per_step']:.2f} |"
        )
    text = (
        "\n".join(lines)
        + "\n\ntest_accuracy on the private test set (3,000 CIFAR-10 training records of classes 5–9 never trained on):"
        " mean ± sample std over the n seeds at the validation-chosen lr (from scratch: that same lr, not tuned).\n\n"
        + "\n".join(mem)
        + "\n\nOptimizer state: bytes of the tensors in the `optimizer` and `privatizer` entries of the run's"
        " checkpoint.pt (float32); × parameter bytes = over 4 × trainable parameters. Wall s/step: the run's"
        " wall_seconds / steps (evaluation included) on a 2-core CPU shared with other jobs.\n"
    )
    print(text)
    o = Path(out)
    o.mkdir(parents=True, exist_ok=True)
    (o / f"table{suffix}.md").write_text(text)
    (o / f"table{suffix}.json").write_text(json.dumps({"cells": table, "methods": info}, indent=1))
    _plot(table, o / f"accuracy-vs-epsilon{suffix}.png")
    return table


def _plot(table: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for j, m in enumerate(METHODS):
        for start, style in (("full", "-o"), ("scratch", ":s")):
            c = table.get(f"{m}/{start}")
            if not c:
                continue
            es = sorted(float(k[3:]) for k in c)
            ys = [c[f"eps{e:g}"]["mean"] for e in es]
            err = [c[f"eps{e:g}"]["std"] or 0.0 for e in es]
            xs = [e * (1 + 0.04 * (j - 2)) for e in es]  # small offsets so the error bars do not overlap
            ax.errorbar(xs, ys, yerr=err, fmt=style, color=f"C{j}", capsize=3, label=f"{m} ({start})")
    ax.set_xscale("log")
    ax.set_xticks([1, 8], ["1", "8"])
    ax.minorticks_off()
    ax.set_xlabel("ε (δ = 1e-5)")
    ax.set_ylabel("private test accuracy (CIFAR-10 classes 5–9)")
    ax.set_title(
        "Tiny ViT: public pretraining → private fine-tuning\nerror bars: sample std over runs (n = 3–5; scratch: 1 run)"
    )
    ax.legend(fontsize=7, ncol=2)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def check_summary(check_json: str, out: str) -> bool:
    """Write the verdict of ``dpopt check --json`` (overall and per run directory) compactly to ``out``."""
    d = json.loads(Path(check_json).read_text())
    summary = {
        "passed": d["passed"],
        "n_runs": len(d["runs"]),
        "repeated_run_ids": d["repeated_run_ids"],
        "runs": {k: v["passed"] for k, v in d["runs"].items()},
    }
    Path(out).write_text(json.dumps(summary, indent=1))
    print(f"dpopt check: {sum(summary['runs'].values())} of {summary['n_runs']} run directories pass")
    return bool(d["passed"])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("select")
    s.add_argument("results")
    s.add_argument("--config")
    s.add_argument("--md")
    s.add_argument("--rerun-tuning", nargs="*", default=[], help="tuning results of methods re-run after a fix")
    s.add_argument("--seeds", nargs="*", type=int, default=list(TEST_SEEDS), help="seeds of the test config")
    s.add_argument("--no-scratch", action="store_true", help="test config with the full fine-tunes only")
    r = sub.add_parser("report")
    r.add_argument("results", nargs="+")
    r.add_argument("--tuning", required=True)
    r.add_argument("--out", required=True)
    r.add_argument("--rerun", nargs="*", default=[], help="test results of methods re-run after a fix")
    r.add_argument("--rerun-tuning", nargs="*", default=[], help="tuning results of methods re-run after a fix")
    r.add_argument("--suffix", default="", help="output names table{SUFFIX}.md/.json, accuracy-vs-epsilon{SUFFIX}.png")
    c = sub.add_parser("check")
    c.add_argument("check_json")
    c.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    if a.cmd == "check":
        check_summary(a.check_json, a.out)
    elif a.cmd == "select":
        select(a.results, a.config, a.md, a.rerun_tuning, a.seeds, scratch=not a.no_scratch)
    else:
        report(a.results, a.tuning, a.out, a.rerun, a.rerun_tuning, a.suffix)


if __name__ == "__main__":
    main()
