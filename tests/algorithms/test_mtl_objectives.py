"""The mtl_* family minimises the objective its docstring states, over the training clients only.

* every client step is the autograd gradient of the documented objective Φ(W) w.r.t. w_k divided by
  p_k (unequal sizes and weights, held-out clients with p = 0 and arbitrary models, seen and unseen
  clients, asymmetric S);
* w̄ (the global parameters) is Σ_k p_k w_k over the training clients, with an unseen client's w_k read
  as w̄ (kept exactly by the server's P = Σ_seen p_k);
* never-trained clients (never sampled yet, held out) start from, and are evaluated with, w̄;
* similarity / graph rows and columns of held-out clients are zero.
"""

from __future__ import annotations

from operator import itemgetter

import pytest
import torch
from torch import nn

from lightning_fedmeta import FederatedModule
from lightning_fedmeta.algorithms.base import ClientRecord, client_records
from lightning_fedmeta.algorithms.mtl_graph import MTLGraph, adjacency_from_edges
from lightning_fedmeta.algorithms.mtl_mean import MTLMean
from lightning_fedmeta.algorithms.mtl_pairwise import MTLPairwise
from lightning_fedmeta.algorithms.regularized import RegularizedMTL
from lightning_fedmeta.client.functional import Batch, ClientContext
from lightning_fedmeta.persistence.memory_store import flatten_state, map_state, unflatten_state
from tests.helpers import fit, tiny_data, tiny_datamodule, tiny_module

K = 6
HELD_OUT = [1, 4]
SEEN = [0, 3]  # training clients 2 and 5 have not trained yet
TRAINING = [0, 2, 3, 5]
LAM, LR = 0.7, 0.05


def _records(data) -> ClientRecord:
    counts = data.train_counts
    is_new = torch.zeros(K, dtype=torch.bool)
    is_new[HELD_OUT] = True
    seen = torch.zeros(K, dtype=torch.bool)
    seen[SEEN] = True
    return client_records(counts, is_new=is_new, seen=seen)  # p ∝ n_k over the training clients, 0 held out


def _one(records: ClientRecord, k: int) -> ClientRecord:
    return ClientRecord(*(t[k] for t in records))


def _full_batch(data, k: int) -> Batch:
    x, y = data.client_train(k)
    n = y.numel()
    return Batch(x.double()[None, None], y[None, None], torch.ones(1, 1, n, dtype=torch.float64))


def _setup(alg: RegularizedMTL):
    """A float64 linear model, K clients with unequal sizes, random stored personal models (held-out and
    unseen rows included), and global parameters equal to w̄ = Σ_seen p_k w_k / Σ_seen p_k."""
    torch.manual_seed(0)
    model = nn.Linear(5, 3).double()
    ctx = ClientContext(model)
    data = tiny_data()
    records = _records(data)
    p = records.weight
    assert len(set(p[TRAINING].tolist())) > 1 and float(p[HELD_OUT].abs().sum()) == 0
    init = {k: v.detach().clone() for k, v in model.named_parameters()}
    alg.bind_clients(records, data.label_counts)
    states = alg.init_client_states(init, records)
    stored = {k: v + torch.randn(K, *v.shape, dtype=v.dtype) for k, v in init.items()}
    states["personal"] = {k: v.clone() for k, v in stored.items()}
    seen = records.seen.double()
    w_bar = {k: torch.tensordot(p * seen, v, dims=1) / (p * seen).sum() for k, v in stored.items()}
    server_state = alg.init_server_state(init)
    if "total" in server_state:  # P = Σ_seen p_k
        server_state["total"] = (p * seen).sum().to(server_state["total"].dtype)
    if "seen" in server_state:
        server_state["seen"] = seen.to(server_state["seen"].dtype)
    if "models" in server_state:  # the server's copy of the stored personal models
        server_state["models"] = {k: v.clone() for k, v in stored.items()}
    # the models Φ is evaluated at: an unseen client's w_k is w̄
    effective = {
        k: torch.where(records.seen.reshape(-1, *[1] * (v.dim() - 1)), v, w_bar[k].unsqueeze(0))
        for k, v in stored.items()
    }
    return ctx, data, records, w_bar, states, server_state, effective


def _losses(ctx: ClientContext, data, w: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.stack([ctx.loss({n: v[k] for n, v in w.items()}, _full_batch(data, k).at(0, 0)) for k in range(K)])


def _objective_mean(ctx, data, p, lam):
    def phi(w: dict[str, torch.Tensor]) -> torch.Tensor:  # Σ_k p_k [F_k(w_k) + (λ/2) ‖w_k − w̄‖²], w̄ = Σ p_k w_k
        w_bar = {n: torch.tensordot(p, v, dims=1) for n, v in w.items()}
        penalty = sum(((v - w_bar[n]) ** 2).flatten(1).sum(1) for n, v in w.items())
        return (p * (_losses(ctx, data, w) + 0.5 * lam * penalty)).sum()

    return phi


def _objective_pairwise(ctx, data, p, lam, s):
    """Σ_k p_k [F_k(w_k) + (λ/2) Σ_j S_jk ‖w_k − w_j‖²], S restricted to the training clients."""
    train = (p > 0).double()
    s = s * train[:, None] * train[None, :]

    def phi(w: dict[str, torch.Tensor]) -> torch.Tensor:
        sq = sum(((v.unsqueeze(0) - v.unsqueeze(1)) ** 2).flatten(2).sum(2) for v in w.values())  # ‖w_j − w_k‖²
        penalty = (s * sq).sum(0)  # Σ_j S_jk ‖w_k − w_j‖², indexed by k
        return (p * (_losses(ctx, data, w) + 0.5 * lam * penalty)).sum()

    return phi


def _check_steps(alg: RegularizedMTL, make_phi) -> None:
    ctx, data, records, w_bar, states, server_state, effective = _setup(alg)
    p = records.weight
    phi = make_phi(ctx, data, p)
    leaves = {n: v.clone().requires_grad_(True) for n, v in effective.items()}
    grads = torch.autograd.grad(phi(leaves), list(leaves.values()))
    grads = dict(zip(leaves, grads, strict=True))
    for k in TRAINING:
        state = map_state(itemgetter(k), states)
        out = alg.client_update(ctx, w_bar, _full_batch(data, k), state, server_state, _one(records, k))
        for n in effective:
            expected = effective[n][k] - LR / p[k] * grads[n][k]
            torch.testing.assert_close(out.state["personal"][n], expected, rtol=0, atol=1e-10, msg=f"client {k}, {n}")
            torch.testing.assert_close(out.delta[n], expected - effective[n][k], rtol=0, atol=1e-10)


# ----------------------------------------------------------------------------------------------
# each client step is the gradient of the documented objective, divided by p_k
# ----------------------------------------------------------------------------------------------
def test_mtl_mean_step_is_gradient_of_documented_objective() -> None:
    alg = MTLMean(lam=LAM, local_steps=1, local_lr=LR, batch_size=None)
    _check_steps(alg, lambda ctx, data, p: _objective_mean(ctx, data, p, LAM))


def test_mtl_mean_objective_gradient_through_the_mean_vanishes() -> None:
    """∂/∂w_k Σ_j p_j ‖w_j − w̄‖² with w̄ = Σ_j p_j w_j is 2 p_k (w_k − w̄): w̄'s dependence on w_k drops out."""
    torch.manual_seed(1)
    p = torch.tensor([0.1, 0.5, 0.15, 0.25], dtype=torch.float64)
    w = torch.randn(4, 7, dtype=torch.float64, requires_grad=True)
    value = (p * ((w - p @ w) ** 2).sum(1)).sum()
    (g,) = torch.autograd.grad(value, w)
    torch.testing.assert_close(g, 2 * p[:, None] * (w - p @ w).detach(), rtol=0, atol=1e-12)


def test_mtl_pairwise_step_is_gradient_of_documented_objective_for_asymmetric_similarity() -> None:
    torch.manual_seed(3)
    s = torch.rand(K, K, dtype=torch.float64)  # asymmetric, diagonal and held-out entries set: must be ignored
    alg = MTLPairwise(lam=LAM, similarity=s.tolist(), local_steps=1, local_lr=LR, batch_size=None)
    _check_steps(alg, lambda ctx, data, p: _objective_pairwise(ctx, data, p, LAM, s))


def test_mtl_pairwise_step_is_gradient_of_documented_objective_for_symmetric_similarity() -> None:
    torch.manual_seed(4)
    a = torch.rand(K, K, dtype=torch.float64)
    s = a + a.T
    alg = MTLPairwise(lam=LAM, similarity=s.tolist(), local_steps=1, local_lr=LR, batch_size=None)
    _check_steps(alg, lambda ctx, data, p: _objective_pairwise(ctx, data, p, LAM, s))


def test_mtl_graph_step_is_gradient_of_documented_objective() -> None:
    edges = [[0, 2], [2, 3, 0.5], [3, 5], [5, 0, 2.0], [0, 1], [4, 3]]  # the last two touch held-out clients
    alg = MTLGraph(lam=LAM, edges=edges, local_steps=1, local_lr=LR, batch_size=None)
    adjacency = adjacency_from_edges(edges, K)
    _check_steps(alg, lambda ctx, data, p: _objective_pairwise(ctx, data, p, LAM, adjacency))


# ----------------------------------------------------------------------------------------------
# the mean: exact, over the training clients, unseen clients read as w̄
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "alg",
    [
        MTLMean(lam=LAM, local_steps=2, local_lr=LR, batch_size=None),
        MTLPairwise(lam=LAM, local_steps=2, local_lr=LR, batch_size=None),
        MTLGraph(lam=LAM, edges=[[0, 2], [2, 3], [3, 5], [1, 0]], local_steps=2, local_lr=LR, batch_size=None),
    ],
    ids=["mean", "pairwise", "graph"],
)
def test_aggregate_keeps_the_mean_over_training_clients_with_first_time_clients(alg: RegularizedMTL) -> None:
    ctx, data, records, w_bar, states, server_state, effective = _setup(alg)
    init_total = server_state.get("total", torch.zeros((), dtype=torch.float64))
    sampled = [2, 3]  # client 2 trains for the first time, client 3 again
    outs = []
    for k in sampled:
        state = map_state(itemgetter(k), states)
        full = Batch(*(t.expand(2, *t.shape[1:]) for t in _full_batch(data, k)))
        outs.append(alg.client_update(ctx, w_bar, full, state, server_state, _one(records, k)))
    stacked = type(outs[0])(*(
        unflatten_state({n: torch.stack([flatten_state(o[i])[n] for o in outs]) for n in flatten_state(outs[0][i])})
        for i in range(4)
    ))
    sub = ClientRecord(*(t[sampled] for t in records))
    weights = sub.weight / sub.weight.sum()
    delta, new_server = alg.aggregate(w_bar, stacked, weights, server_state, sub)
    new_bar = {n: w_bar[n] + delta[n] for n in w_bar}
    # after the round: seen = {0, 2, 3}; the effective models (5 still reads as the new w̄) average to w̄
    seen = records.seen.clone()
    seen[sampled] = True
    after = {n: v.clone() for n, v in effective.items()}
    for i, k in enumerate(sampled):
        for n in after:
            after[n][k] = stacked.state["personal"][n][i]
    p = records.weight
    for n in new_bar:
        seen_mean = torch.tensordot(p * seen.double(), after[n], dims=1) / (p * seen.double()).sum()
        torch.testing.assert_close(new_bar[n], seen_mean, rtol=0, atol=1e-12)
        read = torch.where(seen.reshape(-1, *[1] * new_bar[n].dim()), after[n], new_bar[n].unsqueeze(0))
        torch.testing.assert_close(new_bar[n], torch.tensordot(p, read, dims=1), rtol=0, atol=1e-12)
    torch.testing.assert_close(new_server["total"], (p * seen.double()).sum().to(init_total.dtype))


def _fit(algorithm: dict, rounds: int, clients_per_round: int, eval_every: int = 1) -> FederatedModule:
    module = tiny_module(dict(algorithm), clients_per_round=clients_per_round, holdout_clients=2, seed=3)
    return fit(module, tiny_datamodule(eval_every=eval_every), rounds)


def _personal(module: FederatedModule) -> dict[str, torch.Tensor]:
    return dict(module.client_states.tensors["personal"])


MEAN = {"name": "mtl_mean", "lam": 0.5, "local_lr": 0.2, "local_steps": 2, "batch_size": 4}
PAIRWISE = {"name": "mtl_pairwise", "lam": 0.3, "local_lr": 0.2, "local_steps": 2, "batch_size": 4}
GRAPH_KNN = {"name": "mtl_graph", "lam": 0.3, "local_lr": 0.2, "local_steps": 2, "batch_size": 4, "knn": 1}
ALL = [MEAN, PAIRWISE, GRAPH_KNN]
IDS = ["mtl_mean", "mtl_pairwise", "mtl_graph"]


@pytest.mark.parametrize("algorithm", ALL, ids=IDS)
def test_global_model_is_weighted_mean_over_training_clients_only(algorithm: dict) -> None:
    module = _fit(algorithm, rounds=3, clients_per_round=1)
    data = module.data
    train = ~module.is_holdout
    counts = data.train_counts.double() * train.double()
    p = counts / counts.sum()  # held-out clients: weight 0
    assert torch.equal(module.client_weight, p)
    personal = _personal(module)
    seen = module.seen
    assert bool(seen[train].any()) and not bool(seen[train].all()) and not bool(seen[module.is_holdout].any())
    for name, w in module._global_params().items():
        read = torch.where(seen.reshape(-1, *[1] * w.dim()), personal[name].double(), w.double().unsqueeze(0))
        torch.testing.assert_close(w.double(), torch.tensordot(p, read, dims=1), rtol=0, atol=1e-5)


def test_global_model_with_full_participation_is_mean_of_training_personal_models() -> None:
    module = _fit(MEAN, rounds=2, clients_per_round=4)
    p = module.client_weight
    assert float(p[module.is_holdout].abs().sum()) == 0 and abs(float(p.sum()) - 1) < 1e-12
    personal = _personal(module)
    for name, w in module._global_params().items():
        torch.testing.assert_close(w.double(), torch.tensordot(p, personal[name].double(), dims=1), rtol=0,
                                   atol=1e-5)


# ----------------------------------------------------------------------------------------------
# never-trained clients start from and are evaluated with w̄
# ----------------------------------------------------------------------------------------------
def test_mtl_mean_held_out_clients_are_evaluated_with_the_global_mean_model() -> None:
    module = _fit(MEAN, rounds=4, clients_per_round=2, eval_every=2)
    held = module.holdout
    assert held.numel() == 2
    w_bar = module._global_params()
    scores = module.evaluate_clients(held, 4)
    correct, total, loss_sum = scores["builtin"][:, 0], scores["total"], scores["loss_sum"]
    x_y = [module.data.client_test(int(c)) for c in held]
    for i, (x, y) in enumerate(x_y):
        logits = module.ctx.predict(w_bar, x)
        assert int(correct[i]) == int((logits.argmax(1) == y).sum())
        torch.testing.assert_close(loss_sum[i], nn.functional.cross_entropy(logits, y, reduction="sum"))
    # the logged per-client accuracy of the last evaluation is the same number
    acc = module.last_per_client["acc"][held]
    torch.testing.assert_close(acc.double(), (correct.double() / total.double()).cpu())
    personal = module.personalize(int(held[0]))
    for n, v in personal.named_parameters():
        assert torch.equal(v.detach(), w_bar[n])


@pytest.mark.parametrize("algorithm", ALL, ids=IDS)
def test_never_trained_clients_are_evaluated_with_the_mean(algorithm: dict) -> None:
    module = _fit(algorithm, rounds=1, clients_per_round=2)  # 2 of 4 training clients sampled once
    never = (~module.seen).nonzero().flatten()
    assert never.numel() == 4  # 2 training clients not sampled yet + 2 held out
    w_bar = module._global_params()
    for c in never.tolist():
        personal = module.personalize(c)
        for n, v in personal.named_parameters():
            assert torch.equal(v.detach(), w_bar[n]), (c, n)
    trained = module.seen.nonzero().flatten()
    personal = module.personalize(int(trained[0]))
    assert not torch.equal(personal.weight.detach(), w_bar["weight"])


@pytest.mark.parametrize("algorithm", ALL, ids=IDS)
def test_first_round_of_a_client_starts_from_the_mean_not_its_stored_row(algorithm: dict) -> None:
    module = _fit(algorithm, rounds=1, clients_per_round=2)
    unseen = [c for c in module.eligible.tolist() if not bool(module.seen[c])]
    assert unseen
    clients = torch.tensor(unseen)
    batches = module._batches("train", 1, clients, module.algorithm.round_plan())
    states = module.client_states.gather(clients)
    garbage = map_state(lambda v: v + 100.0, states)
    records = module.records(clients)
    params = module._global_params()
    for i in range(len(unseen)):
        one = Batch(batches.x[i], batches.y[i], batches.mask[i])
        record = ClientRecord(*(t[i] for t in records))
        a = module.algorithm.client_update(module.ctx, params, one, map_state(itemgetter(i), states),
                                           module.server_state, record)
        b = module.algorithm.client_update(module.ctx, params, one, map_state(itemgetter(i), garbage),
                                           module.server_state, record)
        for n in params:
            assert torch.equal(a.state["personal"][n], b.state["personal"][n])
            torch.testing.assert_close(a.delta[n], a.state["personal"][n] - params[n], rtol=0, atol=1e-7)


# ----------------------------------------------------------------------------------------------
# similarity and graph exclude held-out clients
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "algorithm",
    [
        {**PAIRWISE, "similarity": torch.ones(6, 6).tolist()},
        {**GRAPH_KNN, "knn": 2},
        {**GRAPH_KNN, "knn": None, "edges": [[i, j] for i in range(6) for j in range(i + 1, 6)]},
        PAIRWISE,
    ],
    ids=["pairwise-given", "graph-knn", "graph-edges", "pairwise-inferred"],
)
def test_similarity_has_zero_rows_and_columns_for_held_out_clients(algorithm: dict) -> None:
    module = _fit(algorithm, rounds=2, clients_per_round=3)
    s = module.server_state["similarity"]
    held, train = module.holdout, module.eligible
    assert float(s[held].abs().sum()) == 0 and float(s[:, held].abs().sum()) == 0
    assert float(s[train][:, train].sum()) > 0
    if algorithm.get("knn"):  # each training client has its knn neighbours among the training clients
        assert bool((s[train][:, train].sum(1) >= algorithm["knn"]).all())
