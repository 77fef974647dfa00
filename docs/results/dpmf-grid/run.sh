#!/usr/bin/env bash
# The dpmf-grid runs, in the order they were run (resumable: a run with a summary.json is skipped).
# Usage: DATA=/path/with/mnist.npz RUNS=/tmp/dpmfgrid-runs bash docs/results/dpmf-grid/run.sh
set -euo pipefail
DATA=${DATA:?directory holding mnist.npz}
RUNS=${RUNS:-/tmp/dpmfgrid-runs}
here=$(dirname "$0")
# digits: the full factor grid, 5 seeds at the chosen lr (seed 0 tunes).
nice -n 5 python "$here/run.py" "$RUNS" --dataset digits --epochs 1,5 --seeds 5
# MNIST: 1 epoch only, 2 seeds; the optimizers in this order until the CPU budget ran out (README: dp-muon
# was not run).
for method in dp-sgd dp-adam dp-macadam; do
  nice -n 5 python "$here/run.py" "$RUNS" --dataset mnist --data-dir "$DATA" --epochs 1 --methods "$method"
done
nice -n 5 python "$here/diagnose_macadam.py" "$RUNS"
# amplified banded MF (added later, own directory): banded:4, cyclic Poisson at q = 0.2 (b' = 4), digits
AMP=${AMP:-/tmp/dpmfgrid-amp-runs}
for methods in dp-sgd,dp-adam dp-macadam,dp-muon; do
  nice -n 5 python "$here/run.py" "$AMP" --dataset digits --epochs 1,5 --methods "$methods" \
    --mechanisms banded:4@q0.2 --seeds 5
done
python "$here/summarize.py" "$RUNS" "$AMP" "$here"
python -m dpopt check "$RUNS"/*/ "$AMP"/*/
