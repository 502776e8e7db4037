"""mtl_mean and Ditto: their limits in λ, mean tracking under partial sampling, loop/vmap, resume."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn

from lightning_fedmeta import FederatedModule
from lightning_fedmeta.algorithms.base import ClientRecord
from lightning_fedmeta.algorithms.ditto import Ditto
from lightning_fedmeta.algorithms.local_steps import local_sgd
from lightning_fedmeta.client.functional import Batch, ClientContext, tree_sq_norm, tree_sub
from lightning_fedmeta.client.sampling import sample_clients
from lightning_fedmeta.persistence.memory_store import flatten_state, map_state
from tests.conftest import run_plain_rounds
from tests.helpers import make_trainer, one_client, tiny_data, tiny_datamodule, tiny_module

MTL_MEAN = {"name": "mtl_mean", "lam": 0.5, "local_lr": 0.2, "local_steps": 3, "batch_size": 4}
DITTO = {"name": "ditto", "lam": 0.5, "local_lr": 0.2, "local_steps": 2, "personal_steps": 3, "batch_size": 4}


def _module(algorithm: dict, batching: str = "loop", clients_per_round: int = 3, init_seed: int = 0) -> FederatedModule:
    return tiny_module(dict(algorithm), init_seed=init_seed, clients_per_round=clients_per_round,
                       client_batching=batching, seed=1)


def _personal(module: FederatedModule, key: str) -> dict[str, torch.Tensor]:
    return dict(module.client_states.tensors[key])


# ----------------------------------------------------------------------------------------------
# mtl_mean
# ----------------------------------------------------------------------------------------------
def test_mtl_mean_lambda_zero_personal_models_are_independent_local_sgd() -> None:
    """λ = 0: each client's w_k is plain local SGD on its own batches, from w̄ at its first round (a client
    that has not trained has no personal model yet) and from its own w_k afterwards."""
    module = _module({**MTL_MEAN, "lam": 0.0})
    module.attach_data(tiny_data())
    init = {k: v.clone() for k, v in module._global_params().items()}

    expected: dict[int, dict[str, torch.Tensor]] = {}
    sampled_per_round = []
    for r in range(4):
        w_bar = {k: v.clone() for k, v in module._global_params().items()}
        sampled = sample_clients(module.seed, r, module.eligible, module.num_sampled)
        batches = module._batches("train", r, sampled, module.algorithm.round_plan())
        for i, c in enumerate(sampled.tolist()):
            one = Batch(batches.x[i], batches.y[i], batches.mask[i])
            expected[c], _ = local_sgd(module.ctx, expected.get(c, w_bar), one, module.algorithm.local_lr)
        sampled_per_round += run_plain_rounds(module, 1, first=r)
        assert torch.equal(sampled, sampled_per_round[r])
    personal = _personal(module, "personal")
    for c, w in expected.items():
        for k in init:
            torch.testing.assert_close(personal[k][c], w[k], rtol=0, atol=1e-6)
    assert 0 < len(expected) < 6, "some clients trained, some did not"
    for c in range(6):
        start = module.algorithm.personal_start(
            module._global_params(), {"personal": {k: personal[k][c] for k in init}}, module.server_state,
            ClientRecord(*(t[0] for t in module.records(torch.tensor([c])))),
        )
        # evaluated with its w_k once trained; never trained: with w̄
        want = {k: personal[k][c] for k in init} if c in expected else module._global_params()
        assert all(torch.equal(start[k], want[k]) for k in init), c
    trained = torch.cat(sampled_per_round).unique()
    assert not torch.equal(personal["weight"][int(trained[0])], init["weight"]), "the clients did not train"


def test_mtl_mean_global_params_equal_weighted_mean_of_all_personal_models() -> None:
    """w̄ = Σ_k p_k w_k over the training clients, an unseen client's w_k read as w̄ (equivalently
    w̄ = Σ_{seen} p_k w_k / Σ_{seen} p_k)."""
    module = _module(MTL_MEAN, clients_per_round=2)
    data = tiny_data()
    module.attach_data(data)
    p = data.train_counts.double() / data.train_counts.sum()
    assert torch.equal(module.client_weight, p)
    for r in range(6):
        run_plain_rounds(module, 1, first=r)
        personal = _personal(module, "personal")
        seen = module.seen
        for name, w in module._global_params().items():
            read = torch.where(seen.reshape(-1, *[1] * w.dim()), personal[name].double(), w.double().unsqueeze(0))
            torch.testing.assert_close(w.double(), torch.tensordot(p, read, dims=1), rtol=0, atol=1e-5)
            seen_mean = torch.tensordot(p * seen.double(), personal[name].double(), dims=1) / (p * seen).sum()
            torch.testing.assert_close(w.double(), seen_mean, rtol=0, atol=1e-5)
    # partial sampling: personal models really differ, so the identity is not trivial
    trained = module.seen.nonzero().flatten()
    w = _personal(module, "personal")["weight"][trained]
    assert (w - w[0]).abs().max() > 1e-3


def test_mtl_mean_lambda_pulls_personal_models_together() -> None:
    spread = {}
    for lam in (0.0, 2.0):
        module = _module({**MTL_MEAN, "lam": lam, "local_lr": 0.1, "local_steps": 2}, "vmap", clients_per_round=6)
        module.attach_data(tiny_data())
        run_plain_rounds(module, 3)
        w = _personal(module, "personal")["weight"]
        spread[lam] = float((w - w.mean(0)).pow(2).sum())
    assert spread[2.0] < 0.5 * spread[0.0]


# ----------------------------------------------------------------------------------------------
# Ditto
# ----------------------------------------------------------------------------------------------
def _ctx_and_batches(seed: int = 0) -> tuple[ClientContext, dict[str, torch.Tensor], Batch, Batch]:
    torch.manual_seed(seed)
    model = nn.Linear(5, 3)
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    data = tiny_data()

    def batches(client: int) -> Batch:
        x, y = data.client_train(client)
        steps = 6
        idx = torch.arange(steps * 4).remainder(x.shape[0]).view(steps, 1, 4)
        return Batch(x[idx], y[idx], torch.ones(steps, 1, 4))

    return ClientContext(model), params, batches(0), batches(3)


def test_ditto_lambda_zero_personal_model_is_local_sgd_independent_of_global() -> None:
    ctx, params, batches, _ = _ctx_and_batches()
    alg = Ditto(lam=0.0, local_steps=2, personal_steps=3, local_lr=0.3)
    state = map_state(lambda v: v + 0.5, alg.init_client_state(params))
    other_global = {k: v - 1.0 for k, v in params.items()}
    out_a = alg.client_update(ctx, params, batches, state, {}, one_client(seen=True))
    out_b = alg.client_update(ctx, other_global, batches, state, {}, one_client(seen=True))
    v0 = {k: state["personal"][k] for k in params}
    tail = Batch(batches.x[2:5], batches.y[2:5], batches.mask[2:5])
    expected, _ = local_sgd(ctx, v0, tail, 0.3)
    for k in params:
        assert torch.equal(out_a.state["personal"][k], out_b.state["personal"][k])
        torch.testing.assert_close(out_a.state["personal"][k], expected[k], rtol=0, atol=1e-7)
    # and the global part is plain FedAvg: Δ = τ-step local SGD from w minus w
    head = Batch(batches.x[:2], batches.y[:2], batches.mask[:2])
    w_local, _ = local_sgd(ctx, params, head, 0.3)
    for k in params:
        torch.testing.assert_close(out_a.delta[k], w_local[k] - params[k], rtol=0, atol=1e-7)


def test_ditto_large_lambda_gives_one_shared_model() -> None:
    ctx, params, batches_a, batches_b = _ctx_and_batches()
    distance = {}
    for lam, lr in ((0.0, 0.3), (2000.0, 4e-4)):  # λη = 0.8 < 1: stable, and v_k → w
        alg = Ditto(lam=lam, local_steps=1, personal_steps=5, local_lr=0.3, personal_lr=lr)
        state = alg.init_client_state(params)
        va = alg.client_update(ctx, params, batches_a, state, {}, one_client(seen=True)).state
        vb = alg.client_update(ctx, params, batches_b, state, {}, one_client(seen=True)).state
        far = map_state(lambda v: v + 1.0, state)  # a personal model far from w is pulled back to w
        vf = alg.client_update(ctx, params, batches_a, far, {}, one_client(seen=True)).state
        distance[lam] = (
            float(tree_sq_norm(tree_sub(va["personal"], vb["personal"])).sqrt()),
            float(tree_sq_norm({k: vf["personal"][k] - params[k] for k in params}).sqrt()),
        )
    assert distance[0.0][0] > 0.1 and distance[0.0][1] > 1.0
    assert distance[2000.0][0] < 1e-2 and distance[2000.0][1] < 1e-2


def test_ditto_is_evaluated_with_its_personal_model_once_it_has_trained() -> None:
    _, params, _, _ = _ctx_and_batches()
    alg = Ditto()
    state = map_state(lambda v: v * 3.0, alg.init_client_state(params))
    start = alg.personal_start(params, state, {}, one_client(seen=True))
    assert all(torch.equal(start[k], state["personal"][k]) for k in params)


def test_ditto_client_that_never_trained_starts_from_and_is_scored_with_the_global_model() -> None:
    """Never-sampled clients were scored with their random initial v_k (about 11% of clients at the first
    evaluation of a 10-of-50 run): until it trains, a client's v_k is the current global model."""
    ctx, params, batches, _ = _ctx_and_batches()
    alg = Ditto(lam=0.5, local_steps=2, personal_steps=3, local_lr=0.3)
    stale = map_state(lambda v: v * 3.0 - 1.0, alg.init_client_state(params))  # an initialisation, not w
    start = alg.personal_start(params, stale, {}, one_client(seen=False))
    assert all(torch.equal(start[k], params[k]) for k in params)
    fresh = alg.client_update(ctx, params, batches, stale, {}, one_client(seen=False)).state
    from_global = alg.client_update(ctx, params, batches, alg.init_client_state(params), {},
                                    one_client(seen=True)).state
    for k, v in flatten_state(fresh).items():
        assert torch.equal(v, flatten_state(from_global)[k])


def test_ditto_rejects_bad_hyperparameters() -> None:
    with pytest.raises(ValueError, match="lam must be >= 0"):
        Ditto(lam=-1.0)
    with pytest.raises(ValueError, match="personal_steps must be an integer >= 1"):
        Ditto(personal_steps=0)


# ----------------------------------------------------------------------------------------------
# both
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("algorithm", [MTL_MEAN, DITTO], ids=["mtl_mean", "ditto"])
def test_loop_and_vmap_clients_agree(algorithm: dict) -> None:
    runs = {}
    for mode in ("loop", "vmap"):
        module = _module(algorithm, mode)
        module.attach_data(tiny_data())
        run_plain_rounds(module, 3)
        runs[mode] = module
    for k, v in runs["loop"].model.state_dict().items():
        torch.testing.assert_close(runs["vmap"].model.state_dict()[k], v, rtol=0, atol=1e-6)
    for k, v in flatten_state(runs["loop"].client_states.tensors).items():
        torch.testing.assert_close(flatten_state(runs["vmap"].client_states.tensors)[k], v, rtol=0, atol=1e-6)


def test_ditto_resume_from_checkpoint_is_bit_exact(tmp_path: Path) -> None:
    straight = _module(DITTO, "vmap")
    make_trainer(6).fit(straight, tiny_datamodule(eval_every=2))

    ckpt = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=3, save_top_k=-1, save_last=True)
    first = _module(DITTO, "vmap")
    make_trainer(3, enable_checkpointing=True, callbacks=[ckpt]).fit(first, tiny_datamodule(eval_every=2))
    resumed = _module(DITTO, "vmap", init_seed=99)
    trainer = make_trainer(6)
    trainer.fit(resumed, tiny_datamodule(eval_every=2), ckpt_path=str(tmp_path / "last.ckpt"))
    assert trainer.global_step == 6

    for k, v in straight.model.state_dict().items():
        assert torch.equal(resumed.model.state_dict()[k], v), k
    assert set(straight.client_states.keys()) == {"personal/weight", "personal/bias"}
    for k, v in flatten_state(straight.client_states.tensors).items():
        assert torch.equal(flatten_state(resumed.client_states.tensors)[k], v), k
    key = "personal/weight"
    assert not torch.equal(first.client_states.state_dict()[key], straight.client_states.state_dict()[key])
