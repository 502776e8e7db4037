"""``checkpoint["fedmeta"]`` holds one key per part; checkpoints in the flat layout of earlier releases still load
(frontends/checkpoint_layout.py). ``data/ditto_bn_topk_flat.ckpt`` was written by main c58bb23 (the flat layout;
data/make_flat_layout_checkpoint.py) and must resume to the same model as a run that was never interrupted."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lightning_fedmeta.frontends.checkpoint_layout import FLAT_KEYS, LAYOUT, PARTS, per_part_layout
from tests.checkpoints.data.make_flat_layout_checkpoint import module
from tests.helpers import make_trainer, tiny_datamodule

OLD = Path(__file__).parent / "data" / "ditto_bn_topk_flat.ckpt"


def test_the_committed_checkpoint_is_in_the_flat_layout() -> None:
    saved = torch.load(OLD, weights_only=True)["fedmeta"]
    assert "layout" not in saved and {"seen", "metric_state", "client_state", "algorithm"} <= set(saved)


def test_a_flat_checkpoint_written_by_the_old_release_resumes_like_a_run_never_interrupted(tmp_path: Path) -> None:
    straight = module()
    make_trainer(8).fit(straight, tiny_datamodule(eval_every=2))
    resumed = module()
    trainer = make_trainer(8)
    trainer.fit(resumed, tiny_datamodule(eval_every=2), ckpt_path=str(OLD))
    assert trainer.global_step == 8
    for key, value in straight.model.state_dict().items():  # BN running statistics included
        torch.testing.assert_close(resumed.model.state_dict()[key], value, rtol=1e-6, atol=1e-7, msg=key)
    for key, value in straight.client_states.tensors.items():  # Ditto's personal models
        torch.testing.assert_close(resumed.client_states.tensors[key], value, rtol=1e-6, atol=1e-7, msg=key)
    assert torch.equal(straight.seen, resumed.seen)
    # and saving again writes the per-part layout, every flat key under its part
    trainer.save_checkpoint(tmp_path / "again.ckpt")
    again = torch.load(tmp_path / "again.ckpt", weights_only=True)["fedmeta"]
    assert again["layout"] == LAYOUT and set(PARTS) <= set(again)
    old = torch.load(OLD, weights_only=True)["fedmeta"]
    for key in old:
        node = again
        for part in FLAT_KEYS[key]:
            assert part in node, f"{key}: {FLAT_KEYS[key]}"
            node = node[part]


def test_the_migration_moves_every_flat_key_and_leaves_the_new_layout_alone() -> None:
    old = torch.load(OLD, weights_only=True)["fedmeta"]
    nested = per_part_layout(old)
    assert nested["engine"]["federation"]["seen"] is old["seen"]
    assert nested["engine"]["compile"]["compile_decision"] is old["compile_decision"]
    assert nested["evaluator"]["metric_state"] is old["metric_state"]
    assert nested["record"]["algorithm"] is old["algorithm"]
    assert nested["run"]["data_spec"] is old["data_spec"]
    assert per_part_layout(nested) == nested


def test_unknown_keys_and_newer_layouts_are_refused_not_guessed() -> None:
    with pytest.raises(ValueError, match="no release of lightning_fedmeta wrote: \\['surprise'\\]"):
        per_part_layout({"seen": None, "surprise": 1})
    with pytest.raises(ValueError, match="written by a newer lightning_fedmeta"):
        per_part_layout({"layout": LAYOUT + 1})
    with pytest.raises(ValueError, match="must be an int"):
        per_part_layout({"layout": "2"})
    with pytest.raises(ValueError, match="are not mappings"):
        per_part_layout({"layout": LAYOUT, "engine": [1]})
