#!/usr/bin/env bash
# Issue 40: DP-MuonBC (dp-muon-bc) and AUTO-S (dp-sgd, clipping = "auto") in the MNIST fine-tuning study
# (docs/results/finetune-mnist). Resumable: every step skips what is finished (dpopt sweep skips the runs in its
# results file); rerun the script after an interruption. Repository root; mnist.npz in DATA_DIR (default data).
#   OMP_NUM_THREADS=1 nice -n 5 bash experiments/finetune-mnist/run-issue40.sh
set -euo pipefail
PY=${PYTHON:-python}
DATA_DIR=${DATA_DIR:-data}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
D=docs/results/finetune-mnist
[ -f runs/finetune-data/private/mnist.npz ] || $PY experiments/finetune-mnist/make_splits.py --data-dir "$DATA_DIR" --out runs/finetune-data
# the issue-21 public model (deterministic: seed 0 reproduces public_test_accuracy 0.99260557 of pretrain.json)
[ -f runs/finetune-mnist/public/model.pt ] || $PY experiments/finetune-mnist/pretrain.py --data-dir runs/finetune-data/public --out runs/finetune-mnist/public
$PY -m dpopt sweep experiments/finetune-mnist-tune-issue40.toml --jobs 1
cp runs/sweeps/finetune-mnist-tune-issue40/results.jsonl $D/results-tune-issue40.jsonl
$PY experiments/finetune-mnist/report.py select runs/sweeps/finetune-mnist-tune-issue40/results.jsonl \
    --config experiments/finetune-mnist-test-issue40.toml --md $D/tuning-issue40.md
$PY -m dpopt sweep experiments/finetune-mnist-test-issue40.toml --jobs 1
cp runs/sweeps/finetune-mnist-test-issue40/results.jsonl $D/results-test-issue40.jsonl
$PY -m dpopt check runs/sweeps/finetune-mnist-tune-issue40/runs/* runs/sweeps/finetune-mnist-test-issue40/runs/*
$PY experiments/finetune-mnist/report.py report runs/sweeps/finetune-mnist-test-issue40/results.jsonl \
    --tuning runs/sweeps/finetune-mnist-tune-issue40/results.jsonl --md $D/table-issue40.md --json $D/table-issue40.json
# LoRA r = 8 (run after the full start)
$PY -m dpopt sweep experiments/finetune-mnist-tune-issue40-lora.toml --jobs 1
cp runs/sweeps/finetune-mnist-tune-issue40-lora/results.jsonl $D/results-tune-issue40-lora.jsonl
$PY experiments/finetune-mnist/report.py select runs/sweeps/finetune-mnist-tune-issue40-lora/results.jsonl \
    --config experiments/finetune-mnist-test-issue40-lora.toml --md $D/tuning-issue40-lora.md
$PY -m dpopt sweep experiments/finetune-mnist-test-issue40-lora.toml --jobs 1
cp runs/sweeps/finetune-mnist-test-issue40-lora/results.jsonl $D/results-test-issue40-lora.jsonl
$PY -m dpopt check runs/sweeps/finetune-mnist-tune-issue40-lora/runs/* runs/sweeps/finetune-mnist-test-issue40-lora/runs/*
$PY experiments/finetune-mnist/report.py report runs/sweeps/finetune-mnist-test-issue40-lora/results.jsonl \
    --tuning runs/sweeps/finetune-mnist-tune-issue40-lora/results.jsonl \
    --md $D/table-issue40-lora.md --json $D/table-issue40-lora.json
# from scratch: AUTO-S only (run last)
$PY -m dpopt sweep experiments/finetune-mnist-tune-issue40-scratch.toml --jobs 1
cp runs/sweeps/finetune-mnist-tune-issue40-scratch/results.jsonl $D/results-tune-issue40-scratch.jsonl
$PY experiments/finetune-mnist/report.py select runs/sweeps/finetune-mnist-tune-issue40-scratch/results.jsonl \
    --config experiments/finetune-mnist-test-issue40-scratch.toml --md $D/tuning-issue40-scratch.md
$PY -m dpopt sweep experiments/finetune-mnist-test-issue40-scratch.toml --jobs 1
cp runs/sweeps/finetune-mnist-test-issue40-scratch/results.jsonl $D/results-test-issue40-scratch.jsonl
$PY -m dpopt check runs/sweeps/finetune-mnist-tune-issue40-scratch/runs/* runs/sweeps/finetune-mnist-test-issue40-scratch/runs/*
$PY experiments/finetune-mnist/report.py report runs/sweeps/finetune-mnist-test-issue40-scratch/results.jsonl \
    --tuning runs/sweeps/finetune-mnist-tune-issue40-scratch/results.jsonl \
    --md $D/table-issue40-scratch.md --json $D/table-issue40-scratch.json
