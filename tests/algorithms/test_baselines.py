"""FedAvg, FedProx and SCAFFOLD against closed forms and each other on tiny problems."""

from __future__ import annotations

import lightning as L
import torch
from torch import Tensor, nn

from lightning_fedmeta import (
    Batch,
    ClientContext,
    ClientRecord,
    FederatedModule,
    client_records,
    create_algorithm,
    from_client_tensors,
)
from lightning_fedmeta.algorithms.base import Algorithm
from lightning_fedmeta.client.execution import run_clients
from lightning_fedmeta.client.functional import Params
from tests.conftest import run_plain_rounds
from tests.helpers import make_trainer, tiny_data, tiny_datamodule, tiny_linear


class ParamsPerRound(L.Callback):
    """Records a copy of the global parameters after every round."""

    def __init__(self) -> None:
        self.history: list[dict[str, Tensor]] = []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: object) -> None:
        self.history.append({k: v.detach().clone() for k, v in pl_module.model.state_dict().items()})


def test_fedavg_full_batch_one_step_equals_centralized_gradient_descent() -> None:
    """All clients, τ = 1 full-batch step, sample weights, β = 1:  w⁺ = w − η ∇ (1/N) Σ_j ℓ_j(w) on the union."""
    lr = 0.3
    model = tiny_linear()
    w0 = {k: v.detach().clone() for k, v in model.named_parameters()}
    module = FederatedModule(
        model=model, algorithm={"name": "fedavg", "local_lr": lr, "local_steps": 1, "batch_size": None},
        clients_per_round=6, aggregation="samples", server_lr=1.0,
    )
    make_trainer(1).fit(module, tiny_datamodule(eval_every=5))

    data = tiny_data()
    reference = tiny_linear()
    loss = nn.functional.cross_entropy(reference(data.train_x), data.train_y)  # mean over the union
    grads = torch.autograd.grad(loss, list(reference.parameters()))
    for (name, _), g in zip(reference.named_parameters(), grads, strict=True):
        expected = w0[name] - lr * g
        torch.testing.assert_close(module.model.state_dict()[name], expected, atol=1e-6, rtol=0)
    # the step moved the model (the test can fail)
    assert not torch.allclose(module.model.weight, w0["weight"])


def test_fedprox_mu_zero_equals_fedavg_step_for_step() -> None:
    common = {"local_lr": 0.2, "local_steps": 3, "batch_size": 4}
    histories = []
    for spec in ({"name": "fedavg", **common}, {"name": "fedprox", "mu": 0.0, **common}):
        rec = ParamsPerRound()
        module = FederatedModule(model=tiny_linear(), algorithm=spec, clients_per_round=3, seed=7)
        make_trainer(4, callbacks=[rec]).fit(module, tiny_datamodule(eval_every=10))
        histories.append(rec.history)
    fedavg, fedprox = histories
    assert len(fedavg) == len(fedprox) == 4
    for r, (a, b) in enumerate(zip(fedavg, fedprox, strict=True)):
        for name in a:
            torch.testing.assert_close(b[name], a[name], atol=1e-7, rtol=0, msg=f"round {r}, {name}")
    assert not torch.allclose(fedavg[0]["weight"], fedavg[-1]["weight"])


def test_fedprox_positive_mu_differs_from_fedavg() -> None:
    """Sanity partner of the μ = 0 test: the proximal term changes the iterates when μ > 0."""
    data = tiny_data()
    finals = []
    for spec in ({"name": "fedprox", "mu": 0.0}, {"name": "fedprox", "mu": 1.0}):
        module = FederatedModule(model=tiny_linear(), algorithm={**spec, "local_lr": 0.2, "local_steps": 5},
                                 clients_per_round=3)
        module.attach_data(data)
        _, out, w = module.compute_round(0)
        finals.append(out.delta["weight"])
    assert (finals[0] - finals[1]).abs().max() > 1e-4


# ----------------------------------------------------------------------------------------------
# SCAFFOLD vs FedAvg on a two-client quadratic
# ----------------------------------------------------------------------------------------------
def _half_squared_error(pred: Tensor, y: Tensor) -> Tensor:
    """ℓ(ŷ, y) = ½ (ŷ − y)²: with a linear model every client's loss is a quadratic."""
    return 0.5 * (pred.squeeze(-1) - y) ** 2


def _quadratic_clients() -> tuple[Tensor, Tensor, Tensor]:
    """Two clients, f_i(w) = ½ mean_j (x_jᵀ w − y_j)² with A_1 = diag(2, 1/8), A_2 = diag(1/8, 2),
    minimisers w_1* = (1, 0), w_2* = (0, 1). Returns X [2, 2, 2], Y [2, 2] and the minimiser of
    ½ f_1 + ½ f_2:  w* = (A_1 + A_2)⁻¹ (A_1 w_1* + A_2 w_2*)."""
    x = torch.stack([torch.diag(torch.tensor([2.0, 0.5])), torch.diag(torch.tensor([0.5, 2.0]))])
    w_star = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    y = torch.einsum("cjd,cd->cj", x, w_star)
    a = torch.einsum("cjd,cje->cde", x, x) / 2
    global_min = torch.linalg.solve(a.sum(0), torch.einsum("cde,ce->d", a, w_star))
    return x, y, global_min


def _weighted_minimiser(p: Tensor) -> Tensor:
    """The minimiser of Σ_i p_i f_i for the two quadratic clients: (Σ p_i A_i)⁻¹ Σ p_i A_i w_i*."""
    x, _, _ = _quadratic_clients()
    a = torch.einsum("cjd,cje->cde", x, x) / 2
    w_star = torch.eye(2)
    return torch.linalg.solve(torch.einsum("c,cde->de", p, a), torch.einsum("c,cde,ce->d", p, a, w_star))


def _run_quadratic(algorithm: Algorithm, rounds: int, p: Tensor | None = None) -> Tensor:
    """Full participation, full-batch local steps, client weights p (default ½, ½), server w ← w + Σ_i p_i Δ_i."""
    x, y, _ = _quadratic_clients()
    p = torch.tensor([0.5, 0.5]) if p is None else p
    model = nn.Linear(2, 1, bias=False)
    ctx = ClientContext(model, per_sample_loss=_half_squared_error)
    params: Params = {"weight": torch.zeros(1, 2)}
    steps = algorithm.round_plan().steps
    # batches [C, τ, 1, B, ...]: every local step sees the client's whole data
    batches = Batch(
        x[:, None, None].expand(2, steps, 1, 2, 2),
        y[:, None, None].expand(2, steps, 1, 2),
        torch.ones(2, steps, 1, 2),
    )
    records = client_records([2, 2], weight=p)
    states = algorithm.init_client_states(params, records)
    server = algorithm.init_server_state(params)

    def step(w: Params, s: dict[str, Tensor], b: Batch, st: dict[str, Tensor], rec: ClientRecord):  # noqa: ANN202
        return algorithm.client_update(ctx, w, b, st, s, rec)

    for _ in range(rounds):
        out = run_clients(step, (params, server), (batches, states, records), 2, "vmap")
        delta, server = algorithm.aggregate(params, out, p, server, records)
        params = {k: params[k] + delta[k] for k in params}
        states = out.state
    return params["weight"].flatten()


def test_scaffold_reaches_global_minimiser_where_fedavg_drifts() -> None:
    _, _, global_min = _quadratic_clients()
    hp = {"local_lr": 0.2, "local_steps": 20, "batch_size": None}
    scaffold = _run_quadratic(create_algorithm("scaffold", **hp), rounds=20)
    fedavg = _run_quadratic(create_algorithm("fedavg", **hp), rounds=20)
    # FedAvg with τ = 20 settles at ≈ (0.72, 0.72), on its way to the mean of the client minimisers
    # (½, ½) as τ grows; the minimiser of the sum is w* ≈ (0.94, 0.94).
    assert torch.linalg.norm(scaffold - global_min) < 1e-4, (scaffold, global_min)
    assert torch.linalg.norm(fedavg - global_min) > 0.2, (fedavg, global_min)


def test_scaffold_fixed_point_with_unequal_weights_is_weighted_gradient_descents() -> None:
    """p = (0.8, 0.2): SCAFFOLD's fixed point is the minimiser of Σ p_i f_i, where FedAvg with τ = 1
    (weighted full-batch gradient descent) converges: ≈ (0.985, 0.800), not the uniform (0.941, 0.941)."""
    p = torch.tensor([0.8, 0.2])
    weighted = _weighted_minimiser(p)
    uniform = _weighted_minimiser(torch.tensor([0.5, 0.5]))
    gd = _run_quadratic(create_algorithm("fedavg", local_lr=0.2, local_steps=1, batch_size=None), 400, p)
    scaffold = _run_quadratic(create_algorithm("scaffold", local_lr=0.2, local_steps=20, batch_size=None), 40, p)
    torch.testing.assert_close(gd, weighted, atol=1e-4, rtol=0)
    torch.testing.assert_close(scaffold, gd, atol=1e-4, rtol=0)
    assert torch.linalg.norm(weighted - uniform) > 0.1  # the two objectives really differ here


def test_scaffold_in_the_loop_minimises_the_sample_weighted_objective() -> None:
    """End to end with unequal client sizes (aggregation="samples"): SCAFFOLD (τ = 10) reaches the
    minimiser of the mean loss over the union of the clients' data, as centralised gradient descent."""
    g = torch.Generator().manual_seed(3)
    clients = []
    for n, shift in ((200, 0.0), (40, 1.5)):  # unequal sizes, shifted inputs, noisy labels: a finite minimiser
        x = torch.randn(n + 4, 5, generator=g) + shift
        y = ((x[:, 0] > shift).long() + torch.randint(0, 2, (n + 4,), generator=g)) % 3
        clients.append((x[:n], y[:n], x[n:], y[n:]))
    data = from_client_tensors(clients, 3)
    reference = tiny_linear()
    opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    for _ in range(3000):
        opt.zero_grad()
        nn.functional.cross_entropy(reference(data.train_x), data.train_y).backward()
        opt.step()
    module = FederatedModule(
        model=tiny_linear(), algorithm={"name": "scaffold", "local_lr": 0.1, "local_steps": 10, "batch_size": None},
        clients_per_round=2, aggregation="samples",
    )
    module.attach_data(data)
    run_plain_rounds(module, 150)
    torch.testing.assert_close(module.model.weight, reference.weight, atol=2e-3, rtol=0)
    torch.testing.assert_close(module.model.bias, reference.bias, atol=2e-3, rtol=0)


def test_scaffold_server_control_variate_keeps_the_weighted_mean_of_client_variates() -> None:
    """c ← c + Σ_{i∈S} p_i Δc_i with p_i the clients' weights over ALL training clients, so c = Σ_i p_i c_i."""
    module = FederatedModule(model=tiny_linear(), algorithm={"name": "scaffold", "local_lr": 0.1, "local_steps": 2},
                             clients_per_round=2, holdout_clients=1)
    module.attach_data(tiny_data())
    for r in range(3):
        sampled, out, weights = module.compute_round(r)
        params = module._global_params()
        records = module.records(sampled)
        _, new_server = module.algorithm.aggregate(params, out, weights, module.server_state, records)
        expected = module.server_state["c"]["weight"] + torch.einsum("c,c...->...", records.weight.float(),
                                                                  out.extras["dc"]["weight"])
        torch.testing.assert_close(new_server["c"]["weight"], expected)
        module.commit_round(sampled, out, new_server)
    c_i = module.client_states.tensors["c_i"]["weight"]
    p = module.client_weight.float()
    assert float(p[module.holdout].sum()) == 0.0
    torch.testing.assert_close(module.server_state["c"]["weight"], torch.einsum("k,k...->...", p, c_i))
    assert module.server_state["c"]["weight"].abs().max() > 0
