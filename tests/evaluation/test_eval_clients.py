"""Evaluation that scales: streamed chunks (bit-identical to the unstreamed evaluation) and ``data.eval_clients``
(a fixed seeded sample at validation, every client at test; docs/scale.md)."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import lightning as L
import pytest
import torch

from lightning_fedmeta import FederatedModule
from lightning_fedmeta.client.execution import run_clients
from lightning_fedmeta.client.sampling import generator_for
from lightning_fedmeta.data import FederatedDataModule
from lightning_fedmeta.loop import RankSplit
from tests.conftest import run_plain_rounds
from tests.helpers import TinyDataset, make_trainer, tiny_data

DITTO = {"name": "ditto", "lam": 0.1, "local_steps": 2, "local_lr": 0.1, "batch_size": 4, "finetune_steps": 1}


def _unstreamed(module: FederatedModule, clients: torch.Tensor, r: int) -> dict[str, torch.Tensor]:
    """The evaluation as it was before streaming: every client's batches, test sets and states gathered at once,
    then one ``run_clients`` call that chunks internally."""
    params = module._global_params()
    adapt = module._batches("adapt", r, clients, module.algorithm.eval_plan())
    test = module.engine.gatherer.test_batches(clients)
    states = module.client_states.gather(clients)
    seeds = module.engine.loop_seeds("eval-dropout", r, clients)
    chunk = module.client_chunk_size or max(module.num_sampled, 100)
    with torch.inference_mode(False), torch.enable_grad():
        return run_clients(
            module.evaluator._eval_fn, (params, module.server_state),
            (adapt, test, states, module.records(clients), module.engine.starting_buffers(clients)),
            clients.numel(), module.batching, chunk, seeds,
        )


@pytest.mark.parametrize("batching", ["vmap", "loop"])
def test_streamed_evaluation_equals_the_unstreamed_one_bit_for_bit(batching: str) -> None:
    module = FederatedModule(algorithm=DITTO, clients_per_round=4, client_chunk_size=3, holdout_clients=2,
                             client_batching=batching)
    module.attach_data(tiny_data(num_clients=11))
    run_plain_rounds(module, 3)
    module.model.eval()
    reference = _unstreamed(module, torch.arange(11), 3)
    module.engine.gatherer.test_cache = None
    gathered: list[int] = []
    original = module.client_states.gather
    module.client_states.gather = lambda c: (gathered.append(c.numel()), original(c))[1]  # type: ignore[method-assign]
    summary = module._evaluate("test", log=False)
    assert gathered == [3, 3, 3, 2]  # streamed: one chunk's states at a time, never all 11
    per_client = summary["_per_client"]
    assert torch.equal(module.metric.total, reference["total"].to(torch.float64))
    assert torch.equal(module.metric.loss_sum, reference["loss_sum"].to(torch.float64))
    assert torch.equal(module.metric.builtin_sums, reference["builtin"].to(torch.float64))
    acc = reference["builtin"][:, 0].double() / reference["total"].double()
    assert torch.equal(per_client["acc"], acc)
    # the stacked API gives the same rows
    stacked = module.evaluate_clients(torch.arange(11), 3)
    for key in ("total", "loss_sum", "builtin"):
        assert torch.equal(stacked[key], reference[key]), key


def _expected_sample(seed: int, eligible: torch.Tensor, holdout: torch.Tensor, n_train: int, n_new: int) -> list[int]:
    train = eligible[torch.randperm(eligible.numel(), generator=generator_for(seed, "eval-clients", "train"))[:n_train]]
    new = holdout[torch.randperm(holdout.numel(), generator=generator_for(seed, "eval-clients", "new"))[:n_new]]
    return sorted(train.tolist() + new.tolist())


@pytest.mark.parametrize(
    ("n", "n_train", "n_new"),
    [(5, 4, 1), (10, 8, 2), (2, 1, 1), (1, 1, 0), (17, 14, 3), (18, 14, 4)],  # K = 20, 4 held out
)
def test_the_sample_follows_the_stated_proportional_formula(n: int, n_train: int, n_new: int) -> None:
    module = FederatedModule(clients_per_round=2, holdout_clients=4, seed=7)
    module.attach_data(tiny_data(num_clients=20))
    got = module.evaluation_clients("val", n)
    assert got.tolist() == _expected_sample(7, module.eligible, module.holdout, n_train, n_new)
    assert int(module.is_holdout[got].sum()) == n_new
    assert module.evaluation_clients("test", n).tolist() == list(range(20))
    assert module.evaluation_clients("val", 20).tolist() == list(range(20))
    assert module.evaluation_clients("val", None).tolist() == list(range(20))


class _Record(L.Callback):
    def __init__(self) -> None:
        self.samples: list[list[int]] = []

    def on_validation_end(self, trainer: L.Trainer, pl_module: FederatedModule) -> None:
        self.samples.append(pl_module.last_evaluated.tolist())


def test_validations_score_the_same_sample_and_test_scores_everyone(tmp_path: Path) -> None:
    dm = FederatedDataModule(dataset=TinyDataset(20), eval_every=2, eval_clients=5)
    module = FederatedModule(clients_per_round=3, holdout_clients=4, seed=3, client_chunk_size=2)
    record = _Record()
    trainer = make_trainer(6, callbacks=[record], default_root_dir=str(tmp_path))
    trainer.fit(module, datamodule=dm)
    expected = _expected_sample(3, module.eligible, module.holdout, 4, 1)
    assert record.samples == [expected] * 3  # after rounds 2, 4 and 6
    # the logged summaries are over the sample only; the other clients are NaN, not zeros
    pc = module.last_per_client
    sample = torch.tensor(expected)
    train_sample = sample[~module.is_holdout[sample]]
    assert float(trainer.callback_metrics["val/acc_mean"]) == pytest.approx(float(pc["acc"][train_sample].mean()))
    assert float(trainer.callback_metrics["val/new/acc_mean"]) == pytest.approx(
        float(pc["acc"][sample[module.is_holdout[sample]]].mean()))
    assert float(trainer.callback_metrics["val/evaluated_clients"]) == 5
    others = torch.ones(20, dtype=torch.bool)
    others[sample] = False
    assert bool(pc["acc"][others].isnan().all()) and bool((pc["total"][others] == 0).all())
    assert not bool(pc["acc"][sample].isnan().any())
    path = module.write_per_client_csv(str(tmp_path / "val"))
    with open(path) as fh:
        assert [int(row["index"]) for row in csv.DictReader(fh)] == expected
    trainer.test(module, datamodule=dm)
    assert module.last_evaluated.tolist() == list(range(20))
    assert not bool(module.last_per_client["acc"].isnan().any())
    with open(module.write_per_client_csv(str(tmp_path / "test"))) as fh:
        assert len(list(csv.DictReader(fh))) == 20


def test_a_sampled_validation_scores_the_sampled_clients_as_the_full_one_does() -> None:
    """Each sampled client's values equal its values in an evaluation of everyone (same round, same model)."""
    module = FederatedModule(algorithm=DITTO, clients_per_round=3, holdout_clients=3, client_chunk_size=4)
    module.attach_data(tiny_data(num_clients=15))
    run_plain_rounds(module, 2)
    full = {k: v.clone() for k, v in module._evaluate("test", log=False)["_per_client"].items()}
    sample = module.evaluation_clients("val", 6)
    module._eval_sample_size = lambda: 6  # type: ignore[method-assign]
    module._evaluate("val", log=False)
    for key in ("acc", "loss", "total"):
        torch.testing.assert_close(module.last_per_client[key][sample], full[key][sample], rtol=0, atol=1e-6)
    assert math.isnan(float(module.last_per_client["acc"][[i for i in range(15) if i not in sample][0]]))


@pytest.mark.parametrize("bad", [0, -3, True, 2.5, "10"])
def test_eval_clients_must_be_a_positive_integer(bad: object) -> None:
    with pytest.raises(ValueError, match=r"data\.eval_clients must be an integer >= 1"):
        FederatedDataModule(dataset=TinyDataset(6), eval_clients=bad)  # type: ignore[arg-type]


def test_under_ddp_each_rank_scores_its_share_of_the_same_sample() -> None:
    """Rank r of 2 scores the sample's positions ≡ r (mod 2) (``_rank_share``, emulated here without processes);
    the shares are disjoint, cover the sample, and their zero-filled sum (what ``ClientMetrics.sync`` all-reduces)
    gives the single-process states."""
    def build() -> FederatedModule:
        torch.manual_seed(0)  # the same initial model in every "process"
        module = FederatedModule(algorithm=DITTO, clients_per_round=3, holdout_clients=3, client_chunk_size=2)
        module.attach_data(tiny_data(num_clients=16))
        run_plain_rounds(module, 2)
        module._eval_sample_size = lambda: 7  # type: ignore[method-assign]
        return module

    single = build()
    single._evaluate("val", log=False)
    sample = single.evaluation_clients("val", 7)
    totals, losses = [], []
    for rank in (0, 1):
        module = build()
        module._ranks = lambda r=rank: RankSplit(2, r, lambda t: t)  # type: ignore[method-assign]
        module._evaluate("val", log=False)
        scored = (module.metric.total > 0).nonzero().flatten()
        assert scored.tolist() == sample[rank::2].tolist()
        totals.append(module.metric.total)
        losses.append(module.metric.loss_sum)
    assert torch.equal(totals[0] + totals[1], single.metric.total)
    torch.testing.assert_close(losses[0] + losses[1], single.metric.loss_sum, rtol=0, atol=1e-5)
