"""benchmarks/lora.py and benchmarks/lora_accuracy.py, run in this process at their smallest sizes: the round of
every mode, the byte counts against the hand count, the plain-PyTorch loop against the engine's FedAvg, and the
reports (the timings and memory figures are the benchmark's, never asserted in a test)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from benchmarks import lora


@pytest.mark.parametrize("mode", lora.MODES)
def test_every_mode_measures_a_round_with_the_adapters_bytes(mode: str) -> None:
    row = lora.measure("tiny", 3, mode, "cpu", rounds=1)
    model = lora.build_model("tiny", adapters=True)
    adapter_bytes = 4 * sum(p.numel() for p in model.parameters() if p.requires_grad)
    full_bytes = 4 * sum(p.numel() for p in lora.build_model("tiny", adapters=False).parameters())
    assert row["adapter_parameters"] * 4 == adapter_bytes
    assert row["round_bytes"] == 2 * 3 * (full_bytes if mode == "batched_full" else adapter_bytes)
    assert row["seconds"] > 0 and row["peak_bytes"] >= 0


def test_the_plain_pytorch_loop_is_the_engines_fedavg_round(monkeypatch: pytest.MonkeyPatch) -> None:
    """The two sides of the comparison do the same work: one local step on all of a client's windows (so the
    engine's batch is the reference's, in another order: the mean loss does not depend on it), the clients'
    deltas averaged by their sizes, the server step 1 — the same adapters after the round."""
    monkeypatch.setattr(lora, "LOCAL_STEPS", 1)
    monkeypatch.setattr(lora, "LR", 0.5)
    ref_model, one_round = lora.torch_loop("tiny", 3, torch.device("cpu"))
    one_round()
    m = lora.engine_module("tiny", 3, "batched", torch.device("cpu"))
    assert m.data.train_counts.tolist() == [lora.SIZES["tiny"]["batch"]] * 3
    optimizer = torch.optim.SGD([p for p in m.model.parameters() if p.requires_grad], lr=1.0)
    m.engine.run_round(0, optimizer)
    ours = m.engine.global_params()
    theirs = {k: p for k, p in ref_model.named_parameters() if p.requires_grad}
    assert set(ours) == set(theirs) and all("lora_" in k for k in ours)
    start = lora.build_model("tiny", adapters=True)
    moved = max(float((theirs[k] - start.get_parameter(k)).detach().abs().max())
                for k in theirs)
    assert moved > 1e-4  # the round trained something
    for k in ours:
        torch.testing.assert_close(ours[k], theirs[k], rtol=1e-5, atol=1e-6)


def test_reports_render_and_a_rerun_resumes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def in_process(size: str, clients: int, mode: str, device: str, rounds: int, threads: int | None) -> dict:
        calls.append((clients, mode))
        return lora.measure(size, clients, mode, device, rounds)

    monkeypatch.setattr(lora, "_run_child", in_process)
    lora.main(["--quick", "--modes", "batched", "torch_loop", "--out", str(tmp_path)])
    assert calls == [(4, "batched"), (4, "torch_loop"), (8, "batched"), (8, "torch_loop")]
    lora.main(["--quick", "--modes", "batched", "torch_loop", "--out", str(tmp_path)])
    assert len(calls) == 4  # every cell was recorded: nothing re-run
    text = (tmp_path / "lora_quick.md").read_text()
    assert "| 8 | torch_loop |" in text and "naive copies" in text
    records = [json.loads(line) for line in (tmp_path / "lora_quick.jsonl").read_text().splitlines()]
    assert {r["key"] for r in records} == {f"tiny/cpu/{c}/{m}" for c in (4, 8) for m in ("batched", "torch_loop")}
