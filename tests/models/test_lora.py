"""LoRA adapters (lightning_fedmeta.models.lora): the formula, the paper's initialisation, which parameters are
frozen, the refusals, and a LoRA'd model from a YAML config through the command line."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch import nn

from lightning_fedmeta.models import LoRALinear, LoRAModel, TinyTransformer, add_lora, lora_parameter_count
from tests.helpers import REPO


def test_lora_linear_is_the_base_plus_the_scaled_low_rank_update() -> None:
    torch.manual_seed(0)
    base = nn.Linear(5, 3)
    layer = LoRALinear(base, rank=2, alpha=6.0)
    x = torch.randn(4, 5)
    torch.testing.assert_close(layer(x), base(x), rtol=0, atol=0)  # B = 0: the adapted layer starts as the base
    with torch.no_grad():
        layer.lora_B.normal_()
    expected = x @ base.weight.T + base.bias + (6.0 / 2) * x @ layer.lora_A.T @ layer.lora_B.T
    torch.testing.assert_close(layer(x), expected)
    assert layer.scaling == 3.0


def test_lora_initialisation_follows_the_paper_a_kaiming_b_zero_base_frozen() -> None:
    torch.manual_seed(0)
    layer = LoRALinear(nn.Linear(400, 7), rank=8)
    assert torch.equal(layer.lora_B, torch.zeros(7, 8))
    bound = 1 / math.sqrt(400)  # kaiming_uniform_(a=√5): U(-1/√fan_in, 1/√fan_in), as nn.Linear's weight
    a = layer.lora_A.detach()
    assert float(a.abs().max()) <= bound and float(a.std()) > 0.5 * bound / math.sqrt(3)
    assert [n for n, p in layer.named_parameters() if p.requires_grad] == ["lora_A", "lora_B"]


def test_add_lora_adapts_the_targets_and_freezes_everything_else() -> None:
    model = add_lora(TinyTransformer(8, d_model=16, nhead=2, num_layers=2, max_len=6), ["qkv"], rank=2,
                     train_also=["ln.*"])
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable == ["blocks.0.attn.qkv.lora_A", "blocks.0.attn.qkv.lora_B", "blocks.1.attn.qkv.lora_A",
                         "blocks.1.attn.qkv.lora_B", "ln.weight", "ln.bias"]
    assert isinstance(model.blocks[1].attn.qkv, LoRALinear) and isinstance(model.blocks[1].attn.proj, nn.Linear)
    adapters = 2 * (2 * 16 + 48 * 2) + 2 * 16
    assert lora_parameter_count(model) == (adapters, sum(p.numel() for p in model.parameters()) - adapters)


def test_add_lora_without_targets_adapts_every_linear_layer_and_keeps_the_outputs() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    x = torch.randn(5, 3)
    before = model(x)
    add_lora(model, rank=1)
    assert all(isinstance(model[i], LoRALinear) for i in (0, 2))
    torch.testing.assert_close(model(x), before, rtol=0, atol=0)


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"targets": ["qvk"]}, r"targets \['qvk'\] match no nn.Linear"),
    ({"targets": ["qkv"], "train_also": ["lnx.*"]}, r"train_also \['lnx.\*'\] match no parameter"),
    ({"rank": 0}, "rank must be a positive integer"),
    ({"alpha": 0.0}, "alpha must be positive"),
])
def test_add_lora_refuses_bad_arguments_with_the_reason(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        add_lora(TinyTransformer(8, d_model=16, nhead=2, num_layers=1, max_len=6), **kwargs)


def test_add_lora_refuses_a_model_adapted_twice() -> None:
    model = add_lora(nn.Sequential(nn.Linear(3, 2)), rank=1)
    with pytest.raises(ValueError, match="applied twice"):
        add_lora(model)


def test_lora_model_loads_base_weights_before_adding_adapters(tmp_path: Path) -> None:
    torch.manual_seed(1)
    pretrained = TinyTransformer(8, d_model=16, nhead=2, num_layers=1, max_len=6)
    path = tmp_path / "base.pt"
    torch.save(pretrained.state_dict(), path)
    torch.manual_seed(2)
    wrapped = LoRAModel(TinyTransformer(8, d_model=16, nhead=2, num_layers=1, max_len=6), targets="proj",
                        rank=2, base_weights=str(path))
    x = torch.randint(0, 8, (3, 6))
    torch.testing.assert_close(wrapped(x), pretrained(x), rtol=0, atol=0)


def test_lora_config_runs_from_the_cli_training_the_adapters_only(tmp_path: Path) -> None:
    from lightning_fedmeta.cli import run

    cli = run(["fit", "--config", str(REPO / "configs" / "lora_next_token.yaml"), "--trainer.max_steps", "2",
               "--data.eval_every", "2", "--data.num_clients", "6", "--model.clients_per_round", "3",
               "--trainer.default_root_dir", str(tmp_path), "--trainer.enable_progress_bar", "false"])
    module = cli.model  # type: ignore[attr-defined]
    assert isinstance(module.model, LoRAModel)
    adapters = [n for n, p in module.model.named_parameters() if p.requires_grad]
    assert adapters and all(n.endswith(("lora_A", "lora_B")) for n in adapters)
    assert list(module.engine.global_params()) == adapters
    assert "val/acc_weighted" in cli.trainer.callback_metrics  # type: ignore[attr-defined]
