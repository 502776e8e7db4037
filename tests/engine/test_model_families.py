"""Model families for every task: each runs batched (loop = vmap) or is sent to the loop with its reason.

CharLSTM and TinyTransformer write their recurrence / attention out so ``torch.func.vmap`` can batch them;
PyTorch's ``nn.LSTM``/``nn.GRU``/``nn.RNN`` cannot run under vmap outside ``torch.func.grad`` (the evaluation
forward), so :func:`choose_batching` runs them looped (findings: the docstring of
``lightning_fedmeta.models.reference``).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call, vmap

from lightning_fedmeta.client.execution import choose_batching, run_clients
from lightning_fedmeta.client.functional import Batch, ClientContext, Params
from lightning_fedmeta.models.reference import (
    MLP,
    CharLSTM,
    LogisticRegression,
    SmallCNN,
    TinyTransformer,
    default_model,
)

VOCAB, T, HIDDEN = 12, 10, 16
CLIENTS, STEPS, BATCH = 3, 2, 5
TOL = {"atol": 1e-5, "rtol": 1e-5}


# -- per-sample losses ``(outputs, y) -> [B]`` ----------------------------------------------------------
def ce_per_sample(logits: Tensor, y: Tensor) -> Tensor:
    """``-log softmax(logits)[y]`` per sample (logits ``[B, V]``, y ``[B]``)."""
    return F.cross_entropy(logits, y, reduction="none")


def ce_mean_over_positions(logits: Tensor, y: Tensor) -> Tensor:
    """Per-sample mean over positions of the per-position cross-entropy (logits ``[B, T, V]``, y ``[B, T]``)."""
    per_position = F.cross_entropy(logits.flatten(0, -2), y.flatten(), reduction="none")
    return per_position.reshape(y.shape).mean(-1)


def _params(model: nn.Module) -> Params:
    return {k: v.detach() for k, v in model.named_parameters()}


def _client_batches(x: Tensor, y: Tensor) -> Batch:
    """Per-client batches ``[C, STEPS, B, ...]`` with unequal masks (client ``c`` has ``B - c`` real samples,
    one fewer at the second step)."""
    mask = torch.ones(CLIENTS, STEPS, BATCH)
    for c in range(CLIENTS):
        mask[c, 0, BATCH - c:] = 0
        mask[c, 1, BATCH - c - 1:] = 0
    return Batch(x, y, mask)


def _two_sgd_steps(ctx: ClientContext) -> Callable[[Params, Batch], tuple[Params, Tensor]]:
    def client(params: Params, batches: Batch) -> tuple[Params, Tensor]:
        losses = []
        for step in range(STEPS):
            params, loss = ctx.sgd_step(params, batches.at(step), 0.5)
            losses.append(loss)
        return params, torch.stack(losses)

    return client


def _assert_loop_equals_vmap(model: nn.Module, batches: Batch, loss: Callable[[Tensor, Tensor], Tensor]) -> None:
    assert choose_batching(model, "auto")[0] == "vmap"
    ctx = ClientContext(model, per_sample_loss=loss)
    client = _two_sgd_steps(ctx)
    (p_loop, l_loop), (p_vmap, l_vmap) = (
        run_clients(client, (_params(model),), (batches,), CLIENTS, mode) for mode in ("loop", "vmap")
    )
    torch.testing.assert_close(l_vmap, l_loop, **TOL)
    for name in p_loop:
        torch.testing.assert_close(p_vmap[name], p_loop[name], **TOL, msg=name)
    # the clients really differ (different data and masks) and really trained
    start = _params(model)
    assert any(not torch.allclose(p_loop[k][0], p_loop[k][1]) for k in p_loop)
    assert any(not torch.allclose(p_loop[k][0], start[k]) for k in p_loop)


def _tokens(*shape: int, seed: int = 0) -> Tensor:
    return torch.randint(0, VOCAB, shape, generator=torch.Generator().manual_seed(seed))


# -- loop = vmap ----------------------------------------------------------------------------------------------
def test_small_cnn_group_norm_loop_equals_vmap() -> None:
    torch.manual_seed(0)
    model = SmallCNN(1, 10, width=8, image_size=28)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(CLIENTS, STEPS, BATCH, 1, 28, 28, generator=g)
    y = torch.randint(0, 10, (CLIENTS, STEPS, BATCH), generator=g)
    _assert_loop_equals_vmap(model, _client_batches(x, y), ce_per_sample)


@pytest.mark.parametrize("cell", ["lstm", "gru"])
@pytest.mark.parametrize("all_positions", [False, True])
def test_char_lstm_loop_equals_vmap(cell: str, all_positions: bool) -> None:
    torch.manual_seed(0)
    model = CharLSTM(VOCAB, hidden_size=HIDDEN, cell=cell, all_positions=all_positions)  # type: ignore[arg-type]
    x = _tokens(CLIENTS, STEPS, BATCH, T)
    if all_positions:
        y, loss = _tokens(CLIENTS, STEPS, BATCH, T, seed=1), ce_mean_over_positions
    else:
        y, loss = _tokens(CLIENTS, STEPS, BATCH, seed=1), ce_per_sample
    _assert_loop_equals_vmap(model, _client_batches(x, y), loss)


@pytest.mark.parametrize("all_positions", [True, False])
def test_tiny_transformer_loop_equals_vmap(all_positions: bool) -> None:
    torch.manual_seed(0)
    model = TinyTransformer(VOCAB, d_model=HIDDEN, nhead=2, num_layers=2, max_len=16, all_positions=all_positions)
    x = _tokens(CLIENTS, STEPS, BATCH, T)
    if all_positions:
        y, loss = _tokens(CLIENTS, STEPS, BATCH, T, seed=1), ce_mean_over_positions
    else:
        y, loss = _tokens(CLIENTS, STEPS, BATCH, seed=1), ce_per_sample
    _assert_loop_equals_vmap(model, _client_batches(x, y), loss)


@pytest.mark.parametrize("family", ["lstm", "transformer"])
def test_sequence_models_hessian_vector_products_batch(family: str) -> None:
    """Second-order algorithms work: ``ClientContext.hvp`` (reverse-over-reverse) loop = vmap (PyTorch's CPU
    attention kernel has no double backward, so TinyTransformer writes attention out)."""
    torch.manual_seed(0)
    model: nn.Module = (
        CharLSTM(VOCAB, hidden_size=HIDDEN, num_layers=1, all_positions=True) if family == "lstm"
        else TinyTransformer(VOCAB, d_model=HIDDEN, nhead=2, num_layers=1, max_len=16)
    )
    ctx = ClientContext(model, per_sample_loss=ce_mean_over_positions)
    batches = Batch(_tokens(CLIENTS, BATCH, T), _tokens(CLIENTS, BATCH, T, seed=1), torch.ones(CLIENTS, BATCH))
    v = {k: torch.randn(CLIENTS, *p.shape) for k, p in _params(model).items()}
    looped, batched = (
        run_clients(ctx.hvp, (_params(model),), (batches, v), CLIENTS, mode) for mode in ("loop", "vmap")
    )
    for name in looped:
        torch.testing.assert_close(batched[name], looped[name], **TOL, msg=name)


# -- architecture properties ------------------------------------------------------------------------------------
def test_tiny_transformer_is_causal_and_shapes() -> None:
    torch.manual_seed(0)
    model = TinyTransformer(VOCAB, d_model=HIDDEN, nhead=2, num_layers=2, max_len=16).eval()
    x = _tokens(4, T)
    out = model(x)
    assert out.shape == (4, T, VOCAB)
    for t in range(T - 1):
        changed = x.clone()
        changed[:, t + 1:] = (changed[:, t + 1:] + 1 + _tokens(4, T - t - 1, seed=t)) % VOCAB
        assert not torch.equal(changed, x)
        new = model(changed)
        torch.testing.assert_close(new[:, : t + 1], out[:, : t + 1], atol=1e-6, rtol=1e-6)
        assert not torch.allclose(new[:, t + 1:], out[:, t + 1:])
    last = TinyTransformer(VOCAB, d_model=HIDDEN, nhead=2, num_layers=2, max_len=16, all_positions=False)
    last.load_state_dict(model.state_dict())
    torch.testing.assert_close(last.eval()(x), out[:, -1])
    with pytest.raises(ValueError, match="max_len"):
        model(_tokens(2, 17))


@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_char_lstm_equals_torch_rnn_with_copied_weights(cell: str) -> None:
    torch.manual_seed(0)
    rnn: nn.LSTM | nn.GRU = (nn.LSTM if cell == "lstm" else nn.GRU)(8, HIDDEN, num_layers=2, batch_first=True)
    model = CharLSTM(VOCAB, hidden_size=HIDDEN, cell=cell, all_positions=True)  # type: ignore[arg-type]
    model.load_rnn_weights(rnn)
    x = _tokens(4, T)
    with torch.no_grad():
        expected = model.head(rnn(model.embedding(x))[0])
        torch.testing.assert_close(model(x), expected, atol=1e-5, rtol=1e-5)
        model.all_positions = False
        torch.testing.assert_close(model(x), expected[:, -1], atol=1e-5, rtol=1e-5)
    other = nn.GRU(8, HIDDEN, num_layers=2) if cell == "lstm" else nn.LSTM(8, HIDDEN, num_layers=2)
    with pytest.raises(ValueError, match="expected a unidirectional"):
        model.load_rnn_weights(other)


def test_char_lstm_defaults_are_leaf_shakespeare() -> None:
    """LEAF's Shakespeare model: embedding 8, two LSTM layers of 256 units, linear to the vocabulary."""
    model = CharLSTM(80)
    reference = nn.LSTM(8, 256, num_layers=2)
    n_rnn = sum(p.numel() for p in reference.parameters())
    assert sum(p.numel() for p in model.parameters()) == 80 * 8 + n_rnn + 256 * 80 + 80
    assert model(_tokens(3, T)).shape == (3, 80)


def test_small_cnn_norms() -> None:
    group, batch = SmallCNN(1, 10, width=8), SmallCNN(1, 10, width=8, norm="batch")
    assert [n for n, _ in group.named_parameters()] == [n for n, _ in batch.named_parameters()]
    assert isinstance(group.features[1], nn.GroupNorm)
    assert isinstance(batch.features[1], nn.BatchNorm2d) and batch.features[1].track_running_stats
    assert "features.1.running_mean" in dict(batch.named_buffers())
    assert batch(torch.randn(2, 1, 28, 28)).shape == (2, 10)
    with pytest.raises(ValueError, match="norm"):
        SmallCNN(norm="layer")  # type: ignore[arg-type]


# -- dropout: loop with per-client seeds ------------------------------------------------------------------------
def test_transformer_dropout_runs_looped_with_reproducible_seeds() -> None:
    torch.manual_seed(0)
    model = TinyTransformer(VOCAB, d_model=HIDDEN, nhead=2, num_layers=1, max_len=16, dropout=0.2)
    mode, reason = choose_batching(model, "auto")
    assert mode == "loop" and "dropout" in reason
    with pytest.raises(ValueError, match="dropout"):
        choose_batching(model, "vmap")
    ctx = ClientContext(model, per_sample_loss=ce_mean_over_positions)
    batches = _client_batches(_tokens(CLIENTS, STEPS, BATCH, T), _tokens(CLIENTS, STEPS, BATCH, T, seed=1))
    client = _two_sgd_steps(ctx)

    def run(seeds: list[int]) -> tuple[Params, Tensor]:
        return run_clients(client, (_params(model),), (batches,), CLIENTS, "loop", client_seeds=seeds)

    (p1, l1), (p2, l2), (p3, l3) = run([1, 2, 3]), run([1, 2, 3]), run([4, 5, 6])
    assert torch.equal(l1, l2) and all(torch.equal(p1[k], p2[k]) for k in p1)
    assert not torch.equal(l1, l3) and any(not torch.equal(p1[k], p3[k]) for k in p1)


# -- PyTorch's recurrent layers: the loop, with the reason --------------------------------------------------------
class _TorchLSTMModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, 8)
        self.rnn = nn.LSTM(8, HIDDEN, batch_first=True)
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.rnn(self.embedding(x))[0][:, -1])


def test_torch_rnn_layers_cannot_vmap_outside_grad() -> None:
    """The finding behind the rule (torch 2.14): a batched nn.LSTM forward (evaluation) has no batching rule.
    If this starts passing, PyTorch added one: revisit choose_batching's recurrent-layer rule."""
    model = _TorchLSTMModel()
    stacked = {k: v.expand(CLIENTS, *v.shape) for k, v in _params(model).items()}
    with pytest.raises(RuntimeError, match="Batching rule not implemented for aten::lstm"):
        vmap(lambda p, x: functional_call(model, p, (x,)))(stacked, _tokens(CLIENTS, BATCH, T))


def test_choose_batching_sends_torch_rnns_to_the_loop() -> None:
    for model in (_TorchLSTMModel(), nn.GRU(4, 4), nn.Sequential(nn.RNN(4, 4))):
        mode, reason = choose_batching(model, "auto")
        assert mode == "loop"
        assert "CharLSTM" in reason and "nn." in reason
        with pytest.raises(ValueError, match="impossible.*CharLSTM"):
            choose_batching(model, "vmap")
        assert choose_batching(model, "loop")[0] == "loop"
    assert "rnn (nn.LSTM)" in choose_batching(_TorchLSTMModel(), "auto")[1]


def test_choose_batching_unchanged_for_batchable_models() -> None:
    for model in (
        MLP(), LogisticRegression(), SmallCNN(width=8), CharLSTM(VOCAB, hidden_size=HIDDEN),
        TinyTransformer(VOCAB, d_model=HIDDEN, nhead=2), nn.Sequential(nn.Linear(3, 3), nn.Dropout(0.0)),
    ):
        assert choose_batching(model, "auto") == ("vmap", "batched clients (torch.func.vmap)")
        assert choose_batching(model, "vmap")[0] == "vmap"
    dropout = nn.Sequential(nn.Linear(3, 3), nn.Dropout(0.5))
    assert choose_batching(dropout, "auto") == (
        "loop", "the batched (vmap) client path cannot run dropout drawn per client (1); running clients looped"
    )


# -- default_model by task ------------------------------------------------------------------------------------------
def test_default_model_classification_unchanged() -> None:
    assert isinstance(default_model((60,), 10), LogisticRegression)
    mlp = default_model((1, 28, 28), 10)
    assert isinstance(mlp, MLP) and sum(p.numel() for p in mlp.parameters()) == 68_270
    assert [n for n, _ in mlp.named_parameters()] == [n for n, _ in MLP().named_parameters()]
    assert isinstance(default_model((3, 32, 32), 10), SmallCNN)
    assert default_model((3, 32, 32), 10, task="classification")(torch.randn(2, 3, 32, 32)).shape == (2, 10)


@pytest.mark.parametrize(
    ("input_shape", "num_classes", "task", "target_shape", "expected"),
    [
        ((7,), 0, "regression", (), (BATCH,)),
        ((1, 6, 6), 0, "regression", (3,), (BATCH, 3)),
        ((7,), 0, "regression", (2, 3), (BATCH, 2, 3)),
        ((7,), 4, "multilabel", (4,), (BATCH, 4)),
        ((T,), VOCAB, "next_token", (), (BATCH, VOCAB)),
        ((T,), VOCAB, "next_token", (T,), (BATCH, T, VOCAB)),
    ],
)
def test_default_model_by_task(
    input_shape: tuple[int, ...], num_classes: int, task: str, target_shape: tuple[int, ...],
    expected: tuple[int, ...],
) -> None:
    model = default_model(input_shape, num_classes, task=task, target_shape=target_shape)
    x = _tokens(BATCH, *input_shape) if task == "next_token" else torch.randn(BATCH, *input_shape)
    assert model(x).shape == expected
    assert choose_batching(model, "auto")[0] == "vmap"
    if task in ("regression", "multilabel"):
        assert isinstance(model, MLP) and model.net[1].in_features == math.prod(input_shape)
        assert [m.out_features for m in model.net if isinstance(m, nn.Linear)][:2] == [80, 60]
        assert isinstance(model.net[2], nn.ELU)
    else:
        assert isinstance(model, CharLSTM) and model.hidden_size == 256


def test_default_model_rejects_unknown_task() -> None:
    with pytest.raises(ValueError, match="task must be one of"):
        default_model((3,), 2, task="ranking")


def test_mlp_elu_is_nn_elu_eagerly_and_to_float32_rounding_when_compiled() -> None:
    """models.ELU compiles to α(exp(x) − 1) for x ≤ 0 (inductor's expm1 is slow): the same function."""
    from lightning_fedmeta.models.reference import ELU

    x = torch.cat([torch.linspace(-20, 5, 10_001), torch.tensor([-1e-6, -1e-30, 0.0, 1e-30, 100.0])])
    for alpha in (1.0, 0.5):
        fast, ref = ELU(alpha), nn.ELU(alpha)
        assert torch.equal(fast(x), ref(x))  # eager: nn.ELU itself
        compiled = torch.compile(fast, backend="aot_eager", fullgraph=True)  # traced: the exp form
        exact = nn.functional.elu(x.double(), alpha)
        assert (compiled(x).double() - exact).abs().max() < 1e-7
        xa, xb = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
        compiled(xa).sum().backward()
        ref(xb).sum().backward()
        torch.testing.assert_close(xa.grad, xb.grad, atol=1e-7, rtol=1e-6)
        assert torch.isfinite(xa.grad).all()
    assert isinstance(MLP(4, [3], 2, "elu").net[2], nn.ELU)  # still an nn.ELU for isinstance checks


def test_the_mlp_with_batchnorm() -> None:
    """``MLP(norm="batch")``: a BatchNorm1d after each hidden Linear (280 more parameters on the paper's MLP), the
    plain MLP's names otherwise; FedBN keeps those BatchNorm layers on the client; other values are refused."""
    from lightning_fedmeta.algorithms.fedbn import normalisation_parameters

    plain, normed = MLP(), MLP(norm="batch")
    assert sum(p.numel() for p in normed.parameters()) - sum(p.numel() for p in plain.parameters()) == 2 * (80 + 60)
    assert [type(m) for m in normed.net] == [nn.Flatten, nn.Linear, nn.BatchNorm1d, type(plain.net[2]), nn.Linear,
                                             nn.BatchNorm1d, type(plain.net[4]), nn.Linear]
    assert sum(isinstance(m, nn.BatchNorm1d) for m in normed.modules()) == 2
    assert sorted(normalisation_parameters(normed)) == ["net.2.bias", "net.2.weight", "net.5.bias", "net.5.weight"]
    with pytest.raises(ValueError, match="norm must be null"):
        MLP(norm="layer")
