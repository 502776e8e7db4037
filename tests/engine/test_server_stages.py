"""The server pipeline's stages against closed forms on a hand-made round (3 clients, unequal weights), and the
worked example of docs/design.md ("Adding a server stage") run as written."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from lightning_fedmeta.algorithms.base import ClientOutput, client_records
from lightning_fedmeta.algorithms.fedavg import FedAvg
from lightning_fedmeta.loop.server import ServerPipeline, apply_server_step, check_update_finite
from lightning_fedmeta.loop.stages import (
    AddDPNoise,
    AlgorithmAggregate,
    ClipUploads,
    PoisonUploads,
    RobustAggregate,
    ServerContext,
    Uploads,
)
from lightning_fedmeta.privacy.mechanism import clip_rows, parse_dp
from lightning_fedmeta.reliability.options import Reliability
from lightning_fedmeta.reliability.robust import parse_aggregator

DELTAS = torch.tensor([[3.0, 4.0], [0.3, 0.4], [-1.0, 0.0]])  # norms 5, 0.5, 1
WEIGHTS = torch.tensor([0.5, 0.3, 0.2])


def _uploads() -> Uploads:
    out = ClientOutput(delta={"w": DELTAS.clone()}, state={}, extras={}, metrics={"loss": torch.ones(3)})
    return Uploads(out, WEIGHTS.clone())


def _ctx(clip: float = math.inf, cohort: int = 3, byzantine: list[bool] | None = None, f: int = 0) -> ServerContext:
    return ServerContext(
        algorithm=FedAvg(), params={"w": torch.zeros(2)}, server_state={},
        records=client_records([10, 6, 4]), seed=5, round_idx=2,
        byzantine=torch.tensor(byzantine or [False] * 3), steps=torch.full((3,), 4), cohort=cohort, clip=clip,
        assumed_byzantine=f,
    )


def test_algorithm_aggregate_is_the_weighted_mean() -> None:
    result = AlgorithmAggregate()(_uploads(), _ctx())
    assert result.update is not None
    torch.testing.assert_close(result.update.delta["w"], WEIGHTS @ DELTAS)


def test_dp_clip_bounds_each_row_and_weights_one_over_m() -> None:
    result = ClipUploads()(_uploads(), _ctx(clip=1.0, cohort=4))
    assert result.rows is not None and result.norms is not None
    torch.testing.assert_close(result.rows[0], torch.tensor([0.6, 0.8]))  # 5 → 1
    assert torch.equal(result.rows[1:], DELTAS[1:])  # inside the ball: bit for bit
    torch.testing.assert_close(result.norms, torch.tensor([5.0, 0.5, 1.0]))
    assert torch.equal(result.weights, torch.full((3,), 0.25))  # 1/m with m = 4 sampled, 3 answered
    aggregated = AlgorithmAggregate()(result, _ctx())
    assert aggregated.update is not None
    torch.testing.assert_close(aggregated.update.delta["w"], result.rows.sum(0) / 4)


def test_dp_noise_has_the_stated_scale_and_is_a_pure_function_of_seed_and_round() -> None:
    dp = parse_dp({"clip": 1.0, "noise_multiplier": 2.0})
    clipped = ClipUploads()(_uploads(), _ctx(clip=1.0, cohort=3))
    aggregated = AlgorithmAggregate()(clipped, _ctx())
    big = Uploads(aggregated.output, aggregated.weights, aggregated.rows, aggregated.norms,
                  type(aggregated.update)({"w": torch.zeros(200_000)}, {}))
    noisy = AddDPNoise(dp)(big, _ctx(clip=1.0, cohort=3))
    assert noisy.update is not None and noisy.privacy is not None
    std = float(noisy.update.delta["w"].std())
    assert std == pytest.approx(2.0 * 1.0 / 3, rel=0.01)  # σ C / m
    again = AddDPNoise(dp)(big, _ctx(clip=1.0, cohort=3))
    assert torch.equal(again.update.delta["w"], noisy.update.delta["w"])
    assert noisy.privacy.clip == 1.0 and noisy.privacy.clipped_fraction == pytest.approx(1 / 3)
    assert noisy.privacy.next_clip is None


def test_robust_median_and_a_skipped_round() -> None:
    median = RobustAggregate(parse_aggregator("median"))(_uploads(), _ctx())
    assert median is not None and median.update is not None
    torch.testing.assert_close(median.update.delta["w"], torch.tensor([0.3, 0.4]))
    krum = RobustAggregate(parse_aggregator({"name": "krum", "f": 1}))  # needs n > 2f + 2 = 4
    assert krum(_uploads(), _ctx(f=1)) is None


def test_poison_replaces_only_the_byzantine_rows() -> None:
    spec = Reliability.from_options(byzantine={"fraction": 0.3, "attack": "sign_flip"}).byzantine
    assert spec is not None
    poisoned = PoisonUploads(spec)(_uploads(), _ctx(byzantine=[False, True, False]))
    assert poisoned.rows is not None
    assert torch.equal(poisoned.rows[[0, 2]], DELTAS[[0, 2]])
    assert not torch.equal(poisoned.rows[1], DELTAS[1])


def test_pipeline_order_follows_the_options() -> None:
    plain = ServerPipeline.from_reliability(Reliability.from_options())
    assert [type(s).__name__ for s in plain.stages] == ["AlgorithmAggregate"]
    private = ServerPipeline.from_reliability(Reliability.from_options(
        byzantine={"fraction": 0.2, "attack": "gaussian"}, dp={"clip": 1.0, "noise_multiplier": 1.0}))
    assert [type(s).__name__ for s in private.stages] == ["PoisonUploads", "ClipUploads", "AlgorithmAggregate",
                                                          "AddDPNoise"]
    robust = ServerPipeline.from_reliability(Reliability.from_options(aggregator="trimmed_mean"))
    assert [type(s).__name__ for s in robust.stages] == ["RobustAggregate"]


def test_server_step_is_sgd_on_the_negative_delta_and_refuses_non_finite() -> None:
    model = torch.nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(1.0)
    apply_server_step(torch.optim.SGD(model.parameters(), lr=0.5), model, {"weight": torch.tensor([[2.0, -4.0]])})
    torch.testing.assert_close(model.weight, torch.tensor([[2.0, -1.0]]))  # w + βΔ
    with pytest.raises(FloatingPointError, match="round 7"):
        check_update_finite(7, {"weight": torch.tensor([[math.nan, 0.0]])})


# the worked example of docs/design.md, as written there
@dataclass(frozen=True)
class NormBound:
    """Δ_i ← Δ_i · min(1, M / ‖Δ_i‖₂) (Sun et al. 2019, norm-bounding defence)."""

    bound: float

    def __call__(self, uploads: Uploads, ctx: ServerContext) -> Uploads:
        rows, _ = clip_rows(uploads.flat(), self.bound)
        return uploads.with_(rows=rows)


def test_the_documented_stage_example_runs_in_a_pipeline() -> None:
    pipeline = ServerPipeline([NormBound(1.0), AlgorithmAggregate()])
    result = pipeline.run(_uploads(), _ctx())
    assert result is not None and result.update is not None
    bounded = torch.stack([DELTAS[0] / 5, DELTAS[1], DELTAS[2]])
    torch.testing.assert_close(result.update.delta["w"], WEIGHTS @ bounded)
    assert "NormBound → AlgorithmAggregate" in repr(pipeline)
