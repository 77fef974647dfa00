"""Issue 42: ``summary.json``'s ``wall_seconds`` of a resumed run is the total over all its segments."""

import json
import os
import signal
import time
import warnings

import torch

from dpopt.training import TrainConfig, resume, train

PAUSE = 0.5  # seconds slept per step of the first segment: a lower bound on its wall time, never a timing race


def test_wall_seconds_counts_every_segment(tmp_path):
    warnings.simplefilter("ignore", UserWarning)
    cfg = TrainConfig(
        out=str(tmp_path / "run"), method="dp-sgd", epochs=1.0, seed=2, accountant="rdp", checkpoint_every=3
    )

    def slow_then_interrupt(info):
        time.sleep(PAUSE)
        if info["step"] == 9:
            os.kill(os.getpid(), signal.SIGINT)

    part = train(cfg, on_step=slow_then_interrupt)
    assert part["status"] == "interrupted" and part["steps"] == 9
    first = part["wall_seconds"]
    assert first >= 9 * PAUSE
    saved = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=False)["loop"]["wall_seconds"]
    assert 9 * PAUSE <= saved <= first  # the checkpoint stores the time so far (was 0.0)
    seen = []
    done = resume(tmp_path / "run", on_step=lambda info: (seen.append(info["step"]), time.sleep(PAUSE)))
    assert done["status"] == "completed" and done["steps"] == 9 + len(seen) and seen
    # both segments: the first as checkpointed, the second at least its sleeps (the last segment alone was reported)
    assert done["wall_seconds"] >= saved + len(seen) * PAUSE
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["wall_seconds"] == done["wall_seconds"]
