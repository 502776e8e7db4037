"""benchmarks/speed.py's convolutional rows (issue 29): a --quick smoke run of the CNN rows, the floor's FLOPs against
a count by hand for one convolution and one linear layer, and the round's FLOPs against the per-layer sum."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from benchmarks import speed
from benchmarks.gpu import quick_workloads


def _conv_fwd_flops(batch: int, c_in: int, c_out: int, k: int, side_out: int) -> int:
    """2 · B · C_out · C_in · k² · H_out · W_out: one multiply and one add per kernel tap and output element."""
    return 2 * batch * c_out * c_in * k * k * side_out * side_out


def test_layer_flops_match_the_hand_count() -> None:
    conv = nn.Conv2d(32, 64, 5)
    fwd = _conv_fwd_flops(10, 32, 64, 5, 8)  # 12×12 input, 5×5 kernel, no padding: 8×8 output
    inner = speed.LayerCall("conv2", conv, (10, 32, 12, 12), first=False)
    first = speed.LayerCall("conv1", conv, (10, 32, 12, 12), first=True)
    assert speed.layer_flops(inner) == 3 * fwd == 3 * 2 * 10 * 64 * 32 * 25 * 64  # forward, dW, dX
    assert speed.layer_flops(first) == 2 * fwd  # the model's input needs no gradient
    linear = speed.LayerCall("fc", nn.Linear(1024, 512), (10, 1024), first=False)
    assert speed.layer_flops(linear) == 3 * 2 * 10 * 1024 * 512


def test_layer_calls_find_every_conv_and_linear_of_the_cnn_in_order() -> None:
    work = quick_workloads()["CNN"]
    calls = speed.layer_calls(work.build(), work.shape, work.batch)
    assert [c.name for c in calls] == ["conv1.0", "conv2.0", "fc1.0", "fc"]
    assert [c.first for c in calls] == [True, False, False, False]
    assert calls[1].input_shape == (work.batch, 32, 12, 12) and calls[2].input_shape == (work.batch, 1024)


def test_floor_throughput_is_total_flops_over_total_median_time() -> None:
    work = quick_workloads()["CNN"]
    floor = speed.ConvFloor.of(work.build(), work.shape, work.batch)
    floor.flops = [4_000_000_000, 1_000_000_000, 0, 0]
    floor.seconds = [[1.0, 0.5, 0.0, 0.0], [3.0, 0.5, 0.0, 0.0], [2.0, 1.5, 0.0, 0.0]]  # medians 2.0 and 0.5
    assert floor.gflops() == pytest.approx(5.0 / 2.5)
    row = speed.CnnRow("CNN", 10, "FedAvg", project_s=3.0, loop_s=9.0, loop_clients=10, gflop=4.0,
                       floor_gflops=2.0)
    assert row.floor_s == 2.0 and row.over_floor == 1.5 and row.loop_over_project == 3.0


def test_round_flops_are_steps_times_clients_times_the_layer_sum() -> None:
    work = quick_workloads()["CNN"]
    floor = speed.ConvFloor.of(work.build(), work.shape, work.batch)
    data = speed.image_data(3, work.shape, work.classes, train=8)
    flops = speed.cnn_round_flops(dict(speed.CNN_ALGORITHMS)["FedAvg"], work, data, clients=3)
    assert flops == 3 * work.steps * sum(floor.flops)
    hf = speed.cnn_round_flops(dict(speed.CNN_ALGORITHMS)["Per-FedAvg HF"], work, data, clients=3)
    assert hf == 4 * flops  # four gradients per Per-FedAvg HF step


def test_quick_cnn_rows_run_and_merge_into_the_report(tmp_path) -> None:
    report = tmp_path / "speed_quick.md"
    report.write_text("# Speed on workload W\n\n| FedAvg | W row |\n")
    threads = torch.get_num_threads()
    try:
        assert speed.main(["--cnn", "--quick", "--cnn-workloads", "CNN", "--threads", "1", "--out", str(tmp_path)]) == 0
    finally:
        torch.set_num_threads(threads)
    text = report.read_text()
    assert text.startswith("# Speed on workload W") and "| FedAvg | W row |" in text  # the W rows are kept
    rows = [line for line in text.splitlines() if line.startswith("| CNN | 2 |")]
    assert [line.split(" | ")[2] for line in rows] == ["FedAvg", "Per-FedAvg HF", "Ditto"]
    for line in rows:
        ratios = [float(cell.strip("*× ")) for cell in line.strip("| ").split(" | ")[-2:]]
        assert all(math.isfinite(r) and r > 0 for r in ratios)
    assert "Load average" in text and "| **one client step** |" in text
    speed.merge_section(report, f"{speed.CNN_HEADING}: ResNet-18", ["| ResNet-18 | first |"])
    speed.merge_section(report, f"{speed.CNN_HEADING}: CNN", ["| CNN | rerun |"])
    text = report.read_text()  # a rerun replaces its own section and keeps the W rows and the other sections
    assert text.count(f"{speed.CNN_HEADING}: CNN\n") == 1 and "| CNN | 2 |" not in text
    assert "| CNN | rerun |" in text and "| FedAvg | W row |" in text and "| ResNet-18 | first |" in text


def test_resnet_rows_beyond_the_first_size_run_only_when_their_round_is_predicted_under_a_minute() -> None:
    rows = [speed.CnnRow("ResNet-18", 10, "FedAvg", project_s=5.0),
            speed.CnnRow("ResNet-18", 10, "Ditto", project_s=6.5),
            speed.CnnRow("CNN", 10, "Ditto", project_s=60.0)]
    assert speed._too_slow(rows, "ResNet-18", "FedAvg", 100) is None  # 50 s predicted
    assert "about 65 s" in speed._too_slow(rows, "ResNet-18", "Ditto", 100)
    assert speed._too_slow(rows, "ResNet-18", "FedAvg", 10) is None  # the first size always runs
    assert speed._too_slow(rows, "CNN", "Ditto", 100) is None  # the CNN rows always run
