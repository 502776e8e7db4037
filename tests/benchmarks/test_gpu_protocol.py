"""benchmarks/gpu_protocol.py on the CPU: the quick run through the public API (CUDA parts skipped), PFLlib's rows
refused without a checkout, its dataset files in PFLlib's format, its output parsed, and an unknown
``step_schedule`` recorded instead of failing. The PFLlib run itself needs a checkout (``FEDMETA_PFLLIB``) and its
dependencies (scikit-learn, h5py); without them that test is skipped."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import numpy as np
import pytest

from benchmarks import gpu_protocol as gp
from lightning_fedmeta.data.datasets import DEFAULT_FASHION_MNIST_ROOT, has_dataset_files

pytestmark = pytest.mark.skipif(not has_dataset_files("fashion_mnist", DEFAULT_FASHION_MNIST_ROOT),
                                reason="Fashion-MNIST files not installed (dataset-fashion-mnist)")
PFLLIB = os.environ.get("FEDMETA_PFLLIB")


def test_the_headline_rows_come_first_then_gpu_py_then_the_other_algorithms() -> None:
    rows = gp.plan(["FedAvg", "Ditto"], ["dir", "pat"], ["default", "lockstep"], ["W"])
    assert rows[:6] == [("ours", "FedAvg", "dir", "default"), ("ours", "FedAvg", "dir", "lockstep"),
                        ("pfllib", "FedAvg", "dir"), ("ours", "FedAvg", "pat", "default"),
                        ("ours", "FedAvg", "pat", "lockstep"), ("pfllib", "FedAvg", "pat")]
    assert rows[6] == ("gpu", "W") and rows[7] == ("ours", "Ditto", "dir", "default")


def test_pfllib_output_is_parsed_per_round_with_its_evaluation_timed_from_the_lines() -> None:
    log = ["-------------Round number: 0-------------", "Evaluate global model", "Averaged Test Accuracy: 0.1000",
           "Std Test AUC: 0.0100", "------------------------- time cost ------------------------- 5.0",
           "-------------Round number: 1-------------", "Evaluate global models", "Averaged Test Accuracy: 0.5000",
           "Std Test AUC: 0.0100", "Evaluate personalized models", "Averaged Test Accuracy: 0.6000",
           "Std Test AUC: 0.0100", "------------------------- time cost ------------------------- 4.0",
           "-------------Round number: 2-------------", "Evaluate global model"]  # cut by a time limit
    times = [0.0, 0.1, 0.5, 1.1, 5.0, 5.0, 5.1, 5.5, 5.6, 5.6, 6.0, 6.6, 9.0, 9.0, 9.1]
    parsed = gp.parse_pfllib(list(zip(times, log, strict=True)))["rounds"]
    assert [r["round"] for r in parsed] == [0, 1]  # round 2 never finished
    assert parsed[1]["acc"] == 0.6 and parsed[1]["round_s"] == 4.0  # Ditto: the personalised models' accuracy
    assert parsed[1]["eval_s"] == pytest.approx(1.5) and parsed[1]["train_s"] == pytest.approx(2.5)


def test_the_split_is_written_in_pfllibs_npz_format(tmp_path: Path) -> None:
    dm = gp.build_datamodule(gp.protocol_config("FedAvg", "dir", 1, quick=True), None)
    info = gp.write_pfllib_dataset(dm, tmp_path, "FMNIST_fedmeta_dir")
    assert info["clients"] == 4
    for i in range(4):
        for split, (x, y) in (("train", dm.federated_data.client_train(i)), ("test", dm.federated_data.client_test(i))):
            with open(tmp_path / "dataset" / "FMNIST_fedmeta_dir" / split / f"{i}.npz", "rb") as f:  # as PFLlib
                data = np.load(f, allow_pickle=True)["data"].tolist()
            assert data["x"].dtype == np.float32 and data["x"].shape == (len(x), 1, 28, 28)
            np.testing.assert_array_equal(data["x"], x.numpy())
            np.testing.assert_array_equal(data["y"], y.numpy())


@pytest.mark.spawns
def test_quick_cpu_run_writes_rows_refuses_pfllib_without_a_checkout_and_records_an_unknown_schedule(
        tmp_path: Path) -> None:
    res = gp.main(["--device", "cpu", "--quick", "--out", str(tmp_path), "--algorithms", "FedAvg", "--splits",
                   "dir", "--schedules", "default", "no-such-schedule", "--gpu-workloads", "W"])
    ours, odd, pfllib = res["protocol"]
    assert ours["code"] == "ours" and ours["round_s"] == pytest.approx(ours["train_s"] + ours["eval_s"])
    assert ours["timed_rounds"] == 1 and len(ours["acc"]) == 2 and all(0 <= a <= 1 for a in ours["acc"])
    assert "peak_memory_gib" not in ours  # a CUDA-only number, skipped on the CPU
    assert odd["schedule"] == "no-such-schedule" and "step_schedule" in odd["unsupported"]
    assert pfllib["refused"] == "no --pfllib PATH given"
    (w,) = res["gpu"]
    assert w["workload"] == "W" and w["project"]["s_per_round"] > 0
    saved = json.loads((tmp_path / "gpu_protocol.json").read_text())
    assert saved["protocol"][2]["refused"] and "PFLlib rows refused" in saved["notes"][0]
    report = (tmp_path / "gpu_protocol.md").read_text()
    assert "| FedAvg | dir | ours | default |" in report and "no --pfllib PATH given" in report
    assert "| W | 2 |" in report


@pytest.mark.spawns
@pytest.mark.skipif(PFLLIB is None or importlib.util.find_spec("sklearn") is None
                    or importlib.util.find_spec("h5py") is None,
                    reason="needs FEDMETA_PFLLIB=<a PFLlib checkout> and PFLlib's dependencies (scikit-learn, h5py)")
def test_pfllib_runs_unmodified_on_the_same_clients(tmp_path: Path) -> None:
    res = gp.main(["--device", "cpu", "--quick", "--out", str(tmp_path / "out"), "--work", str(tmp_path / "work"),
                   "--pfllib", str(PFLLIB), "--algorithms", "FedAvg", "--splits", "dir", "--gpu-workloads"])
    ours, pfllib = res["protocol"]
    assert "error" not in pfllib, pfllib.get("error")
    assert pfllib["dataset"]["clients"] == 4 and pfllib["timed_rounds"] == 2 and len(pfllib["acc"]) == 2
    assert pfllib["round_s"] > 0 and 0 <= pfllib["acc"][0] <= 1
