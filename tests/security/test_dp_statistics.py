"""BatchNorm statistics under DP and robust rules (issue 25, item 3), and adaptive clipping under dropout (item 9).

The review scaled one client's inputs by 1000: the published ``running_mean`` moved by 22.6 and ``running_var`` by
6.6e4 while DP kept the parameters within 1e-7, and rows Krum rejected still entered the statistics.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import nn

from lightning_fedmeta import FederatedModule
from lightning_fedmeta.data.federated import from_client_tensors
from lightning_fedmeta.privacy.mechanism import AdaptiveClipSpec, DPSpec, adapt_clip
from tests.helpers import make_tiny_clients, tiny_data

FEDAVG = {"name": "fedavg", "local_lr": 0.1, "local_steps": 2, "batch_size": 4}


def _bn_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))


def _statistics(module: FederatedModule) -> torch.Tensor:
    own = dict(module.model.named_buffers())
    return torch.cat([own[k].reshape(-1).double() for k in sorted(own) if own[k].is_floating_point()])


def _one_round_with_an_outlier(**options: Any) -> tuple[FederatedModule, torch.Tensor, torch.Tensor]:
    """Client 0's inputs ×1000; one round of all six clients. Returns the module and its statistics before/after."""
    clients = make_tiny_clients(6)
    x, y, xt, yt = clients[0]
    clients[0] = (x * 1000, y, xt * 1000, yt)
    module = FederatedModule(model=_bn_model(), algorithm=FEDAVG, clients_per_round=6, seed=3, client_batching="loop",
                             compile_clients=False, **options)
    module.attach_data(from_client_tensors(clients, 3))
    before = _statistics(module)
    optimizer = torch.optim.SGD(module.model.parameters(), lr=1.0)
    clip = None if module.reliability.dp is None else torch.tensor(module.reliability.dp.clip, dtype=torch.float64)
    module.engine.run_round(0, optimizer, clip=clip)
    return module, before, _statistics(module)


def test_without_protection_one_client_moves_the_published_statistics() -> None:
    _, before, after = _one_round_with_an_outlier(aggregation="uniform")
    assert float((after - before).norm()) > 1e3  # the review's finding, reproduced (the mean of the statistics)


def test_dp_clips_and_noises_the_statistics_with_the_update() -> None:
    """With noise 0 the change of the statistics is Σ_i (1/m)·(clipped part of r_i), so its norm is at most C; the
    client rows' joint norms are what DP clipped (so the parameters' and statistics' change together are ≤ C)."""
    dp = {"clip": 0.5, "noise_multiplier": 0.0}
    module, before, after = _one_round_with_an_outlier(aggregation="uniform", dp=dp)
    assert float((after - before).norm()) <= 0.5 + 1e-6
    noisy, before_n, after_n = _one_round_with_an_outlier(aggregation="uniform", dp={**dp, "noise_multiplier": 1.0})
    change = after_n - before_n
    variances = [k for k in sorted(dict(noisy.model.named_buffers())) if k.endswith("running_var")]
    assert variances and float(dict(noisy.model.named_buffers())[variances[0]].min()) >= 0  # floored at 0
    assert float(change.norm()) < 5  # noise of std σC/m = 0.083 on 16 statistics, not the outlier's 1e4


def test_dp_local_statistics_are_never_published() -> None:
    module, before, after = _one_round_with_an_outlier(aggregation="uniform",
                                                       dp={"clip": 0.5, "noise_multiplier": 1.0, "batchnorm": "local"})
    assert torch.equal(before, after)
    own = module.engine.running.store.tensors  # each client keeps its own
    assert float(next(v for k, v in own.items() if k.endswith("running_var"))[0].max()) > 1e3


def test_a_robust_rule_applies_to_the_statistics_too() -> None:
    """The coordinate-wise median of six clients' statistics with one outlier lies within the honest clients'
    range: the outlier's statistics cannot drag the published ones."""
    module, _, after = _one_round_with_an_outlier(aggregation="uniform", aggregator="median")
    rows = module.engine.running.store.tensors
    own = dict(module.model.named_buffers())
    for name in (k for k in sorted(own) if own[k].is_floating_point()):
        honest = rows[name][1:].double()
        published = own[name].double()
        assert bool((published >= honest.min(0).values - 1e-5).all())
        assert bool((published <= honest.max(0).values + 1e-5).all())


def test_the_plain_mean_is_unchanged_without_protection() -> None:
    module = FederatedModule(model=_bn_model(), algorithm=FEDAVG, clients_per_round=6, seed=3, client_batching="loop",
                             compile_clients=False)
    module.attach_data(tiny_data())
    module.engine.run_round(0, torch.optim.SGD(module.model.parameters(), lr=1.0))
    rows, weights = module.engine.running.store.tensors, module.engine.federation.weights(torch.arange(6))
    own = dict(module.model.named_buffers())
    for name, stacked in rows.items():
        if stacked.is_floating_point():
            torch.testing.assert_close(own[name], (weights.reshape(-1, *[1] * (stacked.dim() - 1)) * stacked).sum(0))


# ----------------------------------------------------------------------------------------------
# item 9: adaptive clipping under dropout
# ----------------------------------------------------------------------------------------------
def test_the_count_has_sensitivity_one_half() -> None:
    """Adding one client moves b̄ by at most ½/m̂ (Theorem 1's (2σ_b)⁻² assumes it); the old count moved by 1/m."""
    spec = DPSpec(clip=1.0, noise_multiplier=0.5, adaptive=AdaptiveClipSpec(count_noise_multiplier=0.5, lr=1.0))
    norms = torch.tensor([0.5, 2.0, 0.7])
    base = math.log(adapt_clip(1.0, norms, 4, spec, 0.3, expected_answers=4.0))
    for extra in (0.1, 5.0):
        more = math.log(adapt_clip(1.0, torch.cat([norms, torch.tensor([extra])]), 4, spec, 0.3, expected_answers=4.0))
        assert abs(more - base) == pytest.approx(0.5 / 4)  # |Δ log C| = η·|Δb̄| = ½/m̂


@pytest.mark.parametrize("dropout", [0.0, 0.6])
def test_adaptive_clipping_settles_at_the_target_quantile_under_dropout(dropout: float) -> None:
    """γ = 0.7 with 60 % dropout (p ≥ 1 − γ): the clip must settle where 30 % of the answering clients' updates are
    clipped. Counting a missing client as clipped (the old rule) made C grow without bound."""
    dp = {"clip": 0.05, "noise_multiplier": 0.0,
          "adaptive_clip": {"target_quantile": 0.7, "lr": 0.2, "count_noise_multiplier": 0.0}}
    module = FederatedModule(model=nn.Linear(5, 3), algorithm=FEDAVG, clients_per_round=6, seed=5,
                             aggregation="uniform", client_dropout=dropout, dp=dp, compile_clients=False)
    module.attach_data(tiny_data(num_clients=12))
    optimizer = torch.optim.SGD(module.model.parameters(), lr=0.0)  # a fixed model: a fixed norm distribution
    clip = torch.tensor(0.05, dtype=torch.float64)
    clipped, answered = 0.0, 0
    for r in range(400):
        report = module.engine.run_round(r, optimizer, clip=clip)
        if r >= 200 and report.privacy is not None and report.clients.numel():
            clipped += report.privacy.clipped_fraction * report.clients.numel()
            answered += report.clients.numel()
    assert answered > 0 and float(clip) < 10
    assert clipped / answered == pytest.approx(0.3, abs=0.1)
