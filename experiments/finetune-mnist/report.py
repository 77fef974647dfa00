"""Issue 21: choose each (method, start, ε)'s learning rate on the validation split, then tabulate the test runs.

``select``: read the tuning sweeps' results (``experiments/finetune-mnist-tune.toml``, and
``experiments/finetune-mnist-tune-issue40.toml`` for issue 40's DP-MuonBC and AUTO-S: ``val_accuracy`` on 10 % of
the PRIVATE training set held out), pick per (label, target ε) the lr with the best ``val_accuracy`` (ties: the
first in file order), print the grid as Markdown and write the test sweep config: one variant per (label, ε) at the
chosen lr, crossed with the extra seeds, on the SAME training set (the validation split stays held out), so that the
seed-0 tuning run at the chosen lr is the table's seed 0 (its test accuracy played no part in the choice) and each
cell has 1 + len(seeds) runs of one protocol (a reduction for CPU time: no retraining on the full private set).
The choice is NOT charged to any ε.

``report``: per (label, ε) the mean ± sample std of ``test_accuracy`` over the seeds, the ε reached and σ, and per
label (method/start) the trainable parameters, the wall time per step (median over that label's runs: the run's
``wall_seconds`` / ``steps``, evaluation included, measured on a shared CPU) and the optimizer state's size (every
tensor of the ``optimizer`` entry of the run's ``checkpoint.pt``, plus the privatizer's, in bytes: what the method
keeps between steps, not the per-example gradients).

Usage (repository root)::

    python experiments/finetune-mnist/report.py select runs/sweeps/finetune-mnist-tune/results.jsonl \\
        --config experiments/finetune-mnist-test.toml --md docs/results/finetune-mnist/tuning.md
    python experiments/finetune-mnist/report.py report runs/sweeps/finetune-mnist-test/results.jsonl \\
        --tuning runs/sweeps/finetune-mnist-tune/results.jsonl --md docs/results/finetune-mnist/table.md --json docs/results/finetune-mnist/table.json

Issue 40 (the new entries only; their rows were added to table.md / table.json, whose issue-21 run directories
are not kept)::

    python experiments/finetune-mnist/report.py select runs/sweeps/finetune-mnist-tune-issue40/results.jsonl \\
        --config experiments/finetune-mnist-test-issue40.toml --md docs/results/finetune-mnist/tuning-issue40.md
    python experiments/finetune-mnist/report.py report runs/sweeps/finetune-mnist-test-issue40/results.jsonl \\
        --tuning runs/sweeps/finetune-mnist-tune-issue40/results.jsonl \\
        --md docs/results/finetune-mnist/table-issue40.md --json docs/results/finetune-mnist/table-issue40.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path

#: table order; "dp-sgd-auto" is DP-SGD with clipping = "auto" (AUTO-S, issue 40), "dp-muon-bc" dpopt's DP-MuonBC
METHODS = ("dp-sgd", "dp-sgd-auto", "dp-adam", "dp-muon", "dp-muon-bc", "dp-macadam")
STARTS = ("full", "lora", "scratch")
START_NAMES = {
    "full": "public model, full fine-tune",
    "lora": "public model, LoRA r = 8",
    "scratch": "from scratch (no public data)",
}


def _rows(path: str) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def _eps_key(r: dict) -> float:
    return float(r["point"].get("target_epsilon", r.get("target_epsilon") or round(r["epsilon"])))


def select(results: str | list[str], config: str | None, md: str | None, seeds: list[int]) -> dict:
    """Best val_accuracy per (label, target ε) over one or more results files; returns {(label, ε): row}."""
    groups: dict = defaultdict(list)
    for r in (r for p in ([results] if isinstance(results, str) else results) for r in _rows(p)):
        groups[(r["label"], _eps_key(r))].append(r)
    best = {k: max(v, key=lambda r: r["val_accuracy"]) for k, v in groups.items()}
    lines = ["| method/start | target ε | σ | lr: val_accuracy (chosen in bold) |", "|---|---|---|---|"]
    for (label, eps), v in sorted(groups.items(), key=lambda kv: (kv[0][1], _order(kv[0][0]))):
        cells = [
            (
                f"**{r['lr']:g}: {r['val_accuracy']:.4f}**"
                if r is best[(label, eps)]
                else f"{r['lr']:g}: {r['val_accuracy']:.4f}"
            )
            for r in sorted(v, key=lambda r: r["lr"])
        ]
        edge = (
            " (edge of the grid)"
            if best[(label, eps)]["lr"] in (min(r["lr"] for r in v), max(r["lr"] for r in v))
            else ""
        )
        lines.append(f"| {label} | {eps:g} | {v[0]['noise_multiplier']:.3f} | " + "; ".join(cells) + edge + " |")
    text = "\n".join(lines) + "\n"
    print(text)
    if md:
        Path(md).parent.mkdir(parents=True, exist_ok=True)
        Path(md).write_text(text)
    if config:
        _write_config(best, config, seeds, [results] if isinstance(results, str) else results)
    return best


def _order(label: str) -> tuple:
    m, _, s = label.partition("/")
    return (STARTS.index(s) if s in STARTS else 9, METHODS.index(m) if m in METHODS else 9)


def _write_config(best: dict, config: str, seeds: list[int], sources: list[str]) -> None:
    name = Path(config).stem
    out = [
        "# GENERATED by experiments/finetune-mnist/report.py select from the validation choice in",
        f"# {', '.join(sources)} (best val_accuracy per method/start and target ε; the choice is",
        "# NOT charged to any ε). Test runs: the private training set less the validation split (digits 5-9,",
        "# 26,464 of 29,404 records, as in tuning), scored on the private test set (4,861), seeds",
        f"# {seeds} (initialisation only: the noise is secret).",
        "# mlp 784-1000-10, B̄ = 256, 2 epochs (207 steps), δ = 1e-5, σ calibrated to target_epsilon.",
        "# Data: experiments/finetune-mnist/make_splits.py; public model: experiments/finetune-mnist/pretrain.py.",
        f"# Run:  OMP_NUM_THREADS=1 nice -n 5 dpopt sweep {config} --jobs 1",
        "",
        "[sweep]",
        f'name = "{name}"',
        f'out = "runs/sweeps/{name}"',
        "threads = 1",
        "",
        "[base]",
        'dataset = "mnist"',
        'data_dir = "runs/finetune-data/private"',
        'model = "mlp"',
        "batch_size = 256",
        "epochs = 2",
        "delta = 1e-5",
        "validation_fraction = 0.1",
        "",
        "[grid]",
        f"seed = {seeds}",
        "",
    ]
    for (label, eps), r in sorted(best.items(), key=lambda kv: (kv[0][1], _order(kv[0][0]))):
        out += [
            "[[variant]]",
            f'method = "{r["method"]}"',
            f'label = "{label}"',
            f"target_epsilon = {eps!r}",
            f"lr = {r['lr']!r}",
        ]
        cfg = _run_config(r)
        if r.get("clipping", "flat") != "flat":
            out.append(f'clipping = "{r["clipping"]}"')
        if cfg.get("init_from"):
            out.append(f'init_from = "{cfg["init_from"]}"')
        if cfg.get("lora_rank"):
            out.append(f"lora_rank = {cfg['lora_rank']}")
        out.append(f"# chosen: val_accuracy {r['val_accuracy']:.4f}")
        out.append("")
    Path(config).write_text("\n".join(out))
    print(f"wrote {config}")


def _run_config(r: dict) -> dict:
    """The run's own config.json (init_from, lora_rank, ...): a sweep's ``point`` lists only the options that vary
    within its config, so a part of the grid run as its own config has them only there."""
    path = Path(r["run_dir"]) / "config.json"
    return json.loads(path.read_text()) if path.exists() else dict(r["point"])


def _entry(r: dict) -> str:
    """The table's method name: the method, plus ``-auto`` for automatic clipping (AUTO-S)."""
    return r["method"] + ("-auto" if r.get("clipping") == "auto" else "")


def _start(r: dict) -> str:
    cfg = _run_config(r)
    return "lora" if cfg.get("lora_rank") else ("full" if cfg.get("init_from") else "scratch")


def state_bytes(run_dir: str) -> dict:
    """Bytes of the tensors a method keeps between steps, from ``RUN/checkpoint.pt``.

    Returns ``{"optimizer": bytes, "privatizer": bytes}``: every tensor under the checkpoint's ``optimizer``
    (``state``: momentum buffers, Adam moments, MacAdam's centre/scale/variance EMA, ...) and ``privatizer`` entries.
    Raises FileNotFoundError when the run directory has no checkpoint.
    """
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


def report(results: list[str], md: str | None, js: str | None, tuning: list[str] | None = None) -> dict:
    """Tables of the test runs (``results``) plus, with ``tuning``, the seed-0 tuning run at each chosen lr."""
    rows = [r for p in results for r in _rows(p)]
    for r in rows:  # the start a run really had (its config), whatever its sweep label says
        r["label"] = _entry(r) + "/" + _start(r)
    if tuning:
        chosen = select(tuning, None, None, [])
        # a test run counts for a cell only at the lr chosen for it
        rows = [
            r
            for r in rows
            if (r["label"], _eps_key(r)) in chosen and r["lr"] == chosen[(r["label"], _eps_key(r))]["lr"]
        ]
        rows = list(chosen.values()) + rows
    acc: dict = defaultdict(list)
    eps: dict = defaultdict(list)
    sigma: dict = defaultdict(list)
    lr: dict = {}
    per_step: dict = defaultdict(list)
    info: dict = {}
    for r in rows:
        k = (r["label"], _eps_key(r))
        acc[k].append(r["test_accuracy"])
        eps[k].append(r["epsilon"])
        sigma[k].append(r["noise_multiplier"])
        lr[k] = r["lr"]
        per_step[r["label"]].append(r["wall_seconds"] / max(1, r["steps"]))
        if r["label"] not in info:
            try:
                sb = state_bytes(r["run_dir"])
            except FileNotFoundError:
                sb = {"optimizer": None, "privatizer": None}
            info[r["label"]] = {"trainable": r["num_parameters"], **sb}
    epss = sorted({k[1] for k in acc})
    labels = sorted({k[0] for k in acc}, key=_order)
    head = [
        "| method | start | trainable params | "
        + " | ".join(f"test acc, ε = {e:g}" for e in epss)
        + " | wall s/step | optimizer state |",
        "|---|---|---|" + "---|" * len(epss) + "---|---|",
    ]
    out_json = {}
    lines = list(head)
    for lab in labels:
        m, _, s = lab.partition("/")
        cells = []
        for e in epss:
            v = acc.get((lab, e))
            if not v:
                cells.append("–")
                continue
            sd = f" ± {statistics.stdev(v):.4f}" if len(v) > 1 else ""
            cells.append(f"{statistics.mean(v):.4f}{sd} (n={len(v)}, lr {lr[(lab, e)]:g})")
            out_json.setdefault(lab, {})[f"eps{e:g}"] = {
                "test_accuracy": v,
                "mean": statistics.mean(v),
                "lr": lr[(lab, e)],
                "epsilon": statistics.mean(eps[(lab, e)]),
                "noise_multiplier": statistics.mean(sigma[(lab, e)]),
            }
        ib = info[lab]
        opt = ib["optimizer"]
        opt_s = (
            "–" if opt is None else (f"{opt / 2**20:.2f} MiB ({opt / 4 / ib['trainable']:.2f}× params)" if opt else "0")
        )
        step = statistics.median(per_step[lab])
        out_json.setdefault(lab, {}).update(
            {
                "trainable": ib["trainable"],
                "optimizer_state_bytes": opt,
                "privatizer_state_bytes": ib["privatizer"],
                "wall_s_per_step": step,
            }
        )
        lines.append(
            f"| {m} | {START_NAMES.get(s, s)} | {ib['trainable']:,} | "
            + " | ".join(cells)
            + f" | {step:.3f} | {opt_s} |"
        )
    sig = "; ".join(
        f"ε = {e:g}: σ = {statistics.mean(x for k in sigma if k[1] == e for x in sigma[k]):.3f}, "
        f"ε reached {max(x for k in eps if k[1] == e for x in eps[k]):.3f}"
        for e in epss
    )
    text = (
        "\n".join(lines) + f"\n\ntest_accuracy on the private test set (digits 5–9): mean ± sample std over n seeds "
        f"at the validation-chosen lr. {sig} (δ = 1e-5). Optimizer state: float32 tensors kept between steps "
        "(checkpoint.pt), × params = per trainable parameter.\n"
    )
    print(text)
    if md:
        Path(md).parent.mkdir(parents=True, exist_ok=True)
        Path(md).write_text(text)
    if js:
        Path(js).write_text(json.dumps(out_json, indent=1))
    return out_json


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("select")
    s.add_argument("results", nargs="+")
    s.add_argument("--config")
    s.add_argument("--md")
    s.add_argument("--seeds", type=int, nargs="+", default=[1])
    r = sub.add_parser("report")
    r.add_argument("results", nargs="+")
    r.add_argument("--md")
    r.add_argument("--json")
    r.add_argument("--tuning", nargs="+", help="the tuning results: its seed-0 run at each chosen lr joins the table")
    a = ap.parse_args(argv)
    if a.cmd == "select":
        select(a.results, a.config, a.md, a.seeds)
    else:
        report(a.results, a.md, a.json, a.tuning)


if __name__ == "__main__":
    main()
