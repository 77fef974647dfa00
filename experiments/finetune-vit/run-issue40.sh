#!/usr/bin/env bash
# Issue 40: DP-MuonBC (dp-muon-bc) and AUTO-S (dp-sgd, clipping = "auto") in the ViT fine-tuning study of issue 38
# (docs/results/finetune-vit), full fine-tune only, ε ∈ {1, 8}. Resumable: every step skips what is finished
# (`dpopt sweep` skips the runs in its results file); rerun the script after an interruption. Repository root;
# cifar10.npz in $DATA (default data/).
#   OMP_NUM_THREADS=1 nice -n 5 bash experiments/finetune-vit/run-issue40.sh
set -euo pipefail
DATA=${DATA:-data}
PY=${PY:-python}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
D=docs/results/finetune-vit
# the issue-38 splits and public model (deterministic; the same commands as run_all.sh)
[ -f runs/finetune-vit-data/private/cifar10.npz ] ||
    $PY experiments/finetune-vit/prepare.py splits --data-dir "$DATA" --out runs/finetune-vit-data
[ -f runs/finetune-vit/vit-init/config.json ] || $PY experiments/finetune-vit/prepare.py init --out runs/finetune-vit/vit-init
[ -f runs/finetune-vit/public/model.pt ] ||
    $PY experiments/finetune-vit/prepare.py pretrain --data-dir runs/finetune-vit-data/public \
        --model-dir runs/finetune-vit/vit-init --out runs/finetune-vit/public --epochs 3
$PY -m dpopt sweep experiments/finetune-vit-tune-issue40.toml --jobs 1
cp runs/sweeps/finetune-vit-tune-issue40/results.jsonl $D/results-tune-issue40.jsonl
$PY experiments/finetune-vit/report.py select runs/sweeps/finetune-vit-tune-issue40/results.jsonl --no-scratch \
    --config experiments/finetune-vit-test-issue40.toml --md $D/tuning-issue40.md
$PY -m dpopt sweep experiments/finetune-vit-test-issue40.toml --jobs 1
cp runs/sweeps/finetune-vit-test-issue40/results.jsonl $D/results-test-issue40.jsonl
$PY -m dpopt check runs/sweeps/finetune-vit-tune-issue40/runs/* runs/sweeps/finetune-vit-test-issue40/runs/* \
    --json > runs/finetune-vit/check-issue40.json
$PY experiments/finetune-vit/report.py check runs/finetune-vit/check-issue40.json --out $D/check-issue40.json
$PY experiments/finetune-vit/report.py report runs/sweeps/finetune-vit-test-issue40/results.jsonl \
    --tuning runs/sweeps/finetune-vit-tune-issue40/results.jsonl --out $D --suffix=-issue40
