"""Client-level DP in the training loop (FederatedModule(dp=...), docs/reliability.md, "Differential privacy").

The aggregate is checked against its formula, Δ = Σ_i (1/m)·clip_C(Δ_i) + (σ_Δ·C/m)·ξ, recomputed by hand from
the clients' raw updates; the logged ε against Opacus; target_epsilon, resuming and the refusals end to end.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch import nn

from lightning_fedmeta import FederatedModule
from lightning_fedmeta.client.sampling import generator_for
from lightning_fedmeta.privacy.mechanism import DPSpec, adapt_clip, clip_rows, gaussian_noise, noise_multipliers
from tests.helpers import make_trainer, tiny_data, tiny_datamodule, tiny_module

opacus_accountants = pytest.importorskip("opacus.accountants")

FEDAVG = {"name": "fedavg", "local_lr": 0.3, "local_steps": 3, "batch_size": 4}
SEED, COHORT, CLIENTS = 4, 3, 6  # tiny data: 6 clients of 5 to 14 samples, 3 sampled per round


def _module(dp: dict[str, Any] | None, init_seed: int = 0, **kwargs: Any) -> FederatedModule:
    options: dict[str, Any] = {"clients_per_round": COHORT, "seed": SEED, "aggregation": "uniform",
                               "compile_clients": False}
    options.update(kwargs)
    return tiny_module(FEDAVG, init_seed=init_seed, dp=dp, **options)


def _params(module: FederatedModule) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.model.named_parameters()}


class _EpsilonLog(Callback):
    """The value of ``privacy/epsilon`` (and ``dp/clip``) each round logged (``dp/clip`` is logged on the rounds
    ``log_every_n_steps`` selects: trainers that read it log every round)."""

    def __init__(self) -> None:
        self.epsilon: list[float] = []
        self.clip: list[float] = []

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.epsilon.append(float(trainer.callback_metrics["privacy/epsilon"]))
        self.clip.append(float(trainer.callback_metrics["dp/clip"]))


def _opacus_epsilon(sigma: float, q: float, rounds: int, delta: float) -> float:
    accountant = opacus_accountants.RDPAccountant()
    for _ in range(rounds):
        accountant.step(noise_multiplier=sigma, sample_rate=q)
    return accountant.get_epsilon(delta)


def test_no_noise_and_no_clipping_is_the_non_private_run_bit_for_bit() -> None:
    plain = _module(None)
    make_trainer(6).fit(plain, tiny_datamodule(eval_every=3))
    private = _module({"clip": math.inf, "noise_multiplier": 0.0})
    log = _EpsilonLog()
    make_trainer(6, callbacks=[log]).fit(private, tiny_datamodule(eval_every=3))
    for k, v in _params(plain).items():
        assert torch.equal(_params(private)[k], v), k
    assert not torch.equal(_params(plain)["weight"], _module(None).model.weight)  # it trained
    assert log.epsilon == [math.inf] * 6  # no noise: no privacy


def test_the_aggregate_is_the_clipped_mean_plus_noise_and_the_clip_adapts() -> None:
    """Round 0 by hand: the sampled clients' raw updates (the same client code, without a Trainer), clipped,
    averaged with weights 1/m, plus σ_Δ·C/m times the round's noise; the next clip by Andrew et al.'s update."""
    dp = {"clip": 0.68, "noise_multiplier": 0.8, "adaptive_clip": {"count_noise_multiplier": 1.0}}
    spec = DPSpec(clip=0.68, noise_multiplier=0.8, adaptive=_adaptive_of(dp))
    reference = _module(dp)
    reference.attach_data(tiny_data())
    sampled, out, _ = reference.compute_round(0)
    names = list(out.delta)
    rows = torch.cat([out.delta[k].reshape(COHORT, -1) for k in names], 1)
    clipped, norms = clip_rows(rows, 0.68)
    assert bool((norms > 0.68).any()) and bool((norms <= 0.68).any())  # some clipped, some not: both paths tested
    mean = clipped.sum(0) / COHORT
    sigma_delta, _ = noise_multipliers(spec, COHORT)
    generator = generator_for(SEED, "dp-noise", 0)
    expected, start = {}, 0
    for k in names:
        size = out.delta[k][0].numel()
        v = mean[start:start + size].reshape(out.delta[k].shape[1:])
        expected[k] = v + gaussian_noise(v, sigma_delta * 0.68 / COHORT, generator)
        start += size
    xi = float(torch.randn((), generator=generator_for(SEED, "dp-clip", 0), dtype=torch.float64))
    next_clip = adapt_clip(0.68, norms, COHORT, spec, xi)
    assert next_clip != 0.68

    module = _module(dp)
    before = _params(module)
    log = _EpsilonLog()
    # server SGD(lr=1): w1 = w0 + Δ
    make_trainer(1, callbacks=[log], log_every_n_steps=1).fit(module, tiny_datamodule())
    for k in names:
        torch.testing.assert_close(_params(module)[k] - before[k], expected[k], rtol=1e-5, atol=1e-6)
    assert float(module.dp_clip) == pytest.approx(next_clip, rel=1e-12)
    assert log.clip == [pytest.approx(0.68, rel=1e-7)]  # the clip the round used is logged (float32)


def _adaptive_of(dp: dict[str, Any]) -> Any:
    from lightning_fedmeta.privacy.mechanism import parse_dp

    spec = parse_dp(dp)
    assert spec is not None
    return spec.adaptive


def test_one_clients_contribution_is_bounded_by_the_clip() -> None:
    """Replacing one sampled client's data by anything moves the noisy aggregate by at most 2C/m (its clipped
    update changes by at most 2C, the noise is the same draw); without DP the same change moves it 100×."""
    clip = 0.1
    probe = _module(None)
    probe.attach_data(tiny_data())
    first = int(probe.round_clients(0)[0])  # a client sampled in round 0

    def first_round(dp: dict[str, Any] | None, poisoned: bool) -> dict[str, torch.Tensor]:
        data = tiny_data()
        if poisoned:  # that client's training inputs blown up and its labels rotated
            start, end = int(data.train_offsets[first]), int(data.train_offsets[first + 1])
            data.train_x[start:end] *= 1000.0
            data.train_y[start:end] = (data.train_y[start:end] + 1) % 3
        module = _module(dp)
        module.attach_data(data)
        before = _params(module)
        result = module.engine.compute(0)
        assert result is not None and _params(module).keys() == before.keys()
        combined = module.engine.combine(result, clip=clip if dp is not None else math.inf)
        assert combined is not None and combined.update is not None
        return combined.update.delta

    def distance(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
        return float(torch.cat([(a[k] - b[k]).reshape(-1) for k in a]).norm())

    dp = {"clip": clip, "noise_multiplier": 1.0}
    moved = distance(first_round(dp, False), first_round(dp, True))
    assert 0 < moved <= 2 * clip / COHORT * (1 + 1e-5)
    unbounded = distance(first_round(None, False), first_round(None, True))
    assert unbounded > 100 * 2 * clip / COHORT


def test_logged_epsilon_is_opacus_after_every_round() -> None:
    module = _module({"clip": 1.0, "noise_multiplier": 1.3, "delta": 1e-4})
    log = _EpsilonLog()
    make_trainer(5, callbacks=[log]).fit(module, tiny_datamodule())
    q = COHORT / CLIENTS
    expected = [_opacus_epsilon(1.3, q, r, 1e-4) for r in range(1, 6)]
    assert log.epsilon == pytest.approx(expected, rel=1e-6)  # logged as float32
    assert module.epsilon_spent(5) == expected[-1]  # bit for bit in float64


def test_target_epsilon_stops_before_it_would_be_exceeded(caplog: pytest.LogCaptureFixture) -> None:
    q, sigma, delta = COHORT / CLIENTS, 2.0, 1e-5
    eps = [_opacus_epsilon(sigma, q, r, delta) for r in range(1, 9)]
    target = (eps[3] + eps[4]) / 2  # 4 rounds fit the budget, a fifth would exceed it
    caplog.set_level(logging.INFO)
    module = _module({"clip": 1.0, "noise_multiplier": sigma, "target_epsilon": target})
    log = _EpsilonLog()
    trainer = make_trainer(8, callbacks=[log])
    trainer.fit(module, tiny_datamodule(eval_every=8))
    assert trainer.global_step == 4
    assert log.epsilon == pytest.approx(eps[:4], rel=1e-6) and max(log.epsilon) <= target
    assert "stopping before round 4" in caplog.text and "model.dp.target_epsilon" in caplog.text
    # the stop falls between two evaluations (eval_every=8): the final model is evaluated all the same
    assert module.last_summary_round == 4 and "Personalized evaluation after round 4" in caplog.text


def test_resumed_adaptive_dp_run_is_bit_identical(tmp_path: Path) -> None:
    dp = {"clip": 0.2, "noise_multiplier": 0.9, "adaptive_clip": {"count_noise_multiplier": 1.0, "lr": 0.5}}
    straight = _module(dp)
    straight_log = _EpsilonLog()
    make_trainer(8, callbacks=[straight_log], log_every_n_steps=1).fit(straight, tiny_datamodule(eval_every=3))

    ckpt = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=4, save_top_k=-1, save_last=True)
    first = _module(dp)
    make_trainer(4, enable_checkpointing=True, callbacks=[ckpt]).fit(first, tiny_datamodule(eval_every=3))
    path = tmp_path / "last.ckpt"
    assert torch.load(path, weights_only=True)["global_step"] == 4

    resumed = _module(dp, init_seed=123)  # weights and clip must come from the checkpoint
    resumed_log = _EpsilonLog()
    trainer = make_trainer(8, callbacks=[resumed_log], log_every_n_steps=1)
    trainer.fit(resumed, tiny_datamodule(eval_every=3), ckpt_path=str(path))
    assert trainer.global_step == 8
    for k, v in _params(straight).items():
        assert torch.equal(_params(resumed)[k], v), k
    assert float(resumed.dp_clip) == float(straight.dp_clip)
    assert len(set(straight_log.clip)) > 2  # the clip really adapted
    assert resumed_log.clip == straight_log.clip[4:]
    assert resumed_log.epsilon == straight_log.epsilon[4:]
    assert resumed.epsilon_spent(8) == straight.epsilon_spent(8) == _opacus_epsilon(0.9, 0.5, 8, 1e-5)


@pytest.mark.parametrize("options,message", [
    ({"aggregation": "samples"}, r"model\.dp .*aggregation: uniform"),
    ({"aggregator": "median"}, r"model\.dp clips and averages the updates itself"),
    ({"algorithm": {"name": "scaffold", "local_lr": 0.1}}, r"model\.dp act on uploads"),
])
def test_refused_combinations(options: dict[str, Any], message: str) -> None:
    algorithm = options.pop("algorithm", FEDAVG)
    torch.manual_seed(0)
    base = {"clients_per_round": COHORT, "aggregation": "uniform", "dp": {"clip": 1.0}}
    base.update(options)
    module = FederatedModule(model=nn.Linear(5, 3), algorithm=algorithm, **base)
    with pytest.raises(ValueError, match=message):
        module.attach_data(tiny_data())
