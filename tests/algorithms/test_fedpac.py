"""FedPAC: its simplex QP against closed forms and brute force over the supports, the alignment gradient by hand on
a linear body, FedRep when λ = 0 without combination, and whole rounds against a plain-PyTorch re-implementation of
the authors' client and server (unequal clients, partial participation, a held-out client)."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_fedmeta import FederatedModule
from lightning_fedmeta.algorithms.fedpac import FedPAC, combination_weights, simplex_qp
from lightning_fedmeta.client.functional import Batch
from lightning_fedmeta.client.sampling import sample_clients
from lightning_fedmeta.loop.gather import new_client_batches
from lightning_fedmeta.testing import check_algorithm
from tests.conftest import run_plain_rounds
from tests.helpers import make_tiny_clients, tanh_mlp, tiny_data

ALG = {"lam": 0.5, "head_steps": 2, "head_lr": 0.3, "local_lr": 0.2, "local_steps": 3,
       "batch_size": 4, "finetune_steps": 2, "finetune_lr": 0.1, "finetune_batch_size": 4, "qp_iters": 3000}


def test_fedpac_passes_check_algorithm() -> None:
    check_algorithm("fedpac")


# ----------------------------------------------------------------------------------------------
# the quadratic programme
# ----------------------------------------------------------------------------------------------
def _brute_force(q: Tensor, b: Tensor) -> tuple[Tensor, float]:
    """``argmin_{α ∈ Δ} αᵀQα − 2bᵀα`` by the KKT system ``[2Q_SS 1; 1ᵀ 0][α_S; ν] = [2b_S; 1]`` of every support S
    (float64, Q positive definite): the feasible KKT point of least objective."""
    k = q.shape[0]
    best, best_value = None, float("inf")
    for size in range(1, k + 1):
        for support in itertools.combinations(range(k), size):
            s = list(support)
            m = torch.zeros(size + 1, size + 1, dtype=torch.float64)
            m[:size, :size], m[:size, size], m[size, :size] = 2 * q[s][:, s], 1.0, 1.0
            rhs = torch.cat([2 * b[s], torch.ones(1, dtype=torch.float64)])
            sol = torch.linalg.solve(m, rhs)[:size]
            if (sol >= -1e-12).all():
                alpha = torch.zeros(k, dtype=torch.float64)
                alpha[s] = sol.clamp_min(0)
                value = float(alpha @ q @ alpha - 2 * b @ alpha)
                if value < best_value:
                    best, best_value = alpha, value
    assert best is not None
    return best, best_value


def test_simplex_qp_with_two_clients_is_the_clipped_one_dimensional_minimum() -> None:
    """Two clients: α = (a, 1 − a), f(a) = a²A₁₁ + 2a(1 − a)A₁₂ + (1 − a)²A₂₂ − 2(a b₁ + (1 − a) b₂), so
    a* = clip((A₂₂ − A₁₂ + b₁ − b₂) / (A₁₁ − 2A₁₂ + A₂₂), 0, 1). Interior and both clipped cases; tolerance 1e-9."""
    a = torch.tensor([[2.0, 0.5], [0.5, 1.0]], dtype=torch.float64)
    b = torch.tensor([[0.3, 0.1], [2.0, -1.0], [-3.0, 1.0], [0.0, 0.0]], dtype=torch.float64)
    alpha, gap = simplex_qp(a, b, iters=500)
    star = ((a[1, 1] - a[0, 1] + b[:, 0] - b[:, 1]) / (a[0, 0] - 2 * a[0, 1] + a[1, 1])).clamp(0, 1)
    torch.testing.assert_close(alpha, torch.stack([star, 1 - star], 1), rtol=0, atol=1e-9)
    assert star[1] == 1.0 and star[2] == 0.0 and 0 < star[0] < 1 and (gap < 1e-12).all()


def test_simplex_qp_matches_brute_force_over_every_support() -> None:
    """K = 5, A = diag(v) + G (G of rank 2: not strictly convex without v), several rows b, a disallowed client:
    the objective equals the brute-force minimum to 1e-10 (relative to λ_max) and the weights to 1e-6; the
    Frank-Wolfe gap certifies it; the disallowed client gets 0."""
    g = torch.Generator().manual_seed(0)
    h = torch.randn(5, 2, generator=g, dtype=torch.float64)
    a = torch.diag(torch.rand(5, generator=g, dtype=torch.float64) * 0.3 + 0.01) + h @ h.T
    b = torch.randn(4, 5, generator=g, dtype=torch.float64)
    allowed = torch.tensor([True, True, False, True, True])
    alpha, gap = simplex_qp(a, b, iters=2000, allowed=allowed)
    scale = float(torch.linalg.eigvalsh(a).max())
    keep = [0, 1, 3, 4]
    for i in range(b.shape[0]):
        ref, value = _brute_force(a[keep][:, keep], b[i, keep])
        got = float(alpha[i] @ a @ alpha[i] - 2 * b[i] @ alpha[i])
        assert got - value < 1e-10 * scale and gap[i] < 1e-9 * scale
        torch.testing.assert_close(alpha[i, keep], ref, rtol=0, atol=1e-6)
        assert alpha[i, 2] == 0 and abs(float(alpha[i].sum()) - 1) < 1e-12


def _authors_q(variance: list[float], moments: list[Tensor], i: int) -> Tensor:
    """The authors' ``get_head_agg_weight`` matrix for client i: diag(V) + D, D_{j1 j2} = Σ_k ⟨h_i^k − h_j1^k,
    h_i^k − h_j2^k⟩ (tools.py; trace of the outer products)."""
    r = len(variance)
    dist = torch.zeros(r, r, dtype=torch.float64)
    for j1, j2 in itertools.product(range(r), range(r)):
        dist[j1, j2] = sum(float((moments[i][k] - moments[j1][k]) @ (moments[i][k] - moments[j2][k]))
                           for k in range(moments[i].shape[0]))
    return torch.diag(torch.tensor(variance, dtype=torch.float64)) + dist


def _authors_weights(variance: list[float], moments: list[Tensor], min_weight: float = 1e-3) -> Tensor:
    """Each client's weights: the brute-force minimum of αᵀQ_iα on the simplex, weights ≤ 1e-3 dropped,
    renormalised (the authors' ``agg_classifier_weighted_p`` divides by the kept sum)."""
    rows = []
    for i in range(len(variance)):
        alpha, _ = _brute_force(_authors_q(variance, moments, i), torch.zeros(len(variance), dtype=torch.float64))
        alpha = alpha * (alpha > min_weight)
        rows.append(alpha / alpha.sum())
    return torch.stack(rows)


def test_combination_weights_solve_the_authors_problem() -> None:
    """V and H of four clients with skewed class moments: our A = diag(V) + G, b = G_i gives the authors' Q_i
    weights (the objectives differ by the constant G_ii on the simplex)."""
    g = torch.Generator().manual_seed(1)
    moments = torch.randn(4, 3, 2, generator=g, dtype=torch.float64)
    moments[2] = moments[0] + 0.05 * torch.randn(3, 2, generator=g, dtype=torch.float64)
    variance = torch.tensor([0.2, 0.05, 0.1, 0.4], dtype=torch.float64)
    got = combination_weights(variance, moments, torch.ones(4, dtype=torch.bool), iters=3000, min_weight=1e-3)
    ref = _authors_weights(variance.tolist(), list(moments))
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-6)
    assert got[0, 2] > 0.2 and got[2, 0] > 0.2, "clients 0 and 2 (near-equal moments) share their heads"


# ----------------------------------------------------------------------------------------------
# the alignment term
# ----------------------------------------------------------------------------------------------
def test_alignment_gradient_on_a_linear_body_by_hand() -> None:
    """Body z = W x (no bias), head weight 0 (the cross-entropy then has no gradient in W): the gradient of the
    loss in W is λ (2/(B d)) Σ_j m_j a_{y_j} (W x_j − c_{y_j}) x_jᵀ, B the unmasked rows (class 2 inactive, one
    row masked)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 4, bias=False), nn.Linear(4, 3))
    with torch.no_grad():
        model[1].weight.zero_()
    module = FederatedModule(model=model, algorithm=FedPAC(lam=0.7), clients_per_round=3, seed=0)
    module.attach_data(tiny_data())
    alg, ctx, params = module.algorithm, module.ctx, module._global_params()
    x, y = torch.randn(6, 5), torch.tensor([0, 1, 2, 0, 1, 1])
    mask = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0, 1.0])
    targets, active = torch.randn(3, 4), torch.tensor([1.0, 1.0, 0.0])
    grad = torch.func.grad(lambda p: alg.alignment_loss(ctx, p, Batch(x, y, mask), targets, active)[0])(params)
    w = params["0.weight"]
    residual = (x @ w.T - targets[y]) * (mask * active[y]).unsqueeze(-1)
    by_hand = 0.7 * 2.0 / (mask.sum() * 4) * residual.T @ x
    torch.testing.assert_close(grad["0.weight"], by_hand, rtol=1e-6, atol=1e-7)
    assert by_hand.abs().sum() > 0


# ----------------------------------------------------------------------------------------------
# whole rounds against plain PyTorch
# ----------------------------------------------------------------------------------------------
def _rows(x: Tensor, y: Tensor, m: Tensor) -> tuple[Tensor, Tensor]:
    return x[0][m[0] > 0], y[0][m[0] > 0]


def _reference_client(net: nn.Sequential, batches: tuple[Tensor, Tensor, Tensor], protos: dict[int, Tensor],
                      num_samples: int, alg: dict) -> dict:
    """The authors' client on the round's batches, plain SGD: statistics of the features at the received body over
    the head phase's batches (``statistics_extraction``), head steps (body fixed, CE), body steps with
    CE + λ MSELoss(target, rep) (target: the global prototype of the row's class, else its own mean before training,
    only once a global prototype exists), then the class means of the features at the trained body."""
    xs, ys, ms = batches
    first = alg["head_steps"]
    feats: dict[int, list[Tensor]] = {}
    for t in range(first):
        x, y = _rows(xs[t], ys[t], ms[t])
        rep = net[:-1](x).detach()
        for j, k in enumerate(y.tolist()):
            feats.setdefault(k, []).append(rep[j])
        loss = F.cross_entropy(net[-1](rep), y)
        net.zero_grad()
        loss.backward()
        with torch.no_grad():
            for p in net[-1].parameters():
                p -= alg["head_lr"] * p.grad
    total = sum(len(v) for v in feats.values())
    d = net[-1].weight.shape[1]
    moments, variance, local = torch.zeros(3, d), 0.0, {}
    for k, rows in feats.items():
        f = torch.stack(rows)
        p, mu = len(rows) / total, f.mean(0)
        local[k], moments[k] = mu, p * mu
        variance += p * float(torch.trace(f.T @ f) / len(rows)) - p * p * float(mu @ mu)
    for t in range(first, first + alg["local_steps"]):
        x, y = _rows(xs[t], ys[t], ms[t])
        rep = net[:-1](x)
        loss = F.cross_entropy(net[-1](rep), y)
        if protos:
            target = rep.detach().clone()
            for j, k in enumerate(y.tolist()):
                if k in protos:
                    target[j] = protos[k]
                elif k in local:
                    target[j] = local[k]
            loss = loss + alg["lam"] * F.mse_loss(target, rep)
        net.zero_grad()
        loss.backward()
        with torch.no_grad():
            for p in net[:-1].parameters():
                p -= alg["local_lr"] * p.grad
    trained: dict[int, list[Tensor]] = {}
    with torch.no_grad():
        for t in range(first):
            x, y = _rows(xs[t], ys[t], ms[t])
            rep = net[:-1](x)
            for j, k in enumerate(y.tolist()):
                trained.setdefault(k, []).append(rep[j])
    return {"V": variance / num_samples, "H": moments.double(), "net": net,
            "protos": {k: (torch.stack(v).mean(0), len(v)) for k, v in trained.items()}}


def _reference_server(global_net: nn.Sequential, ups: list[dict], weights: Tensor, protos: dict[int, Tensor],
                      collaborate: bool) -> tuple[list[dict[str, Tensor]], dict[int, Tensor]]:
    """Average the models with the round weights (body; the global head as FedRep), prototypes weighted by their
    class counts (a class nobody sent keeps its prototype), and each client's head Σ_j α_ij h_j."""
    with torch.no_grad():
        for name, p in global_net.named_parameters():
            trained = [dict(u["net"].named_parameters())[name] for u in ups]
            p.copy_(sum(w * t for w, t in zip(weights.tolist(), trained, strict=True)))
    new = dict(protos)
    for k in {k for u in ups for k in u["protos"]}:
        held = [u["protos"][k] for u in ups if k in u["protos"]]
        new[k] = sum(c * v for v, c in held) / sum(c for _, c in held)
    heads = [{n: p.detach().clone() for n, p in u["net"][-1].named_parameters()} for u in ups]
    if collaborate:
        alpha = _authors_weights([u["V"] for u in ups], [u["H"] for u in ups]).float()
        heads = [{n: sum(alpha[i, j] * heads[j][n] for j in range(len(ups))) for n in heads[0]}
                 for i in range(len(ups))]
    return heads, new


def _run_reference(module: FederatedModule, alg: dict, rounds: int) -> tuple[nn.Sequential, dict, dict]:
    init = copy.deepcopy(module.model)
    global_net, heads, protos = copy.deepcopy(init), {}, {}
    for r in range(rounds):
        sampled = sample_clients(module.seed, r, module.eligible, module.num_sampled)
        b = module._batches("train", r, sampled, module.algorithm.round_plan())
        records = module.records(sampled)
        ups = []
        for i, c in enumerate(sampled.tolist()):
            net = copy.deepcopy(global_net)
            if c in heads:
                with torch.no_grad():
                    for n, p in net[-1].named_parameters():
                        p.copy_(heads[c][n])
            ups.append(_reference_client(net, (b.x[i], b.y[i], b.mask[i]), protos, int(records.num_samples[i]), alg))
        weights = records.weight / records.weight.sum()
        new_heads, protos = _reference_server(global_net, ups, weights, protos, alg.get("collaborate", True))
        heads.update(dict(zip(sampled.tolist(), new_heads, strict=True)))
        assert torch.equal(run_plain_rounds(module, 1, first=r)[0], sampled)
    return global_net, heads, protos


@pytest.mark.parametrize("collaborate", [True, False])
def test_fedpac_matches_the_authors_rule_in_plain_pytorch(collaborate: bool) -> None:
    """Unequal clients (sizes 5..14, label skew), 3 of 5 eligible clients a round, one held out, three rounds (the
    alignment starts in round 2): the global model, every trained client's combined head and the prototypes equal
    the reference; a new client takes head-only steps from the global head. Changing the QP (e.g. uniform weights,
    dropping the variance term), the statistics, the alignment targets or the prototype weights fails."""
    alg = {**ALG, "collaborate": collaborate}
    module = FederatedModule(model=tanh_mlp(), algorithm=FedPAC(**alg), clients_per_round=3, holdout_clients=1, seed=3)
    module.attach_data(tiny_data())
    global_net, heads, protos = _run_reference(module, alg, rounds=3)
    assert module.num_sampled == 3 and module.eligible.numel() == 5 and len(heads) >= 4
    for name, p in global_net.named_parameters():
        torch.testing.assert_close(dict(module.model.named_parameters())[name], p.detach(), rtol=0, atol=2e-5)
    stored = module.server_state["heads"]
    for c, head in heads.items():
        for n, v in head.items():
            torch.testing.assert_close(stored[f"2.{n}"][c], v, rtol=0, atol=5e-5)
    for k, v in protos.items():
        torch.testing.assert_close(module.server_state["prototypes"][k], v, rtol=0, atol=2e-5)
    # a new client: finetune_steps head-only steps from (global body, global head)
    x, y = torch.randn(7, 5), torch.tensor([0, 1, 2, 0, 1, 2, 0])
    got = dict(module.personalize((x, y), round_idx=3).named_parameters())
    batches, _ = new_client_batches(module.seed, (x, y), 3, module.algorithm.eval_plan(), torch.device("cpu"))
    ref = copy.deepcopy(global_net)
    for t in range(batches.x.shape[0]):
        xb, yb = _rows(batches.x[t], batches.y[t], batches.mask[t])
        loss = F.cross_entropy(ref(xb), yb)
        ref.zero_grad()
        loss.backward()
        with torch.no_grad():
            for p in ref[-1].parameters():
                p -= alg["finetune_lr"] * p.grad
    for name, p in ref.named_parameters():
        torch.testing.assert_close(got[name], p.detach(), rtol=0, atol=2e-5)
    assert not torch.equal(got["2.weight"], dict(global_net.named_parameters())["2.weight"]), "the head adapted"
    assert torch.equal(got["0.weight"], dict(module.model.named_parameters())["0.weight"]), "the body did not"


def test_with_one_head_epoch_the_statistics_are_the_authors_full_training_set_pass() -> None:
    """``local_epochs=1`` (head_epochs 1): the head phase visits every training row once at the received body, so
    V_i and H_i equal the authors' ``statistics_extraction`` over the client's whole training set (client 2, 11
    rows, batches of 4: a partial last batch)."""
    module = FederatedModule(model=tanh_mlp(), algorithm=FedPAC(local_epochs=1, batch_size=4), clients_per_round=3,
                             seed=1)
    module.attach_data(tiny_data())
    alg, params, ctx = module.algorithm, module._global_params(), module.ctx
    one = torch.tensor([2])
    batches = module._batches("train", 0, one, alg.round_plan()).at(0)
    record = module.records(one)
    record = type(record)(*(t[0] for t in record))
    out = alg.client_update(ctx, params, batches, {}, alg.init_server_state(params), record)
    x, y = make_tiny_clients(6)[2][:2]
    z = module.model[:-1](x).detach()
    variance, moments = 0.0, torch.zeros(3, 8)
    for k in y.unique().tolist():  # the authors skip a class the client lacks (here class 0)
        f = z[y == k]
        p, mu = f.shape[0] / y.numel(), f.mean(0)
        moments[k] = p * mu
        variance += p * float(torch.trace(f.T @ f) / f.shape[0]) - p * p * float(mu @ mu)
    assert y.numel() == 11 and len(y.unique()) == 2
    torch.testing.assert_close(out.extras["moments"], moments, rtol=0, atol=1e-6)
    torch.testing.assert_close(float(out.extras["variance"]), variance / 11, rtol=1e-5, atol=1e-7)


def test_fedpac_without_alignment_or_combination_is_fedrep() -> None:
    """λ = 0, ``collaborate=False``, head rate = body rate: the same rounds as FedRep (head steps, then body steps;
    body and mean head averaged; each client keeps its trained head), unequal clients, 3 of 5 a round."""
    common = {"head_steps": 2, "local_lr": 0.2, "local_steps": 3, "batch_size": 4}
    pac = FederatedModule(model=tanh_mlp(), algorithm=FedPAC(lam=0.0, collaborate=False, **common),
                          clients_per_round=3, holdout_clients=1, seed=5)
    rep = FederatedModule(model=tanh_mlp(), algorithm={"name": "fedrep", **common}, clients_per_round=3,
                          holdout_clients=1, seed=5)
    for m in (pac, rep):
        m.attach_data(tiny_data())
        run_plain_rounds(m, 3)
    for name, p in rep.model.named_parameters():
        torch.testing.assert_close(dict(pac.model.named_parameters())[name], p, rtol=0, atol=1e-5)
    seen = rep.records(torch.arange(6)).seen
    for n, v in rep.client_states.tensors["head"].items():
        torch.testing.assert_close(pac.server_state["heads"][n][seen], v[seen], rtol=0, atol=1e-5)


def test_fedpac_refuses_bad_arguments() -> None:
    with pytest.raises(ValueError, match="lam must be >= 0"):
        FedPAC(lam=-1.0)
    with pytest.raises(ValueError, match="min_weight must be < 1"):
        FedPAC(min_weight=1.0)
    with pytest.raises(ValueError, match="qp_iters must be an integer >= 1"):
        FedPAC(qp_iters=0)
    with pytest.raises(ValueError, match="local_epochs is not set"):
        FedPAC(head_epochs=2)
    with pytest.raises(ValueError, match="collaborate must be true or false"):
        FedPAC(collaborate="yes")  # type: ignore[arg-type]
    assert FedPAC(local_epochs=3).round_plan().epochs == (1, 3)


def test_alignment_targets_fall_back_to_the_clients_own_mean() -> None:
    """Hand-computed: class 0 has a global prototype (its target), class 1 does not but the client holds it (its
    own mean at the received body, the authors' ``local_protos1``), class 2 neither (inactive); before any global
    prototype exists nothing is active (the authors' round 0)."""
    alg = FedPAC()
    server = {"prototypes": torch.tensor([[1.0, 2.0], [9.0, 9.0], [9.0, 9.0]]), "known": torch.tensor([1.0, 0.0, 0.0])}
    sums, counts = torch.tensor([[4.0, 4.0], [3.0, 6.0], [0.0, 0.0]]), torch.tensor([2.0, 3.0, 0.0])
    targets, active = alg.alignment_targets(server, sums, counts)
    torch.testing.assert_close(targets[:2], torch.tensor([[1.0, 2.0], [1.0, 2.0]]))
    assert active.tolist() == [1.0, 1.0, 0.0]
    _, before = alg.alignment_targets({**server, "known": torch.zeros(3)}, sums, counts)
    assert before.tolist() == [0.0, 0.0, 0.0]
