"""DP that holds against someone who reads the config (issue 25, items 2, 10, 11, 12).

The attacker of item 2 knows ``model.seed`` (every checkpoint, ``hparams.yaml`` and ``config.yaml`` holds it), so
with seeded noise they regenerate it and subtract it from the published update; ``secure_mode`` must defeat that,
and the cohort must be as secret as the noise. A warm start must continue ε and never redraw noise (item 10);
clipping must hold its bound in bfloat16 (item 11); Poisson sampling must be the sampling the accountant assumes
(item 12).
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_fedmeta import FederatedModule
from lightning_fedmeta.client.sampling import sample_clients
from lightning_fedmeta.loop.federation import Federation
from lightning_fedmeta.privacy.budget import SEEDED_NOISE_NOTE
from lightning_fedmeta.privacy.draws import KEY_BYTES, SecretDraws, SeededDraws, secret_normal, secret_uniform
from lightning_fedmeta.privacy.mechanism import DPSpec, PrivacyAccountant, clip_rows, noise_multipliers, parse_dp
from lightning_fedmeta.reliability.options import Reliability
from tests.helpers import fit, make_trainer, tiny_data, tiny_datamodule, tiny_module

pytest.importorskip("opacus.accountants")

FEDAVG = {"name": "fedavg", "local_lr": 0.3, "local_steps": 2, "batch_size": 4}
SEED = 7


def _dp_module(secure: bool, noise: float = 1.0, clients_per_round: int = 6, **dp: Any) -> FederatedModule:
    spec = {"clip": 0.5, "noise_multiplier": noise, "secure_mode": secure, **dp}
    return tiny_module(FEDAVG, clients_per_round=clients_per_round, seed=SEED, aggregation="uniform", dp=spec,
                       server_lr=1.0, compile_clients=False)


def _one_round_delta(module: FederatedModule) -> dict[str, torch.Tensor]:
    before = {k: v.detach().clone() for k, v in module.model.named_parameters()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fit(module, tiny_datamodule(eval_every=100), 1)
    return {k: v.detach() - before[k] for k, v in module.model.named_parameters()}


def _attack(published: dict[str, torch.Tensor], clip: float, cohort: int) -> dict[str, torch.Tensor]:
    """What a reader of the seed recovers: the published update minus the noise regenerated from the seed."""
    sigma, _ = noise_multipliers(DPSpec(clip=clip), cohort)
    noise = SeededDraws(SEED).noise_tree(published, sigma * clip / cohort, "dp-noise", 0)
    return {k: v - noise[k] for k, v in published.items()}


def _fit_saving(module: FederatedModule, folder: Any, rounds: int) -> Any:
    """``rounds`` rounds with a checkpoint at the last one, quietly; returns that checkpoint's path."""
    saver = ModelCheckpoint(dirpath=folder, every_n_train_steps=rounds, save_top_k=-1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        make_trainer(rounds, callbacks=[saver], enable_checkpointing=True).fit(module, tiny_datamodule(eval_every=100))
    return next(folder.glob("*.ckpt"))


def _distance(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return float(torch.cat([(a[k] - b[k]).reshape(-1) for k in a]).norm())


# ----------------------------------------------------------------------------------------------
# item 2: the noise and the cohort are secret under secure_mode
# ----------------------------------------------------------------------------------------------
def test_a_reader_of_the_seed_recovers_the_clipped_mean_unless_secure_mode_is_on() -> None:
    """Every client takes part (the cohort is the same in all three runs): the noiseless run gives the exact
    clipped mean; subtracting the seed's noise from the seeded run recovers it to float rounding, and from the
    secure run it leaves an error of the noise's size (σC/m·√d ≈ 0.08·√18)."""
    clipped_mean = _one_round_delta(_dp_module(secure=False, noise=0.0))
    seeded = _one_round_delta(_dp_module(secure=False))
    secure = _one_round_delta(_dp_module(secure=True))
    assert _distance(_attack(seeded, 0.5, 6), clipped_mean) < 1e-5  # the attack of the review works by default
    noise_size = 1.0 * 0.5 / 6 * math.sqrt(18)
    assert _distance(_attack(secure, 0.5, 6), clipped_mean) > 0.5 * noise_size  # and fails under secure_mode


def test_secure_cohorts_are_not_those_of_the_seed_and_agree_for_one_key() -> None:
    def federation(secure_key: bytes | None) -> Federation:
        reliability = Reliability.from_options(dp={"clip": 1.0, "secure_mode": secure_key is not None})
        fed = Federation(SEED, 5, None, 0, "uniform", reliability)
        fed.counts, fed.eligible = torch.ones(40), torch.arange(40)
        fed.num_sampled, fed.num_candidates = 5, 5
        fed.cohort_draws = None if secure_key is None else SecretDraws(secure_key)
        return fed

    key = bytes(range(KEY_BYTES))
    seeded = [federation(None).round_clients(r) for r in range(20)]
    assert all(torch.equal(s, sample_clients(SEED, r, torch.arange(40), 5)) for r, s in enumerate(seeded))
    secret = [federation(key).round_clients(r) for r in range(20)]
    again = [federation(key).round_clients(r) for r in range(20)]  # another rank with the broadcast key
    other = [federation(bytes(KEY_BYTES)).round_clients(r) for r in range(20)]
    assert all(torch.equal(a, b) for a, b in zip(secret, again, strict=True))
    assert sum(torch.equal(a, b) for a, b in zip(secret, seeded, strict=True)) <= 1
    assert sum(torch.equal(a, b) for a, b in zip(secret, other, strict=True)) <= 1
    assert all(s.numel() == 5 and s.unique().numel() == 5 for s in secret)


def test_secret_normals_are_standard_normal_and_independent_of_torch_seeds() -> None:
    key = bytes(range(KEY_BYTES))
    torch.manual_seed(0)
    z = secret_normal(key, 200_000, "dp-noise", 3)
    torch.manual_seed(1)
    assert torch.equal(z, secret_normal(key, 200_000, "dp-noise", 3))  # the key decides, not torch's state
    assert abs(float(z.mean())) < 0.01 and abs(float(z.std()) - 1) < 0.01
    ordered = z.sort().values
    cdf = 0.5 * (1 + torch.erf(ordered / math.sqrt(2)))
    ks = float((cdf - torch.arange(1, z.numel() + 1, dtype=torch.float64) / z.numel()).abs().max())
    assert ks < 0.005  # Kolmogorov–Smirnov distance; 1.36/√n ≈ 0.003 at the 5 % level
    assert not torch.equal(z, secret_normal(key, 200_000, "dp-noise", 4))
    u = secret_uniform(key, 100_000, "clients", 0)
    assert float(u.min()) > 0 and float(u.max()) < 1 and abs(float(u.mean()) - 0.5) < 0.005


def test_the_secret_key_is_in_no_checkpoint(tmp_path: Any) -> None:
    module = _dp_module(secure=True, clients_per_round=3)
    _fit_saving(module, tmp_path, 2)
    key = module.engine.draws._key  # type: ignore[union-attr]
    assert len(key) == KEY_BYTES and "secret" in repr(module.engine.draws)
    files = list(tmp_path.glob("*.ckpt"))
    assert files and all(key not in f.read_bytes() for f in files)


def test_without_secure_mode_every_reported_epsilon_carries_the_warning(caplog: Any) -> None:
    module = _dp_module(secure=False, clients_per_round=3)
    with pytest.warns(UserWarning, match="secure_mode is off"), caplog.at_level("INFO"):
        fit(module, tiny_datamodule(eval_every=100), 2)
    line = [r.getMessage() for r in caplog.records if "privacy: ε" in r.getMessage()]
    assert line and SEEDED_NOISE_NOTE in line[-1]
    secure = _dp_module(secure=True, clients_per_round=3)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no warning about the seed under secure_mode
        warnings.filterwarnings("ignore", message="(?!.*secure_mode)")
        fit(secure, tiny_datamodule(eval_every=100), 2)


# ----------------------------------------------------------------------------------------------
# item 10: a warm start continues ε and never reuses noise
# ----------------------------------------------------------------------------------------------
def test_a_warm_start_continues_epsilon_and_the_release_count(tmp_path: Any) -> None:
    path = _fit_saving(_dp_module(secure=False, clients_per_round=3), tmp_path, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        warm = FederatedModule.load_from_checkpoint(path, model=torch.nn.Linear(5, 3))
        fit(warm, tiny_datamodule(eval_every=100), 4)
    uninterrupted = PrivacyAccountant(1.0, 3 / 6)
    uninterrupted.step(8)
    assert warm.engine.federation.round_offset == 4  # its round r is release 4 + r: no noise drawn twice
    assert warm.epsilon_spent(4) == pytest.approx(uninterrupted.epsilon(1e-5), rel=1e-12)
    assert warm.privacy_record() == {"history": [[1.0, 0.5, 8]], "released": 8}


def test_a_resumed_fit_accounts_its_rounds_once(tmp_path: Any) -> None:
    path = _fit_saving(_dp_module(secure=False, clients_per_round=3), tmp_path, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        resumed = _dp_module(secure=False, clients_per_round=3)
        fit(resumed, tiny_datamodule(eval_every=100), 5, ckpt_path=str(path))
    assert resumed.engine.federation.round_offset == 0
    assert resumed.privacy_record() == {"history": [[1.0, 0.5, 5]], "released": 5}


# ----------------------------------------------------------------------------------------------
# item 11: clipping holds its bound in half precision
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_clipped_half_precision_rows_stay_inside_the_ball(dtype: torch.dtype) -> None:
    rows = (torch.randn(64, 1000, generator=torch.Generator().manual_seed(0)) * 3).to(dtype)
    clipped, norms = clip_rows(rows, 1.0)
    assert float(torch.linalg.vector_norm(clipped.double(), dim=1).max()) <= 1.0 + 1e-6
    assert norms.dtype == torch.float32 and float(norms.min()) > 1.0


# ----------------------------------------------------------------------------------------------
# item 12: Poisson sampling, the accountant's assumption
# ----------------------------------------------------------------------------------------------
def test_poisson_sampling_includes_each_client_independently_with_probability_q() -> None:
    reliability = Reliability.from_options(dp={"clip": 1.0, "sampling": "poisson"})
    fed = Federation(SEED, 10, None, 0, "uniform", reliability)
    fed.counts, fed.eligible = torch.ones(50), torch.arange(50)
    fed.num_sampled, fed.num_candidates = 10, 10
    rounds = 2000
    inclusion = torch.zeros(rounds, 50)
    for r in range(rounds):
        inclusion[r, fed.round_clients(r)] = 1
    q = 10 / 50
    sizes = inclusion.sum(1)
    assert abs(float(sizes.mean()) - 10) < 0.3  # E|S| = qN
    assert abs(float(sizes.var()) - 50 * q * (1 - q)) < 1.2  # Var|S| = Nq(1 − q): not a fixed-size cohort
    assert float((inclusion.mean(0) - q).abs().max()) < 0.04
    pair = float((inclusion[:, 0] * inclusion[:, 1]).mean())
    assert abs(pair - q * q) < 0.015  # independent: P(0 and 1) = q²
    assert fed.expected_answers() == 10


def test_poisson_sampling_trains_and_refuses_over_selection() -> None:
    module = _dp_module(secure=False, clients_per_round=3, sampling="poisson")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fit(module, tiny_datamodule(eval_every=100), 4)
    assert module.epsilon_spent(4) > 0
    with pytest.raises(ValueError, match="over_selection"):
        Reliability.from_options(dp={"sampling": "poisson"}, over_selection=0.5).check(
            module.algorithm, num_clients=6, num_sampled=3, aggregation="uniform", task="classification")
    with pytest.raises(ValueError, match=r"model\.dp\.sampling must be one of"):
        parse_dp({"sampling": "shuffle"})


def test_an_empty_poisson_cohort_still_releases_the_noise() -> None:
    """With m = 1 of 6 clients some rounds sample nobody; the mechanism's output is then the noise alone (skipping
    the round would publish 'nobody was sampled', which the accountant does not cover)."""
    module = _dp_module(secure=False, clients_per_round=1, sampling="poisson")
    module.attach_data(tiny_data())
    empty = next(r for r in range(100) if module.engine.federation.round_clients(r).numel() == 0)
    before = torch.cat([p.detach().reshape(-1).clone() for p in module.model.parameters()])
    optimizer = torch.optim.SGD(module.model.parameters(), lr=1.0)
    report = module.engine.run_round(empty, optimizer, clip=torch.tensor(0.5, dtype=torch.float64))
    moved = torch.cat([p.detach().reshape(-1) for p in module.model.parameters()]) - before
    assert report.skipped is None and report.privacy is not None and report.clients.numel() == 0
    expected = SeededDraws(SEED).noise_tree({k: torch.zeros_like(v) for k, v in module.model.named_parameters()},
                                            1.0 * 0.5 / 1, "dp-noise", empty)
    torch.testing.assert_close(moved, torch.cat([v.reshape(-1) for v in expected.values()]))
