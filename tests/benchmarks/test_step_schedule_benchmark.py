"""benchmarks/step_schedule.py's table rows (the timed runs and the protocol's split are exercised by hand: see
benchmarks/README.md)."""

from __future__ import annotations

import torch

from benchmarks.step_schedule import schedule_rows
from lightning_fedmeta.loop.schedule import StepCost


def test_rows_count_sequential_and_computed_steps_for_every_schedule() -> None:
    steps = torch.tensor([641, 6, 300, 299, 120, 40])
    rows = {r["schedule"]: r for r in schedule_rows(steps, None, {"flops": StepCost(0.0, 1.0),
                                                                  "launches": StepCost(1000.0, 1.0)})}
    real = int(steps.sum())
    assert rows["lockstep"]["sequential"] == 641 and rows["lockstep"]["computed"] == 6 * 641
    assert rows["compacted"]["sequential"] == 641 and rows["compacted"]["computed"] == real
    assert rows["grouped"]["computed"] < 1.1 * real and rows["grouped"]["groups"] == 5  # 300 and 299 share a group
    assert rows["auto (flops)"]["computed"] == real  # no padding is worth a call when calls are free
    assert rows["auto (launches)"]["groups"] == 1 and rows["auto (launches)"]["sequential"] == 641
    assert all(r["real"] == real for r in rows.values())
