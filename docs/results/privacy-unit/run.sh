#!/usr/bin/env bash
# Record-level vs user-level DP at equal epsilon (4, delta 1e-5) on digits with synthetic Zipf users.
# Run from this directory: bash run.sh   (about 3 minutes on one CPU core)
set -euo pipefail
python make_users.py
for seed in 0 1 2; do
  dpopt train --dataset digits --target-epsilon 4 --batch-size 64 --epochs 10 --seed $seed \
    --out runs/record-s$seed --overwrite --json > /dev/null
  for k in 16 4; do
    dpopt train --dataset digits --target-epsilon 4 --batch-size 12 --epochs 10 --seed $seed \
      --user-ids zipf_users.txt --max-records-per-user $k --out runs/user-k$k-s$seed --overwrite --json > /dev/null
  done
done
python table.py > results.md
