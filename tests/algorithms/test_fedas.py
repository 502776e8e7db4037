"""FedAS: the conformance kit; a client's round (prototype alignment, local training, Fisher information) against
plain PyTorch autograd on unequal clients; the per-parameter Fisher-weighted average checked by hand on two unequal
clients with a linear model (it is not the uniform average), and the trace weighting; equal Fisher weights are FedAvg;
alignment and Fisher off are FedPer's rounds with partial participation and held-out clients."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call

from lightning_fedmeta.algorithms.base import ClientOutput, client_records
from lightning_fedmeta.algorithms.fedas import FedAS
from lightning_fedmeta.client.functional import Batch, ClientContext
from lightning_fedmeta.testing import check_algorithm, client_record
from tests.conftest import run_plain_rounds
from tests.helpers import tanh_mlp, tiny_data, tiny_module

LR, ALIGN_LR = 0.3, 0.5


def test_fedas_passes_the_conformance_kit() -> None:
    check_algorithm("fedas")


def _client_batches(client: int, steps: int, batch: int = 4) -> Batch:
    x, y = tiny_data().client_train(client)
    idx = (torch.arange(steps * batch) * 3 + client).remainder(x.shape[0]).view(steps, 1, batch)
    return Batch(x[idx], y[idx], torch.ones(steps, 1, batch))


def _linear_net(seed: int = 0) -> nn.Sequential:
    """A linear model split in a body and a head: ``Linear(5, 4) → Linear(4, 3)``."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 4), nn.Linear(4, 3))


def _params(net: nn.Module) -> dict[str, Tensor]:
    return {k: v.detach().clone() for k, v in net.named_parameters()}


def _sgd(model: nn.Module, w: dict[str, Tensor], loss_fn, keys: list[str], lr: float) -> dict[str, Tensor]:
    """One plain autograd SGD step on ``w[keys]`` of ``loss_fn(model, w)``."""
    wt = {k: v.clone().requires_grad_(k in keys) for k, v in w.items()}
    grads = torch.autograd.grad(loss_fn(model, wt), [wt[k] for k in keys])
    return {**w, **{k: w[k] - lr * g for k, g in zip(keys, grads, strict=True)}}


def _reference(make, theta: dict, previous: dict, batches: Batch, align_steps: int) -> tuple[dict, dict]:
    """The authors' client (PFLlib clientas.py) in plain PyTorch: class prototypes of the previous body; per batch
    ``Σ_c MSELoss(body(x)[y == c], P_c)`` SGD steps on the received body; SGD of (body, previous head) with
    cross-entropy; the squared batch gradients at the trained model, averaged over the training batches."""
    model = make()
    head = [k for k in theta if k.startswith(f"{len(model) - 1}.")]
    body_net = nn.Sequential(*list(model)[:-1])
    body_of = lambda w: {k: v for k, v in w.items() if k not in head}  # noqa: E731
    xs, ys = batches.x.reshape(-1, 5), batches.y.reshape(-1)
    with torch.no_grad():
        z = functional_call(body_net, body_of(previous), (xs,))
    protos = {int(c): z[ys == c].mean(0) for c in ys.unique()}

    def align_loss(_m, w, t):
        zt = functional_call(body_net, body_of(w), (batches.x[t, 0],))
        y = batches.y[t, 0]
        return sum(F.mse_loss(zt[y == c], protos[int(c)].expand_as(zt[y == c])) for c in y.unique())

    w = dict(theta)
    for t in range(align_steps):
        w = _sgd(model, w, lambda m, wt, t=t: align_loss(m, wt, t), list(body_of(w)), ALIGN_LR)
    w = {**w, **{k: previous[k] for k in head}}
    ce = lambda m, wt, t: F.cross_entropy(functional_call(m, wt, (batches.x[t, 0],)), batches.y[t, 0])  # noqa: E731
    steps = range(align_steps, batches.x.shape[0])
    for t in steps:
        w = _sgd(model, w, lambda m, wt, t=t: ce(m, wt, t), list(w), LR)
    fisher = {k: torch.zeros_like(v) for k, v in w.items()}
    for t in steps:
        wt = {k: v.clone().requires_grad_() for k, v in w.items()}
        grads = torch.autograd.grad(ce(model, wt, t), list(wt.values()))
        fisher = {k: fisher[k] + g ** 2 / len(steps) for k, g in zip(wt, grads, strict=True)}
    return w, fisher


@pytest.mark.parametrize("client", [1, 3])
def test_fedas_client_round_equals_plain_pytorch_on_unequal_clients(client: int) -> None:
    """A trained client (its previous model ≠ the global one): 2 alignment steps on the received body, 3 SGD steps
    with its own head, and the Fisher information on the 3 training batches equal the plain-PyTorch reference;
    the alignment moved the body."""
    alg = FedAS(align_steps=2, align_lr=ALIGN_LR, local_steps=3, local_lr=LR, fisher="parameter")
    theta, previous = _params(tanh_mlp(seed=1)), _params(tanh_mlp(seed=2))
    batches = _client_batches(client, steps=5)
    record = client_record(int(tiny_data().train_counts[client]), index=client, seen=True)
    out = alg.client_update(ClientContext(tanh_mlp()), theta, batches, {"personal": previous}, {}, record)
    want, fisher = _reference(tanh_mlp, theta, previous, batches, align_steps=2)
    for k in theta:
        torch.testing.assert_close(out.delta[k], want[k] - theta[k], rtol=0, atol=1e-6)
        torch.testing.assert_close(out.state["personal"][k], want[k], rtol=0, atol=1e-6)
        torch.testing.assert_close(out.extras["fisher"][k], fisher[k], rtol=1e-5, atol=1e-9)
    unaligned, _ = _reference(tanh_mlp, theta, previous, batches, align_steps=0)
    assert float((want["0.weight"] - unaligned["0.weight"]).abs().max()) > 1e-3


def _two_clients(fisher: str) -> tuple[FedAS, dict, ClientOutput, Tensor, list[dict]]:
    """Clients 1 and 3 (unequal sizes and data) train the linear model from the global one, no alignment; their
    stacked outputs, the round's weights p_i ∝ n_i, and the plain-PyTorch references (trained model, Fisher)."""
    alg = FedAS(align_steps=0, fisher=fisher, local_steps=3, local_lr=LR)
    theta = _params(_linear_net(1))
    ctx, counts = ClientContext(_linear_net()), tiny_data().train_counts
    outs, refs = [], []
    for client in (1, 3):
        batches = _client_batches(client, steps=3, batch=3 + client)
        record = client_record(int(counts[client]), index=client)
        outs.append(alg.client_update(ctx, theta, batches, alg.init_client_state(theta), {}, record))
        refs.append(_reference(_linear_net, theta, theta, batches, align_steps=0))
    stacked = ClientOutput(*(torch.utils._pytree.tree_map(lambda *t: torch.stack(t), *parts) for parts in zip(*outs,
                                                                                                              strict=True)))
    n = torch.tensor([float(counts[1]), float(counts[3])], dtype=torch.float64)
    assert n[0] != n[1]
    return alg, theta, stacked, n / n.sum(), refs


def test_fedas_fisher_average_by_hand_on_two_unequal_clients_is_per_parameter() -> None:
    """Δ[k] = Σ_i p_i F_i[k] Δ_i[k] / Σ_j p_j F_j[k], every element with its own weights, from the plain-PyTorch
    models and Fisher information; it is neither the p-weighted (FedAvg) nor the trace-weighted average."""
    alg, theta, outputs, p, refs = _two_clients("parameter")
    records = client_records([5, 9])
    delta, _ = alg.aggregate(theta, outputs, p, {}, records)
    for k in theta:
        num = sum(p[i] * refs[i][1][k].double() * (refs[i][0][k] - theta[k]).double() for i in range(2))
        den = sum(p[i] * refs[i][1][k].double() for i in range(2))
        torch.testing.assert_close(delta[k], (num / den).float(), rtol=1e-5, atol=1e-7)
    fedavg = {k: sum(p[i].float() * (refs[i][0][k] - theta[k]) for i in range(2)) for k in theta}
    assert max(float((delta[k] - fedavg[k]).abs().max()) for k in theta) > 1e-3
    ratio = refs[0][1]["0.weight"] / refs[1][1]["0.weight"]
    assert float(ratio.max() / ratio.min()) > 2  # the per-parameter weights really differ across parameters
    trace, _ = FedAS(align_steps=0, fisher="trace").aggregate(theta, _with_traces(outputs), p, {}, records)
    assert max(float((delta[k] - trace[k]).abs().max()) for k in theta) > 1e-4


def _with_traces(outputs: ClientOutput) -> ClientOutput:
    return outputs._replace(extras={"fisher": sum(v.flatten(1).sum(1) for v in outputs.extras["fisher"].values())})


def test_fedas_trace_weights_whole_clients_by_hand() -> None:
    """``fisher="trace"`` (the authors' code): ω_i = p_i tr F_i / Σ_j p_j tr F_j for every parameter; the client
    uploads the one number tr F_i."""
    alg, theta, outputs, p, refs = _two_clients("trace")
    assert outputs.extras["fisher"].shape == (2,)
    traces = [sum(float(v.sum()) for v in ref[1].values()) for ref in refs]
    torch.testing.assert_close(outputs.extras["fisher"], torch.tensor(traces), rtol=1e-5, atol=0)
    delta, _ = alg.aggregate(theta, outputs, p, {}, client_records([5, 9]))
    omega = [float(p[i]) * traces[i] / sum(float(p[j]) * traces[j] for j in range(2)) for i in range(2)]
    for k in theta:
        want = sum(omega[i] * (refs[i][0][k] - theta[k]) for i in range(2))
        torch.testing.assert_close(delta[k], want, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("p", [[0.3, 0.7], [0.5, 0.5]])
def test_fedas_equal_fisher_is_fedavg_of_the_round(p: list[float]) -> None:
    """With the same Fisher information at every client (and 0 at one parameter, which falls back to p_i), the
    server step is the sample- or uniform-weighted FedAvg of the updates, computed independently."""
    alg, theta, outputs, _, refs = _two_clients("parameter")
    fisher = {k: torch.rand_like(v[0]).expand_as(v).clone() for k, v in outputs.extras["fisher"].items()}
    fisher["1.bias"][:, 0] = 0.0
    weights = torch.tensor(p, dtype=torch.float64)
    delta, _ = alg.aggregate(theta, outputs._replace(extras={"fisher": fisher}), weights, {}, client_records([5, 9]))
    for k in theta:
        want = p[0] * (refs[0][0][k] - theta[k]) + p[1] * (refs[1][0][k] - theta[k])
        torch.testing.assert_close(delta[k], want, rtol=1e-5, atol=1e-7)


def test_fedas_without_alignment_and_fisher_is_fedper_with_partial_participation_and_held_out_clients() -> None:
    """6 clients, 2 held out, 2 sampled a round: with ``align_steps=0`` and ``fisher="off"`` the global model after 4
    rounds is FedPer's (joint SGD of the global body and the client's own head, p-weighted average); held-out and
    never-sampled clients are evaluated with the global model, a trained one with its stored θ_i."""
    common = {"local_lr": 0.2, "local_steps": 2, "batch_size": 4}
    modules = {}
    for name, algorithm in (("fedas", FedAS(align_steps=0, fisher="off", **common)),
                            ("fedper", {"name": "fedper", **common})):
        module = tiny_module(algorithm, model=lambda: tanh_mlp(seed=0), clients_per_round=2, holdout_clients=2, seed=3)
        module.attach_data(tiny_data())
        modules[name] = (module, torch.cat(run_plain_rounds(module, 4)).tolist())
    (fedas, sampled), (fedper, _) = modules["fedas"], modules["fedper"]
    glob = fedas._global_params()
    for k, v in fedper._global_params().items():
        torch.testing.assert_close(glob[k], v, rtol=0, atol=1e-6)
    held_out = fedas.is_holdout.nonzero().flatten().tolist()
    never = [i for i in range(6) if i not in sampled]
    assert len(held_out) == 2 and set(held_out) <= set(never)
    for i in never:
        got = dict(fedas.personalize(i).named_parameters())
        assert all(torch.equal(got[k], glob[k]) for k in glob), i
    i = sampled[-1]
    got = dict(fedas.personalize(i).named_parameters())
    assert all(torch.equal(got[k], fedas.client_states.tensors["personal"][k][i]) for k in glob)


def test_fedas_refuses_bad_arguments() -> None:
    with pytest.raises(ValueError, match="fisher must be one of"):
        FedAS(fisher="diagonal")
    with pytest.raises(ValueError, match="align_steps"):
        FedAS(align_steps=-1)
    with pytest.raises(ValueError, match="fisher_steps"):
        FedAS(fisher_steps=0)
    with pytest.raises(ValueError, match="align_lr"):
        FedAS(align_lr=-0.1)
