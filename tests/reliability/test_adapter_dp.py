"""Client-level DP on LoRA adapter updates (issue 40; docs/reliability.md "Differential privacy", docs/communication.md
"LoRA adapters"): under fedavg on a LoRA'd TinyTransformer, plain and FFA-LoRA (``freeze_a=True``), the clipping
norm is the L2 norm over the trainable (adapter) tensors, the noise is adapter-shaped, the frozen base is
bit-identical after DP rounds (with upload compression too), and the privacy accounting does not depend on the
frozen base. FedSA-LoRA refuses DP with a message that says why."""

from __future__ import annotations

import math
import warnings
from typing import Any

import pytest
import torch
from torch import nn

from lightning_fedmeta import FederatedModule
from lightning_fedmeta.client.sampling import generator_for
from lightning_fedmeta.data import FederatedDataModule
from lightning_fedmeta.data.synthetic_tasks import make_synthetic_next_token
from lightning_fedmeta.models.lora import add_lora
from lightning_fedmeta.models.reference import TinyTransformer
from lightning_fedmeta.privacy.mechanism import DPSpec, clip_rows, gaussian_noise, noise_multipliers
from lightning_fedmeta.testing import _AsDataset
from tests.helpers import make_trainer

VOCAB, T = 8, 6
SEED, COHORT, CLIENTS = 4, 3, 7
NOISE = 0.8


def lora_lm(freeze_a: bool = False) -> nn.Module:
    torch.manual_seed(0)
    return add_lora(base_lm(), ["qkv", "proj", "head"], rank=2, alpha=4.0, freeze_a=freeze_a)


def base_lm() -> nn.Module:
    torch.manual_seed(0)
    return TinyTransformer(VOCAB, d_model=16, nhead=2, num_layers=1, max_len=T)


@pytest.fixture(scope="module")
def data() -> Any:
    return make_synthetic_next_token(num_clients=CLIENTS, vocab_size=VOCAB, seq_len=T, seed=0)


@pytest.fixture(autouse=True)
def _quiet() -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def module_of(model: nn.Module, dp: dict[str, Any] | None, algorithm: str = "fedavg",
              **options: Any) -> FederatedModule:
    return FederatedModule(model=model, algorithm={"name": algorithm, "local_steps": 2, "local_lr": 0.3},
                           clients_per_round=COHORT, seed=SEED, aggregation="uniform", compile_clients=False, dp=dp,
                           **options)


def split(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """``(trainable, frozen)`` parameters, cloned."""
    named = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    return {n: v for n, v in named.items() if n in trainable}, {n: v for n, v in named.items() if n not in trainable}


@pytest.mark.parametrize("freeze_a", [False, True], ids=["lora", "ffa_lora"])
def test_dp_clips_the_adapter_update_and_adds_adapter_shaped_noise(freeze_a: bool, data: Any) -> None:
    """Round 0 by hand: the clients' raw adapter updates, their L2 norms over the trainable tensors, clipped to C,
    averaged with weights 1/m, plus ``σ_Δ·C/m`` times noise drawn in the order of the adapter tensors."""
    dp = {"clip": 1.0, "noise_multiplier": NOISE, "adaptive_clip": False}
    module = module_of(lora_lm(freeze_a), dp)
    module.attach_data(data)
    trainable, _ = split(module.model)
    result = module.engine.compute(0)
    assert result is not None
    raw = result.output.delta
    assert list(raw) == list(trainable)  # the update is the adapters, in the model's order; no base tensor
    rows = torch.cat([raw[k].reshape(COHORT, -1) for k in raw], 1)
    assert rows.shape[1] == sum(v.numel() for v in trainable.values())
    norms = rows.norm(dim=1)
    clip = float(norms.median())  # one client above the clip, one below: both paths
    clipped, _ = clip_rows(rows, clip)
    uploads = module.engine.combine(result, clip=clip)
    assert uploads is not None and uploads.update is not None and uploads.norms is not None
    torch.testing.assert_close(uploads.norms, norms, rtol=1e-6, atol=0)
    sigma, _ = noise_multipliers(DPSpec(clip=clip, noise_multiplier=NOISE), COHORT)
    generator = generator_for(SEED, "dp-noise", 0)
    mean, start, expected = clipped.sum(0) / COHORT, 0, {}
    for k, v in raw.items():
        size = v[0].numel()
        part = mean[start:start + size].reshape(v.shape[1:])
        expected[k] = part + gaussian_noise(part, sigma * clip / COHORT, generator)
        start += size
    delta = uploads.update.delta
    assert {k: tuple(v.shape) for k, v in delta.items()} == {k: tuple(v.shape) for k, v in trainable.items()}
    for k in trainable:
        torch.testing.assert_close(delta[k], expected[k], rtol=1e-5, atol=1e-6)
    assert uploads.privacy is not None and 0 < uploads.privacy.clipped_fraction < 1


@pytest.mark.parametrize("compression", [None, {"upload": "topk", "fraction": 0.2}], ids=["plain", "topk"])
@pytest.mark.parametrize("freeze_a", [False, True], ids=["lora", "ffa_lora"])
def test_the_base_is_bit_identical_after_dp_rounds(freeze_a: bool, compression: Any, data: Any) -> None:
    dp = {"clip": 0.5, "noise_multiplier": NOISE, "delta": 1e-3}
    module = module_of(lora_lm(freeze_a), dp, compression=compression)
    trainable, frozen = split(module.model)
    make_trainer(3).fit(module, FederatedDataModule(dataset=_AsDataset(data), eval_every=100))
    after = dict(module.model.named_parameters())
    for n, v in frozen.items():
        assert torch.equal(after[n], v), f"the frozen {n} changed in a DP round"
    assert all(not torch.equal(after[n], v) for n, v in trainable.items())  # every adapter got its noise
    assert math.isfinite(module.epsilon_spent(3))


def test_the_privacy_accounting_does_not_depend_on_the_frozen_base(data: Any) -> None:
    """ε after r rounds is a function of (σ, q = m/K, r, δ): the LoRA'd model, FFA-LoRA and the same base trained
    in full spend the same budget, bit for bit, and it is Opacus's RDP accountant's."""
    accountants = pytest.importorskip("opacus.accountants")
    dp = {"clip": 1.0, "noise_multiplier": 1.1, "delta": 1e-4}
    spent = []
    for model in (lora_lm(), lora_lm(freeze_a=True), base_lm()):
        module = module_of(model, dp)
        module.attach_data(data)
        spent.append([module.epsilon_spent(r) for r in (1, 5, 20)])
    assert spent[0] == spent[1] == spent[2]
    for r, eps in zip((1, 5, 20), spent[0], strict=True):
        accountant = accountants.RDPAccountant()
        for _ in range(r):
            accountant.step(noise_multiplier=1.1, sample_rate=COHORT / CLIENTS)
        assert eps == pytest.approx(accountant.get_epsilon(1e-4), rel=1e-12)


def test_fedsa_lora_refuses_dp_and_says_why(data: Any) -> None:
    module = module_of(lora_lm(), {"clip": 1.0, "noise_multiplier": 1.0}, algorithm="fedsa_lora")
    with pytest.raises(ValueError, match=r"model\.dp act on uploads that are parameter deltas combined by a weighted "
                                         r"mean; fedsa_lora combines its uploads with its own aggregate.*Use an "
                                         r"algorithm with the default aggregate \(fedavg"):
        module.attach_data(data)
