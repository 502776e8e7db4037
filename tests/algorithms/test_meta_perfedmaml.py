"""PerFedMAML: per-client MAML initialisations, their weighted mean on the server, resumption."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch import Tensor

from lightning_fedmeta import ClientRecord, FederatedModule
from lightning_fedmeta.algorithms.fedmaml import maml_meta_gradient, split_support_query
from lightning_fedmeta.algorithms.perfedmaml import PerFedMAML
from lightning_fedmeta.client.functional import Batch, ClientContext
from lightning_fedmeta.data import FederatedDataModule
from lightning_fedmeta.persistence.memory_store import flatten_state
from tests.helpers import SmallClients, flat_params, make_trainer, one_client, tanh_mlp, train_small

_ALGO = {"name": "perfedmaml", "alpha": 0.1, "beta": 0.2, "lam": 0.5, "local_steps": 2, "batch_size": 4}


def _train(batching: str = "auto", steps: int = 3, algorithm: dict | None = None, **kwargs: object) -> FederatedModule:
    return train_small(algorithm or _ALGO, batching, steps, eval_every=3, **kwargs)


def _client_inputs(seen: float) -> tuple[ClientContext, dict[str, Tensor], Batch, dict[str, Tensor], ClientRecord]:
    model = tanh_mlp()
    ctx = ClientContext(model)
    w = {n: p.detach() for n, p in model.named_parameters()}
    g = torch.Generator().manual_seed(3)
    batches = Batch(torch.randn(2, 1, 8, 5, generator=g), torch.randint(0, 3, (2, 1, 8), generator=g),
                    torch.ones(2, 1, 8))
    state = {"personal": {k: v + 0.3 * torch.randn(v.shape, generator=g) for k, v in w.items()}}
    return ctx, w, batches, state, one_client(weight=0.25, seen=bool(seen))


def _maml_steps(ctx: ClientContext, theta: dict[str, Tensor], centre: dict[str, Tensor], batches: Batch,
                alpha: float, beta: float, lam: float) -> dict[str, Tensor]:
    for t in range(batches.x.shape[0]):
        g = maml_meta_gradient(ctx, theta, *split_support_query(batches.at(t, 0)), alpha, False)[0]
        theta = {k: theta[k] - beta * (g[k] + 2 * lam * (theta[k] - centre[k])) for k in theta}
    return theta


# ----------------------------------------------------------------------------------------------
# the client update
# ----------------------------------------------------------------------------------------------
def test_lambda_zero_is_exactly_the_per_client_maml_update() -> None:
    ctx, w, batches, state, rec = _client_inputs(seen=1.0)
    algo = PerFedMAML(alpha=0.1, beta=0.2, lam=0.0, local_steps=2, batch_size=4)
    out = algo.client_update(ctx, w, batches, state, {}, rec)
    theta = {k: state["personal"][k] for k in w}
    for t in range(2):
        g = maml_meta_gradient(ctx, theta, *split_support_query(batches.at(t, 0)), 0.1, False)[0]
        theta = {k: theta[k] - 0.2 * g[k] for k in theta}
    for k in w:
        assert torch.equal(out.state["personal"][k], theta[k])
    # λ = 0: the server mean does not enter the client's update
    moved = {k: v + 1.0 for k, v in w.items()}
    again = algo.client_update(ctx, moved, batches, state, {}, rec)
    for k in w:
        assert torch.equal(again.state["personal"][k], theta[k])


def test_coupling_pulls_theta_towards_the_server_mean() -> None:
    ctx, w, batches, state, rec = _client_inputs(seen=1.0)
    out = PerFedMAML(alpha=0.1, beta=0.2, lam=0.7, local_steps=2, batch_size=4).client_update(
        ctx, w, batches, state, {}, rec
    )
    expected = _maml_steps(ctx, {k: state["personal"][k] for k in w}, w, batches, 0.1, 0.2, 0.7)
    for k in w:
        torch.testing.assert_close(out.state["personal"][k], expected[k], atol=1e-7, rtol=0)
    assert set(out.state) == {"personal"} and set(out.state["personal"]) == set(w)  # seen, p: the client's record


def test_a_client_that_never_trained_starts_from_the_server_mean() -> None:
    ctx, w, batches, state, rec = _client_inputs(seen=0.0)
    algo = PerFedMAML(alpha=0.1, beta=0.2, lam=0.7, local_steps=2, batch_size=4)
    out = algo.client_update(ctx, w, batches, state, {}, rec)
    expected = _maml_steps(ctx, w, w, batches, 0.1, 0.2, 0.7)
    for k in w:
        torch.testing.assert_close(out.state["personal"][k], expected[k], atol=1e-7, rtol=0)
        torch.testing.assert_close(out.extras["sum"][k], 0.25 * expected[k], atol=1e-7, rtol=0)
        assert torch.equal(algo.personal_start(w, state, {}, rec)[k], w[k])
    assert float(out.extras["total"]) == 0.25


def test_invalid_hyper_parameters_raise_with_value() -> None:
    with pytest.raises(ValueError, match=r"lam must be >= 0, got -0.1"):
        PerFedMAML(lam=-0.1)
    with pytest.raises(ValueError, match=r"beta must be >= 0, got -1"):
        PerFedMAML(beta=-1)


# ----------------------------------------------------------------------------------------------
# whole rounds
# ----------------------------------------------------------------------------------------------
def test_global_model_is_the_sample_weighted_mean_of_the_trained_clients() -> None:
    module = _train(steps=4, holdout_clients=1)
    store = module.client_states.tensors
    seen = module.seen
    assert bool(seen.any()) and not bool(seen.all()) and not bool(seen[module.holdout].any())
    counts = module.data.train_counts.to(torch.float32) * seen
    weights = counts / counts.sum()
    for name, p in module.model.named_parameters():
        mean = torch.tensordot(weights, store["personal"][name], dims=1)
        torch.testing.assert_close(p.detach(), mean, atol=1e-6, rtol=0)


def test_loop_and_vmap_clients_give_the_same_global_model_and_client_states() -> None:
    looped = _train("loop")
    batched = _train("vmap")
    torch.testing.assert_close(flat_params(looped.model), flat_params(batched.model), atol=1e-6, rtol=0)
    for k, v in flatten_state(looped.client_states.tensors).items():
        torch.testing.assert_close(v, flatten_state(batched.client_states.tensors)[k], atol=1e-6, rtol=0)
    assert (flat_params(looped.model) - flat_params(tanh_mlp())).abs().max() > 1e-4


class _RoundsRun(Callback):
    """Records the round (global step) of every training step this trainer runs."""

    def __init__(self) -> None:
        self.rounds: list[int] = []

    def on_train_batch_start(self, trainer: L.Trainer, *args: object) -> None:
        self.rounds.append(trainer.global_step)


def test_resume_from_a_checkpoint_is_bit_exact(tmp_path: Path) -> None:
    straight = _train(steps=6)

    first = FederatedModule(model=tanh_mlp(), algorithm=_ALGO, clients_per_round=3)
    checkpoint = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    make_trainer(3, enable_checkpointing=True, callbacks=[checkpoint]).fit(
        first, FederatedDataModule(dataset=SmallClients(), eval_every=3)
    )
    resumed = FederatedModule(model=tanh_mlp(), algorithm=_ALGO, clients_per_round=3)
    rounds = _RoundsRun()
    make_trainer(6, callbacks=[rounds]).fit(
        resumed, FederatedDataModule(dataset=SmallClients(), eval_every=3), ckpt_path=str(tmp_path / "last.ckpt")
    )
    assert rounds.rounds == [3, 4, 5]
    assert not torch.equal(flat_params(first.model), flat_params(resumed.model))
    assert torch.equal(flat_params(straight.model), flat_params(resumed.model))
    assert torch.equal(straight.seen, resumed.seen)
    assert straight.client_states.keys() == resumed.client_states.keys()
    for k, v in flatten_state(straight.client_states.tensors).items():
        assert torch.equal(v, flatten_state(resumed.client_states.tensors)[k])
    for k, v in flatten_state(straight.server_state).items():
        assert torch.equal(v, flatten_state(resumed.server_state)[k])
