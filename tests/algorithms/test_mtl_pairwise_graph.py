"""mtl_pairwise and mtl_graph: exact pairwise gradient, inferred similarity, graph smoothing, loop/vmap.

The objective-level checks (autograd gradient of the documented Φ with held-out and unseen clients,
exact mean, held-out clients excluded) are in test_mtl_objectives.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn
from torch.func import grad

from lightning_fedmeta import FederatedModule
from lightning_fedmeta.algorithms.base import ClientRecord, client_records
from lightning_fedmeta.algorithms.mtl_graph import MTLGraph, adjacency_from_edges, knn_adjacency, laplacian
from lightning_fedmeta.algorithms.mtl_pairwise import MTLPairwise
from lightning_fedmeta.algorithms.regularized import clipped_cosine_similarity, similarity_centre
from lightning_fedmeta.client.functional import Batch, ClientContext
from lightning_fedmeta.persistence.memory_store import flatten_state, map_state
from tests.conftest import run_plain_rounds
from tests.helpers import tiny_data, tiny_module

CHAIN = [[i, i + 1] for i in range(5)]
PAIRWISE = {"name": "mtl_pairwise", "lam": 0.3, "local_lr": 0.2, "local_steps": 2, "batch_size": 4}
GRAPH = {"name": "mtl_graph", "lam": 0.3, "local_lr": 0.2, "local_steps": 2, "batch_size": 4, "edges": CHAIN}


def _module(algorithm: dict, batching: str = "loop", clients_per_round: int = 3) -> FederatedModule:
    return tiny_module(dict(algorithm), clients_per_round=clients_per_round, client_batching=batching, seed=2)


def _personal(module: FederatedModule) -> dict[str, torch.Tensor]:
    return dict(module.client_states.tensors["personal"])


def test_pairwise_local_step_equals_explicit_pairwise_sum_gradient() -> None:
    """One step = gradient of the terms of Φ/p_k that contain w_k, summed explicitly pair by pair:
    F_k(w_k) + (λ/2) Σ_j S_jk ‖w_k − w_j‖² (client k's penalty) + (λ/2) Σ_j (p_j/p_k) S_kj ‖w_j − w_k‖²
    (client j's penalties), with an asymmetric S and unequal weights."""
    torch.manual_seed(0)
    model = nn.Linear(5, 3)
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    ctx = ClientContext(model)
    s = torch.rand(4, 4).double()  # asymmetric, with a diagonal that must be ignored
    lam, lr, client = 0.7, 0.05, 2
    alg = MTLPairwise(lam=lam, similarity=s.tolist(), local_steps=1, local_lr=lr, batch_size=4)
    records = client_records([5, 6, 7, 8], seen=[True] * 4)
    p = records.weight
    alg.bind_clients(records, torch.ones(4, 3, dtype=torch.long))
    states = alg.init_client_states(params, records)
    server_state = alg.init_server_state(params)
    models = {k: v + torch.randn(4, *v.shape) for k, v in params.items()}
    server_state["models"] = dict(models)
    server_state["seen"] = torch.ones(4)
    state = map_state(lambda v: v[client], states)
    state["personal"] = {k: models[k][client] for k in params}
    x, y = tiny_data().client_train(client)
    batches = Batch(x[None, None, :4], y[None, None, :4], torch.ones(1, 1, 4))
    record = ClientRecord(*(t[client] for t in records))

    out = alg.client_update(ctx, params, batches, state, server_state, record)

    def objective(w: dict[str, torch.Tensor]) -> torch.Tensor:
        own = sum(s[j, client].float() * sum(((w[k] - models[k][j]) ** 2).sum() for k in w) for j in range(4))
        others = sum(
            float(p[j] / p[client]) * s[client, j].float() * sum(((models[k][j] - w[k]) ** 2).sum() for k in w)
            for j in range(4) if j != client
        )
        return ctx.loss(w, batches.at(0, 0)) + 0.5 * lam * (own + others)

    w0 = {k: models[k][client] for k in params}
    g = grad(objective)(w0)
    for k in params:
        torch.testing.assert_close(out.state["personal"][k], w0[k] - lr * g[k], rtol=0, atol=1e-6)
        torch.testing.assert_close(out.delta[k], -lr * g[k], rtol=0, atol=1e-6)


def test_similarity_centre_is_degree_normalised_weighted_mean() -> None:
    """a_jk = S_jk + (p_j / p_k) S_kj; d_k = Σ_j a_jk; u_k = Σ_j a_jk w_j / d_k."""
    s = torch.tensor([[0.0, 2.0, 0.0], [1.0, 0.0, 0.0], [3.0, 1.0, 0.0]])
    models = {"w": torch.tensor([[1.0], [2.0], [4.0]])}
    uniform = torch.full((3,), 1 / 3)
    degree, centre = similarity_centre(s, uniform, models, torch.tensor(0))  # a_{·0} = S_{·0} + S_{0·} = [0, 3, 3]
    assert float(degree) == 6.0
    torch.testing.assert_close(centre["w"], torch.tensor([(3 * 2.0 + 3 * 4.0) / 6.0]))
    unequal = torch.tensor([0.5, 0.25, 0.25])  # a_{·0} = [0, 1 + 2/2, 3 + 0] = [0, 2, 3]
    degree, centre = similarity_centre(s, unequal, models, torch.tensor(0))
    assert float(degree) == 5.0
    torch.testing.assert_close(centre["w"], torch.tensor([(2 * 2.0 + 3 * 4.0) / 5.0]))
    held_out = torch.tensor([0.5, 0.5, 0.0])  # p_k = 0: no pull at all
    degree, centre = similarity_centre(s, held_out, models, torch.tensor(2))
    assert float(degree) == 0.0 and torch.isfinite(centre["w"]).all()


def test_inferred_similarity_is_clipped_cosine_of_latest_updates() -> None:
    u = torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0], [1.0, 1.0], [0.0, 0.0]])
    s = clipped_cosine_similarity(u)
    r = 2**-0.5
    expected = torch.tensor(
        [[0, 0, 0, r, 0], [0, 0, 0, r, 0], [0, 0, 0, 0, 0], [r, r, 0, 0, 0], [0, 0, 0, 0, 0]], dtype=torch.float32
    )
    torch.testing.assert_close(s, expected)

    module = _module({k: v for k, v in PAIRWISE.items()})
    module.attach_data(tiny_data())
    init = {k: v.clone() for k, v in module._global_params().items()}
    run_plain_rounds(module, 2)
    personal = _personal(module)
    updates = module.server_state["updates"]
    trained = updates.abs().sum(1) > 0
    assert 0 < int(trained.sum()) < 6
    torch.testing.assert_close(module.server_state["similarity"], clipped_cosine_similarity(updates))
    # the server's copy of the personal models is the client store
    for k in init:
        assert torch.equal(module.server_state["models"][k], personal[k])


@pytest.mark.parametrize(
    "algorithm",
    [PAIRWISE, {**PAIRWISE, "similarity": np.eye(6)[::-1].tolist()}, GRAPH],
    ids=["pairwise-inferred", "pairwise-given", "graph-chain"],
)
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
    for k, v in flatten_state(runs["loop"].server_state).items():
        torch.testing.assert_close(flatten_state(runs["vmap"].server_state)[k], v, rtol=0, atol=1e-6)


def _chain_roughness(personal: dict[str, torch.Tensor]) -> float:
    return float(sum(((personal[k][j] - personal[k][j + 1]) ** 2).sum() for k in personal for j in range(5)))


def test_graph_chain_makes_personal_models_smoother_along_the_chain() -> None:
    roughness = {}
    for lam in (0.0, 1.0):  # λ d_k η ≤ 1 · 2 (1 + 14/5) · 0.1 < 1
        module = _module({**GRAPH, "lam": lam, "local_lr": 0.1}, "vmap", clients_per_round=6)
        data = tiny_data()
        module.attach_data(data)
        run_plain_rounds(module, 4)
        personal = _personal(module)
        roughness[lam] = _chain_roughness(personal)
        p = module.client_weight
        assert bool(module.seen.all())
        for k, w in module._global_params().items():  # global = Σ p_k w_k as in mtl_mean
            torch.testing.assert_close(w.double(), torch.tensordot(p, personal[k].double(), dims=1), atol=1e-5,
                                       rtol=0)
    assert roughness[0.0] > 0
    assert roughness[1.0] < 0.5 * roughness[0.0]


def test_laplacian_quadratic_form_is_sum_over_edges() -> None:
    s = adjacency_from_edges([[0, 1], [1, 2, 0.5], [3, 0]], 4)
    assert torch.equal(s, s.T)
    w = torch.randn(4, 3, dtype=torch.float64)
    quad = torch.trace(w.T @ laplacian(s) @ w)
    by_edges = ((w[0] - w[1]) ** 2).sum() + 0.5 * ((w[1] - w[2]) ** 2).sum() + ((w[3] - w[0]) ** 2).sum()
    torch.testing.assert_close(quad, by_edges)
    # with uniform weights the client step's pull d_k (w_k − u_k) is 2 (L W)_k
    degree, centre = similarity_centre(s, torch.full((4,), 0.25, dtype=torch.float64), {"w": w}, torch.tensor(1))
    torch.testing.assert_close(degree * (w[1] - centre["w"]), 2 * (laplacian(s) @ w)[1])


def test_knn_graph_of_label_histograms() -> None:
    hist = torch.tensor([[10, 0, 0], [9, 1, 0], [0, 10, 0], [0, 9, 1], [0, 0, 10]], dtype=torch.float64)
    s = knn_adjacency(hist, 1)
    assert torch.equal(s, s.T) and float(s.diagonal().abs().sum()) == 0
    assert s[0, 1] == 1 and s[2, 3] == 1 and s[4].sum() >= 1
    assert s[0, 2] == 0 and s[0, 4] == 0

    data = tiny_data()
    alone = MTLGraph(edges=None, knn=2)
    with pytest.raises(ValueError, match="give the graph explicitly with edges"):
        alone.adjacency(6)  # knn without the loop's label histograms
    module = _module({**GRAPH, "edges": None, "knn": 2})
    counts = torch.stack([torch.bincount(data.client_train(i)[1], minlength=3) for i in range(6)])
    module.attach_data(data)  # the loop binds the clients' label histograms itself
    assert torch.equal(data.label_counts, counts)
    torch.testing.assert_close(module.server_state["similarity"], knn_adjacency(counts, 2).float())


def test_bad_similarity_or_graph_is_rejected_before_training(tmp_path) -> None:
    with pytest.raises(ValueError, match="finite and >= 0"):
        MTLPairwise(similarity=[[0.0, -1.0], [1.0, 0.0]])
    with pytest.raises(ValueError, match="square"):
        MTLPairwise(similarity=[[0.0, 1.0, 2.0]])
    with pytest.raises(ValueError, match="does not exist"):
        MTLPairwise(similarity=str(tmp_path / "missing.npy"))
    np.save(tmp_path / "s.npy", np.ones((3, 3)))
    module = _module({**PAIRWISE, "similarity": str(tmp_path / "s.npy")})
    with pytest.raises(ValueError, match="but the data has 6 clients"):
        module.attach_data(tiny_data())
    with pytest.raises(ValueError, match="exactly one of edges"):
        MTLGraph(edges=[[0, 1]], knn=2)
    with pytest.raises(ValueError, match="outside 0..5"):
        _module({**GRAPH, "edges": [[0, 6]]}).attach_data(tiny_data())
