"""FDLoRA (``fdlora``: a global adapter averaged, a personal one kept, fused per client) and HetLoRA (``hetlora``:
client ranks r_i ≤ r_max, truncation and zero-padded aggregation), each against a plain-PyTorch reference of its
paper's round on unequal clients (3 of 5 training clients a round, one held out), full batches."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_fedmeta import FederatedModule
from lightning_fedmeta.algorithms.fdlora import FDLoRA, fuse
from lightning_fedmeta.algorithms.hetlora import HetLoRA, truncate
from lightning_fedmeta.communication.accounting import upload_of_client
from lightning_fedmeta.data.synthetic_tasks import make_synthetic_next_token
from lightning_fedmeta.testing import check_loop_equals_vmap
from tests.algorithms.test_lora_rules import (
    A_NAMES,
    B_NAMES,
    ROUNDS,
    STEPS,
    local_sgd,
    lora_lm,
    lora_mlp,
    module_of,
    trainable,
    weights,
)
from tests.conftest import run_plain_rounds
from tests.helpers import tiny_data


def seeded_b(net: nn.Module) -> nn.Module:
    """``net`` with B ≠ 0 (seeded), so A trains from the first step."""
    torch.manual_seed(1)
    with torch.no_grad():
        for n, p in net.named_parameters():
            if n.endswith("lora_B"):
                p.normal_(0.0, 0.3)
    return net


def lora_mlp_b() -> nn.Module:
    return seeded_b(lora_mlp())


def lora_mlp_rank(rank: int) -> nn.Module:
    torch.manual_seed(0)
    from lightning_fedmeta.models.lora import add_lora
    return seeded_b(add_lora(nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3)), rank=rank, alpha=4.0))


# ----------------------------------------------------------------------------------------------
# FDLoRA
# ----------------------------------------------------------------------------------------------
def reference_fusion(net: nn.Module, g: dict[str, Tensor], p: dict[str, Tensor], x: Tensor, y: Tensor,
                     steps: int, lr: float, init: tuple[float, float], l1: float, bound: float) -> Tensor:
    """AdaFusion by autograd: ``steps`` projected gradient steps on F(w_g θ_g + w_p θ_p) + l1 mean|w| (full batch)."""
    w = torch.tensor(init, requires_grad=True)
    for _ in range(steps):
        fused = {k: w[0] * g[k] + w[1] * p[k] for k in g}
        out = torch.func.functional_call(net, {**dict(net.named_parameters()), **fused}, (x,))
        loss = F.cross_entropy(out, y) + l1 * w.abs().mean()
        (grad,) = torch.autograd.grad(loss, w)
        with torch.no_grad():
            w = (w - lr * grad).clamp(-bound, bound).requires_grad_(True)
    return w.detach()


def test_fdlora_rounds_and_fusion_match_plain_pytorch() -> None:
    """3 rounds against the paper's round in plain PyTorch (torch.optim.SGD per client): each sampled client trains
    the global adapter from θ_g (uploaded, averaged with the round's p_i) and its personal adapter from its own θ_p,i
    (from θ_g the first time), on the same batches; the global adapter and every trained client's personal adapter
    agree to 1e-5. The personalised model is AdaFusion's w_g θ_g + w_p θ_p,i with w fitted by projected gradient
    steps (checked against autograd on the fused objective), for a trained client and the held-out one."""
    algo = {"name": "fdlora", "personal_lr": 0.2, "fusion_steps": 3, "fusion_lr": 0.3, "finetune_batch_size": None}
    module = module_of(algo, lora_mlp_b())
    data = tiny_data()
    net = lora_mlp_b()
    g = trainable(net)
    start = dict(g)
    own: dict[int, dict[str, Tensor]] = {}
    rounds = run_plain_rounds(module, ROUNDS)
    for sampled in rounds:
        clients = sampled.tolist()
        p = weights(module, sampled)
        trained = {c: local_sgd(net, g, *data.client_train(c)) for c in clients}
        opt_lr = {}
        for c in clients:  # the personal adapter: its own rate
            with torch.no_grad():
                for n, q in net.named_parameters():
                    if n in g:
                        q.copy_(own.get(c, g)[n])
            opt = torch.optim.SGD([q for q in net.parameters() if q.requires_grad], lr=0.2)
            x, y = data.client_train(c)
            for _ in range(STEPS):
                opt.zero_grad()
                F.cross_entropy(net(x), y).backward()
                opt.step()
            opt_lr[c] = trainable(net)
        g = {k: v + sum(pi * (trained[c][k] - v) for pi, c in zip(p, clients, strict=True)) for k, v in g.items()}
        own.update(opt_lr)
    got = module.engine.global_params()
    for k in g:
        torch.testing.assert_close(got[k], g[k], rtol=0, atol=1e-5)
        assert not torch.equal(got[k], start[k])
    states = module.client_states.tensors["personal"]
    assert set(states) == set(g)  # the trainable parameters only: the frozen base is not stored per client
    for c, mine in own.items():
        for k in g:
            torch.testing.assert_close(states[k][c], mine[k], rtol=0, atol=1e-5)
    # uploads: the global adapter's delta only
    result = module.engine.compute(ROUNDS)
    for i in range(result.clients.numel()):
        assert set(module.algorithm.upload(upload_of_client(result.output, i))["delta"]) == set(g)
        assert not module.algorithm.upload(upload_of_client(result.output, i))["extras"]
    # AdaFusion, for a trained client (its own θ_p) and for the held-out one (θ_p = θ_g)
    for c, personal in ((next(iter(own)), own[next(iter(own))]), (int(module.holdout[0]), got)):
        w = reference_fusion(net, got, personal, *data.client_train(c), steps=3, lr=0.3, init=(0.5, 0.5),
                             l1=0.05, bound=1.5)
        assert not torch.equal(w, torch.tensor([0.5, 0.5]))
        fused = module.personalize(c).state_dict()
        for k in g:
            torch.testing.assert_close(fused[k], w[0] * got[k] + w[1] * personal[k], rtol=0, atol=1e-5)


def test_fdlora_fusion_weights_select_an_adapter_and_stay_in_the_box() -> None:
    g = {"a": torch.ones(2, 2)}
    p = {"a": torch.full((2, 2), 3.0)}
    torch.testing.assert_close(fuse(torch.tensor([1.0, 0.0]), g, p)["a"], g["a"])
    torch.testing.assert_close(fuse(torch.tensor([0.0, 1.0]), g, p)["a"], p["a"])
    torch.testing.assert_close(fuse(torch.tensor([0.5, 0.25]), g, p)["a"], torch.full((2, 2), 1.25))
    # no fusion steps: the weights are fusion_init, so (1, 0) evaluates the global adapter itself
    module = module_of({"name": "fdlora", "fusion_steps": 0, "fusion_init": [1.0, 0.0]}, lora_mlp_b())
    rounds = run_plain_rounds(module, 2)
    c = int(rounds[-1][0])
    got = module.engine.global_params()
    for k, v in module.personalize(c).state_dict().items():
        if k in got:
            torch.testing.assert_close(v, got[k], rtol=0, atol=0)
    # a huge rate: the projected steps stay in the box [-b, b]²; the held-out client's fused adapter is
    # (w_g + w_p) θ_g (its personal adapter is the global one), so every entry is scaled by one |factor| <= 2b
    module = module_of({"name": "fdlora", "fusion_steps": 2, "fusion_lr": 1e6, "fusion_bound": 0.7,
                        "finetune_batch_size": None}, lora_mlp_b())
    run_plain_rounds(module, 1)
    assert isinstance(module.algorithm, FDLoRA)
    got = module.engine.global_params()
    fused = module.personalize(int(module.holdout[0])).state_dict()
    factors = torch.cat([(fused[k] / got[k]).flatten() for k in A_NAMES])
    torch.testing.assert_close(factors, factors[:1].expand_as(factors), rtol=0, atol=1e-5)
    assert float(factors[0].abs()) <= 1.4 + 1e-6


def test_fdlora_refuses_bad_arguments() -> None:
    with pytest.raises(ValueError, match="fusion_init must be two numbers"):
        FDLoRA(fusion_init=(2.0, 0.0))
    with pytest.raises(ValueError, match="fusion_init must be two numbers"):
        FDLoRA(fusion_init=(1.0,))
    with pytest.raises(ValueError, match="fusion_steps must be an integer >= 0"):
        FDLoRA(fusion_steps=-1)
    with pytest.raises(ValueError, match="does not use 'finetune_steps'.*AdaFusion"):
        FDLoRA(finetune_steps=3)


def test_fdlora_and_hetlora_run_looped_and_batched_alike() -> None:
    """loop == vmap on a LoRA'd TinyTransformer on synthetic next-token data (7 unequal clients, 3 a round, one
    held out), mini-batches."""
    data = make_synthetic_next_token(num_clients=7, vocab_size=8, seq_len=6, seed=0)
    check_loop_equals_vmap({"name": "fdlora", "local_steps": 2, "local_lr": 0.3, "fusion_steps": 2},
                           model=lora_lm, data=data, clients_per_round=3, holdout_clients=1, atol=1e-5, rtol=1e-5)
    check_loop_equals_vmap({"name": "hetlora", "local_steps": 2, "local_lr": 0.3, "rank_choices": [1, 2]},
                           model=lora_lm, data=data, clients_per_round=3, holdout_clients=1, atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------------------------
# HetLoRA
# ----------------------------------------------------------------------------------------------
RANKS = [1, 3, 2, 3, 1, 2]  # client i's rank (r_max = 3), held-out client included


def reference_hetlora(module: FederatedModule, rounds: list[Tensor], weighting: str) -> dict[str, Tensor]:
    """The paper's rounds by hand: each sampled client slices the first r_i ranks (A[:r_i], B[:, :r_i]), builds a
    rank-r_i LoRA MLP of them (scale α / r_max), trains it with torch.optim.SGD, and the server averages the
    zero-padded adapters with p_i (round weights, or ∝ ‖B_i A_i‖_F)."""
    data = tiny_data()
    net = lora_mlp_rank(3)
    g = trainable(net)
    for sampled in rounds:
        clients = sampled.tolist()
        padded, norms = {}, {}
        for c in clients:
            r = RANKS[c]
            small = lora_mlp_rank(r)
            for layer_small, layer in ((small[0], net[0]), (small[2], net[2])):
                layer_small.scaling = layer.scaling  # α / r_max, as the server's model
            start = {}
            for k, v in g.items():
                start[k] = v[:r] if k.endswith("lora_A") else v[:, :r]
            trained = local_sgd(small, start, *data.client_train(c))
            pad = {}
            for k, v in trained.items():
                z = torch.zeros_like(g[k])
                if k.endswith("lora_A"):
                    z[:r] = v
                else:
                    z[:, :r] = v
                pad[k] = z
            padded[c] = pad
            norms[c] = float(sum((trained[b] @ trained[a]).square().sum() for a, b in zip(A_NAMES, B_NAMES,
                                                                                            strict=True)) ** 0.5)
        if weighting == "norm":
            total = sum(norms.values())
            p = [norms[c] / total for c in clients]
        else:
            p = weights(module, sampled)
        g = {k: sum(pi * padded[c][k] for pi, c in zip(p, clients, strict=True)) for k in g}
    return g


@pytest.mark.parametrize("weighting", ["norm", "data"])
def test_hetlora_rounds_match_truncation_and_zero_padding_by_hand(weighting: str) -> None:
    """3 rounds against rank-r_i models built by slicing, trained with torch.optim.SGD, zero-padded and averaged
    (sparsity-weighted or by data) by hand: the global adapters agree to 1e-5; the masked batched run is the
    truncated model exactly."""
    module = module_of({"name": "hetlora", "ranks": RANKS, "weighting": weighting}, lora_mlp_rank(3))
    rounds = run_plain_rounds(module, ROUNDS)
    assert len({RANKS[c] for r in rounds for c in r.tolist()}) == 3  # every rank trains
    expected = reference_hetlora(module, rounds, weighting)
    got = module.engine.global_params()
    for k in expected:
        torch.testing.assert_close(got[k], expected[k], rtol=0, atol=1e-5)
    # a client's personalised model is the global adapters truncated to its rank (held-out one included)
    for c in (int(rounds[0][0]), int(module.holdout[0])):
        personal = module.personalize(c).state_dict()
        r = RANKS[c]
        for k in A_NAMES:
            torch.testing.assert_close(personal[k][:r], got[k][:r], rtol=0, atol=0)
            assert not personal[k][r:].any()
        for k in B_NAMES:
            assert not personal[k][:, r:].any()
    assert module.client_states.tensors["rank"].tolist() == RANKS


def test_hetlora_ranks_drawn_from_choices_are_seeded_and_prefix_stable() -> None:
    algo = HetLoRA(rank_choices=[1, 2, 4], rank_seed=3)
    ranks = algo.client_ranks(20, 4)
    assert set(ranks) <= {1, 2, 4} and len(set(ranks)) > 1
    assert algo.client_ranks(5, 4) == ranks[:5]  # client i's rank does not depend on the federation's size
    assert HetLoRA(rank_choices=[1, 2, 4], rank_seed=3).client_ranks(20, 4) == ranks
    assert HetLoRA(rank_choices=[1, 2, 4], rank_seed=4).client_ranks(20, 4) != ranks


def test_hetlora_truncation_is_exact_under_sgd() -> None:
    """Zeroed rows of A and columns of B get zero gradient: the masked model trains as the truncated one."""
    net = lora_mlp_rank(3)
    params = trainable(net)
    masked = truncate(params, torch.tensor(1))
    x, y = tiny_data().client_train(0)
    trained = local_sgd(net, masked, x, y)
    for k in A_NAMES:
        assert not trained[k][1:].any()
    for k in B_NAMES:
        assert not trained[k][:, 1:].any()


def test_hetlora_refuses_bad_ranks() -> None:
    assert HetLoRA().client_ranks(3, 4) == [4, 4, 4]  # neither given: homogeneous, every client at r_max
    with pytest.raises(ValueError, match="not both"):
        HetLoRA(ranks=[1], rank_choices=[1])
    with pytest.raises(ValueError, match="ranks must be a non-empty list"):
        HetLoRA(ranks=[])
    with pytest.raises(ValueError, match="each of rank_choices must be an integer >= 1"):
        HetLoRA(rank_choices=[0, 2])
    with pytest.raises(ValueError, match="weighting must be"):
        HetLoRA(rank_choices=[1], weighting="frobenius")
    with pytest.raises(ValueError, match="ranks lists 2 ranks, but the federation has 6 clients"):
        module_of({"name": "hetlora", "ranks": [1, 2]}, lora_mlp_rank(3))
    with pytest.raises(ValueError, match="exceeds the model's LoRA rank r_max = 3"):
        module_of({"name": "hetlora", "rank_choices": [4]}, lora_mlp_rank(3))
    with pytest.raises(ValueError, match="needs a LoRA'd model"):
        module_of({"name": "hetlora", "rank_choices": [1]}, nn.Sequential(nn.Linear(5, 3)))
