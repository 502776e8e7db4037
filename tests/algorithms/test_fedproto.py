"""FedProto against a plain-PyTorch re-implementation of the authors' client and server (PFLlib's clientproto /
serverproto), with unequal clients, partial participation and a held-out client."""

from __future__ import annotations

import copy
from collections import defaultdict

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_fedmeta import FederatedModule
from lightning_fedmeta.algorithms.base import ClientOutput, client_records
from lightning_fedmeta.algorithms.fedproto import FedProto
from lightning_fedmeta.client.sampling import sample_clients
from lightning_fedmeta.loop.gather import new_client_batches
from tests.conftest import run_plain_rounds
from tests.helpers import tanh_mlp, tiny_data

ALG = {"name": "fedproto", "lam": 0.7, "local_lr": 0.2, "local_steps": 3, "batch_size": 4,
       "finetune_steps": 2, "finetune_lr": 0.1, "finetune_batch_size": 4}


def _reference_client(net: nn.Sequential, batches: tuple[Tensor, Tensor, Tensor], protos: dict[int, Tensor],
                      lam: float, lr: float) -> dict[int, Tensor]:
    """The authors' local epoch on the real rows of each batch: CE(head(rep), y) + λ MSELoss(proto_new, rep),
    proto_new = rep with the rows of classes that have a global prototype replaced by it; plain SGD. Returns the
    client's prototypes: the mean of the (detached) representations of each class over every step."""
    collected: dict[int, list[Tensor]] = defaultdict(list)
    xs, ys, masks = batches
    for x, y, m in zip(xs, ys, masks, strict=True):
        x, y = x[0][m[0] > 0], y[0][m[0] > 0]
        rep = net[:-1](x)
        loss = F.cross_entropy(net[-1](rep), y)
        target = rep.detach().clone()
        for j, k in enumerate(y.tolist()):
            if k in protos:
                target[j] = protos[k]
        loss = loss + lam * F.mse_loss(target, rep)
        net.zero_grad()
        loss.backward()
        with torch.no_grad():
            for p in net.parameters():
                p -= lr * p.grad
        for j, k in enumerate(y.tolist()):
            collected[k].append(rep[j].detach())
    return {k: torch.stack(v).mean(0) for k, v in collected.items()}


def _reference_server(uploads: list[dict[int, Tensor]], protos: dict[int, Tensor]) -> dict[int, Tensor]:
    """Equal-weight mean of the uploaded prototypes of each class; a class nobody uploaded keeps its prototype."""
    new = dict(protos)
    for k in set().union(*uploads):
        new[k] = torch.stack([u[k] for u in uploads if k in u]).mean(0)
    return new


def test_fedproto_matches_plain_pytorch_with_partial_participation_and_a_new_client() -> None:
    """Unequal clients (sizes 5..14, label skew), 3 of 5 eligible clients a round, one held out: after three
    rounds every client's local model and the server's prototypes equal the reference; the global parameters
    never move; a new client fine-tunes from θ⁰ with the prototype pull. Changing the loss (e.g. λ-term weighting,
    prototypes from the final model) or the server rule (sample-weighted mean, dropping absent classes) fails."""
    torch.manual_seed(0)
    module = FederatedModule(model=tanh_mlp(), algorithm=dict(ALG), clients_per_round=3, holdout_clients=1, seed=3)
    module.attach_data(tiny_data())
    init = copy.deepcopy(module.model)
    nets: dict[int, nn.Sequential] = {}
    protos: dict[int, Tensor] = {}
    for r in range(3):
        sampled = sample_clients(module.seed, r, module.eligible, module.num_sampled)
        b = module._batches("train", r, sampled, module.algorithm.round_plan())
        uploads = []
        for i, c in enumerate(sampled.tolist()):
            net = nets.setdefault(c, copy.deepcopy(init))
            uploads.append(_reference_client(net, (b.x[i], b.y[i], b.mask[i]), protos, ALG["lam"], ALG["local_lr"]))
        protos = _reference_server(uploads, protos)
        assert torch.equal(run_plain_rounds(module, 1, first=r)[0], sampled)
    assert module.num_sampled == 3 and module.eligible.numel() == 5 and len(protos) == 3
    personal = module.client_states.tensors["personal"]
    for c, net in nets.items():
        for name, p in net.named_parameters():
            torch.testing.assert_close(personal[name][c], p.detach(), rtol=0, atol=1e-5)
    server = module.server_state
    assert server["known"].tolist() == [1.0, 1.0, 1.0]
    for k, v in protos.items():
        torch.testing.assert_close(server["prototypes"][k], v, rtol=0, atol=1e-5)
    for name, p in module.model.named_parameters():
        assert torch.equal(p, dict(init.named_parameters())[name]), "no parameter is aggregated"
    # a new client: finetune_steps steps of the FedProto objective from θ⁰ with the final prototypes
    x, y = torch.randn(7, 5), torch.tensor([0, 1, 2, 0, 1, 2, 0])
    got = dict(module.personalize((x, y), round_idx=3).named_parameters())
    batches, _ = new_client_batches(module.seed, (x, y), 3, module.algorithm.eval_plan(), torch.device("cpu"))
    ref = copy.deepcopy(init)
    _reference_client(ref, (batches.x, batches.y, batches.mask), protos, ALG["lam"], ALG["finetune_lr"])
    for name, p in ref.named_parameters():
        torch.testing.assert_close(got[name], p.detach(), rtol=0, atol=1e-5)
        assert not torch.equal(p, dict(init.named_parameters())[name]), "the new client did adapt"


def test_fedproto_lambda_zero_is_independent_local_training() -> None:
    """λ = 0: the prototypes do not enter the local step: a client's model is its local SGD whatever the server
    holds."""
    module = FederatedModule(model=tanh_mlp(), algorithm={**ALG, "lam": 0.0}, clients_per_round=3, seed=3)
    module.attach_data(tiny_data())
    alg, params, ctx = module.algorithm, module._global_params(), module.ctx
    batches = module._batches("train", 0, torch.tensor([1]), alg.round_plan())
    one = batches.at(0)
    record = module.records(torch.tensor([1]))
    record = type(record)(*(t[0] for t in record))
    state = alg.init_client_state(params)
    a = alg.client_update(ctx, params, one, state, alg.init_server_state(params), record)
    moved = {"prototypes": torch.randn(3, 8), "known": torch.ones(3)}
    b = alg.client_update(ctx, params, one, state, moved, record)
    for name in params:
        assert torch.equal(a.state["personal"][name], b.state["personal"][name])
    c = FedProto(lam=0.7, local_lr=0.2, local_steps=3, batch_size=4)
    c._num_classes = 3
    d = c.client_update(ctx, params, one, state, moved, record)
    assert any(not torch.equal(a.state["personal"][n], d.state["personal"][n]) for n in params)


def test_fedproto_refuses_a_head_that_is_not_linear_and_bad_lambda() -> None:
    with pytest.raises(ValueError, match="lam must be >= 0"):
        FedProto(lam=-1.0)
    alg = FedProto(head_prefix="0")
    alg.bind_clients(None, torch.zeros(6, 3))  # type: ignore[arg-type]
    params = dict(nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3)).named_parameters())
    with pytest.raises(ValueError, match="one output per class"):
        alg.init_server_state(params)
    conv = dict(nn.Sequential(nn.Linear(4, 4), nn.Unflatten(1, (1, 4)), nn.Conv1d(1, 3, 2)).named_parameters())
    with pytest.raises(ValueError, match="not one nn.Linear"):
        FedProto().head(conv)


def test_fedproto_server_averages_clients_equally_and_keeps_a_class_nobody_held() -> None:
    """Hand-computed: class 0 held by both clients (mean of their prototypes, not weighted by their sizes 2 and
    30), class 1 by one, class 2 by none (keeps its previous prototype)."""
    alg = FedProto()
    alg.bind_clients(None, torch.zeros(2, 3))  # type: ignore[arg-type]
    params = dict(nn.Sequential(nn.Linear(5, 2), nn.Tanh(), nn.Linear(2, 3)).named_parameters())
    old = {"prototypes": torch.tensor([[9.0, 9.0], [9.0, 9.0], [4.0, -4.0]]), "known": torch.tensor([1.0, 0.0, 1.0])}
    uploads = torch.tensor([[[1.0, 2.0], [5.0, 6.0], [0.0, 0.0]], [[3.0, 0.0], [0.0, 0.0], [0.0, 0.0]]])
    holds = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    out = ClientOutput({k: torch.zeros(2, *v.shape) for k, v in params.items()}, {},
                       {"prototypes": uploads, "holds": holds}, {})
    delta, new = alg.aggregate(params, out, torch.tensor([2 / 32, 30 / 32]), old, client_records([2, 30]))
    torch.testing.assert_close(new["prototypes"], torch.tensor([[2.0, 1.0], [5.0, 6.0], [4.0, -4.0]]))
    assert new["known"].tolist() == [1.0, 1.0, 1.0]
    assert all(torch.equal(v, torch.zeros_like(v)) for v in delta.values())
