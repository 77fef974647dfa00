#!/usr/bin/env bash
# Issue 38, the whole study in order (repository root; cifar10.npz in $DATA, default data/). Resumable: every step
# skips what is done (the splits and models if their files exist; `dpopt sweep` skips finished runs).
#   OMP_NUM_THREADS=1 nice -n 5 bash experiments/finetune-vit/run_all.sh
set -euo pipefail
DATA=${DATA:-data}
PY=${PY:-python}
D=docs/results/finetune-vit
[ -f runs/finetune-vit-data/private/cifar10.npz ] ||
    $PY experiments/finetune-vit/prepare.py splits --data-dir "$DATA" --out runs/finetune-vit-data
[ -f runs/finetune-vit/vit-init/config.json ] || $PY experiments/finetune-vit/prepare.py init --out runs/finetune-vit/vit-init
[ -f runs/finetune-vit/public/model.pt ] ||
    $PY experiments/finetune-vit/prepare.py pretrain --data-dir runs/finetune-vit-data/public \
        --model-dir runs/finetune-vit/vit-init --out runs/finetune-vit/public --epochs 3
$PY -m dpopt sweep experiments/finetune-vit-tune.toml --jobs 1
$PY experiments/finetune-vit/report.py select runs/sweeps/finetune-vit-tune/results.jsonl \
    --config experiments/finetune-vit-test.toml --md $D/tuning.md
$PY -m dpopt sweep experiments/finetune-vit-test.toml --jobs 1
$PY -m dpopt sweep experiments/finetune-vit-seeds.toml --jobs 1  # seeds 3, 4 of three methods; the lr-tie check
# DP-Muon / DP-Muon-S again after the Muon routing fix (commit d97a7eb): their rows above are superseded
$PY -m dpopt sweep experiments/finetune-vit-muon-rerun-tune.toml --jobs 1
$PY experiments/finetune-vit/report.py select runs/sweeps/finetune-vit-tune/results.jsonl \
    --rerun-tuning runs/sweeps/finetune-vit-muon-rerun-tune/results.jsonl --seeds 1 2 3 4 \
    --config experiments/finetune-vit-muon-rerun-test.toml --md $D/tuning.md
$PY -m dpopt sweep experiments/finetune-vit-muon-rerun-test.toml --jobs 1
$PY -m dpopt check runs/sweeps/finetune-vit-*/runs/* --json > runs/finetune-vit/check.json
$PY experiments/finetune-vit/report.py check runs/finetune-vit/check.json --out $D/check.json
$PY experiments/finetune-vit/report.py report runs/sweeps/finetune-vit-test/results.jsonl runs/sweeps/finetune-vit-seeds/results.jsonl \
    --tuning runs/sweeps/finetune-vit-tune/results.jsonl --rerun runs/sweeps/finetune-vit-muon-rerun-test/results.jsonl \
    --rerun-tuning runs/sweeps/finetune-vit-muon-rerun-tune/results.jsonl --out $D
