#!/usr/bin/env bash
# Independent vs banded vs BLT noise, DP-SGD, MNIST MLP, 1 epoch, batch 256, seed 0, ε ∈ {1, 8} (δ = 1e-5).
# Usage: DATA=/path/with/mnist.npz OUT=/tmp/dpmf-mnist bash docs/results/dpmf-mnist/run.sh
set -euo pipefail
DATA=${DATA:?directory holding mnist.npz}
OUT=${OUT:-/tmp/dpmf-mnist}
mkdir -p "$OUT"
for eps in 1 8; do
  for mech in independent banded:4 blt; do
    name="eps${eps}-${mech/:/}"
    start=$(date +%s)
    python -m dpopt train --dataset mnist --data-dir "$DATA" --method dp-sgd --epochs 1 --batch-size 256 \
      --target-epsilon "$eps" --noise-mechanism "$mech" --seed 0 --threads 1 --out "$OUT/$name" --overwrite \
      > "$OUT/$name.log" 2>&1
    echo "$name $(( $(date +%s) - start ))" >> "$OUT/wall.txt"
  done
done
