"""Bring your own task: any per-sample loss, any torchmetrics metric kept per client, targets of any shape.

Every number the module reports is recomputed here by hand from the personalised models
(``module.personalize(i)``) and the clients' test data, with unequal client sizes.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torchmetrics.classification import MulticlassAccuracy, MulticlassF1Score
from torchmetrics.regression import MeanSquaredError

from lightning_fedmeta import FederatedModule, from_client_tensors
from lightning_fedmeta.client.functional import Batch, ClientContext
from lightning_fedmeta.client.losses import LOSSES, resolve_loss
from lightning_fedmeta.data import FederatedDataModule
from lightning_fedmeta.evaluation.metrics import ClientMetrics, summarize
from tests.conftest import run_plain_rounds
from tests.helpers import REPO, make_trainer

SIZES = [7, 12, 20, 9, 30, 5]  # unequal clients
TEST_SIZES = [4, 9, 3, 6, 11, 5]


def regression_clients(target_dim: int = 1, seed: int = 0) -> list[tuple[Tensor, ...]]:
    """Linear regression clients with client-specific weights (heterogeneous), unequal sizes."""
    g = torch.Generator().manual_seed(seed)
    shared = torch.randn(4, target_dim, generator=g)
    clients = []
    for i, (n, m) in enumerate(zip(SIZES, TEST_SIZES, strict=True)):
        w = shared + 0.5 * torch.randn(4, target_dim, generator=g)
        x = torch.randn(n + m, 4, generator=g) + 0.3 * i
        y = x @ w + 0.1 * torch.randn(n + m, target_dim, generator=g)
        y = y.squeeze(1) if target_dim == 1 else y
        clients.append((x[:n], y[:n], x[n:], y[n:]))
    return clients


def classification_clients(num_classes: int = 3, seed: int = 0) -> list[tuple[Tensor, ...]]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(4, num_classes, generator=g)
    clients = []
    for i, (n, m) in enumerate(zip(SIZES, TEST_SIZES, strict=True)):
        x = torch.randn(n + m, 4, generator=g) + 0.4 * (i % 3)
        y = (x @ w + 0.5 * torch.randn(n + m, num_classes, generator=g)).argmax(1)
        clients.append((x[:n], y[:n], x[n:], y[n:]))
    return clients


class Dataset:
    """A user dataset following the FederatedDataset protocol."""

    def __init__(self, clients: list[tuple[Tensor, ...]], num_classes: int | None, task: str | None = None) -> None:
        self.clients, self.num_classes = clients, num_classes
        if task is not None:
            self.task = task

    def client_data(self) -> list[tuple[Tensor, ...]]:
        return self.clients


class Squeeze(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return x.squeeze(-1)


def fit(module: FederatedModule, dataset: Dataset, rounds: int = 4, **trainer: object) -> FederatedModule:
    dm = FederatedDataModule(dataset=dataset, eval_every=2)  # type: ignore[arg-type]
    make_trainer(rounds, **trainer).fit(module, dm)
    return module


# ----------------------------------------------------------------------------------------------
# losses
# ----------------------------------------------------------------------------------------------
def test_named_losses_equal_torchs_own_per_sample_values() -> None:
    g = torch.Generator().manual_seed(0)
    z, y_cls = torch.randn(5, 3, generator=g), torch.tensor([0, 2, 1, 1, 0])
    r, t = torch.randn(5, 2, generator=g), torch.randn(5, 2, generator=g)
    b = (torch.rand(5, 2, generator=g) > 0.5).float()
    torch.testing.assert_close(LOSSES["cross_entropy"](z, y_cls), F.cross_entropy(z, y_cls, reduction="none"))
    torch.testing.assert_close(LOSSES["nll"](z.log_softmax(1), y_cls), F.nll_loss(z.log_softmax(1), y_cls,
                                                                                    reduction="none"))
    torch.testing.assert_close(LOSSES["mse"](r, t), ((r - t) ** 2).mean(1))
    torch.testing.assert_close(LOSSES["l1"](r, t), (r - t).abs().mean(1))
    torch.testing.assert_close(LOSSES["huber"](r, t), F.huber_loss(r, t, reduction="none").mean(1))
    torch.testing.assert_close(LOSSES["smooth_l1"](r, t), F.smooth_l1_loss(r, t, reduction="none").mean(1))
    torch.testing.assert_close(LOSSES["bce_with_logits"](r, b),
                               F.binary_cross_entropy_with_logits(r, b, reduction="none").mean(1))
    # sequences: [B, T, V] scores, [B, T] tokens -> the mean over positions
    seq, tok = torch.randn(2, 4, 6, generator=g), torch.randint(0, 6, (2, 4), generator=g)
    ref = F.cross_entropy(seq.transpose(1, 2), tok, reduction="none").mean(1)
    torch.testing.assert_close(LOSSES["cross_entropy"](seq, tok), ref)
    # a [B, 1] output for scalar targets is accepted
    torch.testing.assert_close(LOSSES["mse"](r[:, :1], t[:, 0]), (r[:, 0] - t[:, 0]) ** 2)


def test_a_torch_loss_module_is_used_per_sample_whatever_its_reduction() -> None:
    loss = resolve_loss(nn.MSELoss(), "regression")  # reduction="mean" by default: must not average the batch
    r, t = torch.randn(5, 3), torch.randn(5, 3)
    torch.testing.assert_close(loss(r, t), ((r - t) ** 2).mean(1))


def test_the_client_loss_is_the_masked_mean_its_docstring_states() -> None:
    """f(w; D) = Σ_j m_j ℓ_j / Σ_j m_j: padding rows (m_j = 0) change nothing."""
    model = nn.Linear(3, 2)
    ctx = ClientContext(model, per_sample_loss=LOSSES["mse"])
    params = {k: v.detach() for k, v in model.named_parameters()}
    x, y = torch.randn(6, 3), torch.randn(6, 2)
    mask = torch.tensor([1.0, 1, 0, 1, 0, 1])
    real = mask.bool()
    expected = ((model(x[real]) - y[real]) ** 2).mean()
    torch.testing.assert_close(ctx.loss(params, Batch(x, y, mask)), expected.detach())
    y_bad = y.clone()
    y_bad[~real] = 1e6  # padding targets never matter
    torch.testing.assert_close(ctx.loss(params, Batch(x, y_bad, mask)), expected.detach())


# ----------------------------------------------------------------------------------------------
# regression end to end
# ----------------------------------------------------------------------------------------------
def test_fedavg_regression_round_is_gradient_descent_on_the_sample_weighted_mse() -> None:
    """One local full-batch step per round, every client, server lr 1: w ← w − η Σ_i p_i ∇f_i(w) with
    f_i(w) = (1/n_i) Σ_j (wᵀx_j + b − y_j)² and p_i = n_i / n (computed by hand in float64)."""
    clients = regression_clients()
    data = from_client_tensors(clients, None)
    assert data.task == "regression" and data.train_y.dtype == torch.float32
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 1), Squeeze())
    lr = 0.05
    module = FederatedModule(model, {"name": "fedavg", "local_steps": 1, "local_lr": lr, "batch_size": None},
                             clients_per_round=len(SIZES), loss="mse")
    module.attach_data(data)
    w = {k: v.detach().double().clone() for k, v in model.named_parameters()}
    n = torch.tensor(SIZES, dtype=torch.float64)
    run_plain_rounds(module, 3)
    for _ in range(3):
        grads = {k: torch.zeros_like(v) for k, v in w.items()}
        for (x, y, _, _), n_i in zip(clients, n, strict=True):
            p = {k: v.clone().requires_grad_() for k, v in w.items()}
            f_i = ((x.double() @ p["0.weight"].T + p["0.bias"]).squeeze(1) - y.double()).pow(2).mean()
            for k, g_k in zip(p, torch.autograd.grad(f_i, list(p.values())), strict=True):
                grads[k] += n_i / n.sum() * g_k
        w = {k: v - lr * grads[k] for k, v in w.items()}
    for k, v in module._global_params().items():
        torch.testing.assert_close(v.double(), w[k], atol=1e-5, rtol=1e-5)


def test_regression_metrics_are_the_personalised_models_errors_worst_decile_is_the_largest() -> None:
    model = nn.Sequential(nn.Linear(4, 1), Squeeze())
    module = FederatedModule(model, {"name": "fedavg", "local_steps": 2, "local_lr": 0.05, "batch_size": 4,
                                     "finetune_steps": 1, "finetune_lr": 0.05},
                             clients_per_round=3, loss="mse", metrics={"mae": "mae", "rmse": "rmse"})
    fit(module, Dataset(regression_clients(), None))
    pc = module.last_per_client
    assert list(module.metric_directions) == ["mae", "rmse", "loss"]
    assert module.metric_directions == {"mae": False, "rmse": False, "loss": False}
    for i in range(len(SIZES)):
        x, y = module.data.client_test(i)
        with torch.no_grad():
            err = module.personalize(i)(x) - y
        assert float(pc["mae"][i]) == pytest.approx(float(err.abs().mean()), rel=1e-5)
        assert float(pc["rmse"][i]) == pytest.approx(float(err.pow(2).mean().sqrt()), rel=1e-5)
        assert float(pc["loss"][i]) == pytest.approx(float(err.pow(2).mean()), rel=1e-5)
    summary = module.last_summary["clients"]
    n = torch.tensor(TEST_SIZES, dtype=torch.float64)
    assert float(summary["mae_weighted"]) == pytest.approx(float((n * pc["mae"]).sum() / n.sum()), rel=1e-9)
    assert float(summary["mae_mean"]) == pytest.approx(float(pc["mae"].mean()), rel=1e-9)
    assert float(summary["mae_worst10"]) == pytest.approx(float(pc["mae"].max()), rel=1e-9)  # ⌈6/10⌉ = 1 client
    assert float(summary["rmse_worst10"]) == pytest.approx(float(pc["rmse"].max()), rel=1e-9)


def test_vector_targets_regression_runs_batched_and_looped_alike() -> None:
    results = {}
    for mode in ("vmap", "loop"):
        torch.manual_seed(0)
        module = FederatedModule(nn.Linear(4, 3), {"name": "perfedavg", "variant": "hf", "local_steps": 2},
                                 clients_per_round=3,
                                 client_batching=mode)
        fit(module, Dataset(regression_clients(target_dim=3), None), rounds=2)
        assert module.per_sample_loss is LOSSES["mse"] and module.primary_metric == "mae"
        results[mode] = module
    for k, v in results["vmap"]._global_params().items():
        torch.testing.assert_close(v, results["loop"]._global_params()[k], atol=1e-6, rtol=1e-6)


# ----------------------------------------------------------------------------------------------
# torchmetrics, per client
# ----------------------------------------------------------------------------------------------
def test_a_torchmetrics_metric_is_kept_per_client_and_equals_it_computed_directly() -> None:
    f1 = MulticlassF1Score(num_classes=3, average="macro")
    module = FederatedModule(nn.Linear(4, 3), {"name": "fedavg", "local_steps": 2, "local_lr": 0.1,
                                               "finetune_steps": 1, "finetune_lr": 0.1},
                             clients_per_round=3, metrics={"acc": "accuracy", "f1": f1}, holdout_clients=2)
    trainer = make_trainer(4)
    trainer.fit(module, FederatedDataModule(dataset=Dataset(classification_clients(), 3), eval_every=2))
    pc = module.last_per_client
    for i in range(len(SIZES)):
        x, y = module.data.client_test(i)
        with torch.no_grad():
            logits = module.personalize(i)(x)
        direct = MulticlassF1Score(num_classes=3, average="macro")(logits, y)
        assert float(pc["f1"][i]) == pytest.approx(float(direct), abs=1e-6)
        assert float(pc["acc"][i]) == pytest.approx(float((logits.argmax(1) == y).double().mean()), abs=1e-9)
    logged = trainer.callback_metrics
    for group, idx in (("val", module.eligible), ("val/new", module.holdout)):
        expect = summarize(pc["f1"][idx], pc["total"][idx], True)
        for stat in ("weighted", "mean", "worst10"):
            assert float(logged[f"{group}/f1_{stat}"]) == pytest.approx(float(expect[stat]), abs=1e-6)
    assert f1.update_count == 0  # the user's metric object is a template, never updated itself


def test_metric_states_are_checkpointed_and_restore_the_same_per_client_values(tmp_path: Path) -> None:
    def make() -> FederatedModule:
        torch.manual_seed(0)
        return FederatedModule(nn.Linear(4, 3), {"name": "fedavg", "local_steps": 2, "local_lr": 0.1},
                               clients_per_round=3, metrics={"acc": MulticlassAccuracy(num_classes=3, average="micro"),
                                                             "top": "accuracy"})

    dataset = Dataset(classification_clients(), 3)
    module = make()
    trainer = make_trainer(4)
    trainer.fit(module, FederatedDataModule(dataset=dataset, eval_every=2))
    path = tmp_path / "run.ckpt"
    trainer.save_checkpoint(path)
    saved = torch.load(path, weights_only=True)["fedmeta"]["evaluator"]["metric_state"]
    assert saved["torchmetrics/acc/tp"].shape[0] == len(SIZES)  # one state row per client
    restored = make()
    restored.attach_data(from_client_tensors(classification_clients(), 3))
    restored.on_load_checkpoint(torch.load(path, weights_only=True))
    for key in ("acc", "top", "loss", "total"):
        assert torch.equal(restored.last_per_client[key], module.last_per_client[key]), key
    # the micro accuracy and the built-in accuracy are the same number per client
    torch.testing.assert_close(module.last_per_client["acc"], module.last_per_client["top"])


def test_client_metrics_combine_across_processes_exactly_whatever_the_metric_reduction() -> None:
    """Two "ranks" each evaluate half the clients; the zero-filled sum gives both every client's state."""
    clients = classification_clients()
    specs = {"f1": MulticlassF1Score(num_classes=3, average="macro"), "acc": "accuracy"}
    ranks = [ClientMetrics(specs, 6), ClientMetrics(specs, 6)]
    single = ClientMetrics(specs, 6)
    g = torch.Generator().manual_seed(1)
    for c, (_, _, x, y) in enumerate(clients):
        logits = torch.randn(x.shape[0], 3, generator=g)
        correct = (logits.argmax(1) == y).double().sum().reshape(1, 1)
        sums = {"total": torch.tensor([float(y.numel())]), "loss_sum": torch.tensor([1.0]), "builtin": correct}
        for target in (single, ranks[c % 2]):
            target.update(torch.tensor([c]), sums)
            target.update_outputs(torch.tensor([c]), logits[None], y[None], torch.ones(1, y.numel()))
    zero_filled = []
    for r, metric in enumerate(ranks):  # what each rank contributes to the all-reduce: its own rows only
        keep = torch.zeros(6, dtype=torch.bool)
        keep[r::2] = True
        zero_filled.append({k: torch.where(keep.reshape(-1, *([1] * (v.dim() - 1))), v, torch.zeros_like(v))
                            for k, v in metric.state_dict().items()})
    summed = [zero_filled[0][k] + zero_filled[1][k] for k in zero_filled[0]]
    for r, metric in enumerate(ranks):
        contributions = iter(zip(zero_filled[r].values(), summed, strict=True))

        def all_reduce(t: Tensor, _it: object = contributions) -> Tensor:
            own, total = next(_it)  # type: ignore[call-overload]
            assert torch.equal(t, own)  # the rank sends exactly its zero-filled rows
            return total

        metric.sync(torch.arange(r, 6, 2), all_reduce)
    for metric in ranks:
        for key, value in single.per_client().items():
            torch.testing.assert_close(metric.per_client()[key], value)


# ----------------------------------------------------------------------------------------------
# multi-label and next-token
# ----------------------------------------------------------------------------------------------
def test_multilabel_defaults_to_bce_with_logits_and_per_label_accuracy() -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(4, 5, generator=g)
    clients = []
    for n, m in zip(SIZES, TEST_SIZES, strict=True):
        x = torch.randn(n + m, 4, generator=g)
        y = (x @ w > 0).float()
        clients.append((x[:n], y[:n], x[n:], y[n:]))
    module = FederatedModule(nn.Linear(4, 5), {"name": "fedavg", "local_steps": 2, "local_lr": 0.5},
                             clients_per_round=3)
    fit(module, Dataset(clients, 5, task="multilabel"))
    assert module.per_sample_loss is LOSSES["bce_with_logits"]
    for i in range(len(SIZES)):
        x, y = module.data.client_test(i)
        with torch.no_grad():
            z = module.personalize(i)(x)
        per_label = ((z > 0) == (y > 0.5)).double().mean()
        assert float(module.last_per_client["acc"][i]) == pytest.approx(float(per_label), abs=1e-6)
        bce = F.binary_cross_entropy_with_logits(z, y, reduction="none").mean(1).mean()
        assert float(module.last_per_client["loss"][i]) == pytest.approx(float(bce), rel=1e-5)


class TokenModel(nn.Module):
    """Embedding and a linear head: ``[B, T]`` tokens -> ``[B, T, V]`` next-token scores."""

    def __init__(self, vocab: int = 6) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, 8)
        self.head = nn.Linear(8, vocab)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.tanh(self.embed(x)))


def test_next_token_sequences_token_accuracy_and_perplexity() -> None:
    g = torch.Generator().manual_seed(0)
    clients = []
    for i, (n, m) in enumerate(zip(SIZES, TEST_SIZES, strict=True)):
        tokens = torch.randint(0, 6, (n + m, 5), generator=g)
        nxt = (tokens + 1 + i % 2) % 6  # each client's rule: the next token is +1 or +2
        clients.append((tokens[:n], nxt[:n], tokens[n:], nxt[n:]))
    data = from_client_tensors(clients, 6)
    assert data.task == "next_token" and data.train_x.dtype == torch.long
    module = FederatedModule(TokenModel(), {"name": "fedavg", "local_steps": 3, "local_lr": 0.5,
                                            "finetune_steps": 2, "finetune_lr": 0.5},
                             clients_per_round=3, metrics={"acc": "accuracy", "ppl": "perplexity"})
    fit(module, Dataset(clients, 6), rounds=6)
    pc = module.last_per_client
    for i in range(len(SIZES)):
        x, y = module.data.client_test(i)
        with torch.no_grad():
            z = module.personalize(i)(x)
        ce = F.cross_entropy(z.reshape(-1, 6), y.reshape(-1))
        assert float(pc["acc"][i]) == pytest.approx(float((z.argmax(-1) == y).double().mean()), abs=1e-6)
        assert float(pc["ppl"][i]) == pytest.approx(math.exp(float(ce)), rel=1e-5)
    assert module.metric_directions["ppl"] is False


# ----------------------------------------------------------------------------------------------
# hooks and bad input
# ----------------------------------------------------------------------------------------------
class HookedModel(nn.Linear):
    """A model carrying its own loss (the LightningModule-style hook)."""

    calls = 0

    def federated_loss(self, outputs: Tensor, targets: Tensor) -> Tensor:
        HookedModel.calls += 1
        return F.cross_entropy(outputs, targets, reduction="none", label_smoothing=0.1)


def test_the_models_federated_loss_hook_is_used_when_no_loss_is_given() -> None:
    module = FederatedModule(HookedModel(4, 3), {"name": "fedavg", "local_steps": 1}, clients_per_round=2)
    module.attach_data(from_client_tensors(classification_clients(), 3))
    logits, y = torch.randn(4, 3), torch.tensor([0, 1, 2, 0])
    torch.testing.assert_close(module.per_sample_loss(logits, y),
                               F.cross_entropy(logits, y, reduction="none", label_smoothing=0.1))
    assert HookedModel.calls > 0  # used by the setup check already


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"loss": "crossentropy"}, "unknown loss 'crossentropy'"),
        ({"loss": "no_such_package.loss"}, "neither a built-in loss"),
        ({"metrics": {"acc": "acuracy"}}, "unknown built-in metric 'acuracy'"),
        ({"metrics": {}}, "non-empty mapping"),
        ({"metrics": {"loss": "accuracy"}}, "not 'loss'"),
    ],
)
def test_bad_loss_and_metric_arguments_fail_at_construction(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        FederatedModule(**kwargs)


def test_a_metric_with_a_list_state_or_no_direction_is_refused_with_the_fix() -> None:
    from torchmetrics import MeanMetric
    from torchmetrics.classification import BinaryAUROC

    with pytest.raises(ValueError, match="thresholds"):
        FederatedModule(metrics={"auc": BinaryAUROC()})
    with pytest.raises(ValueError, match="higher_is_better"):
        FederatedModule(metrics={"m": MeanMetric()})
    FederatedModule(metrics={"auc": BinaryAUROC(thresholds=10)})  # the binned form is accepted


def test_a_loss_that_averages_the_batch_is_refused_before_training() -> None:
    module = FederatedModule(nn.Linear(4, 3), "fedavg", clients_per_round=2,
                             loss=lambda z, y: F.cross_entropy(z, y))  # one number, not one per sample
    with pytest.raises(ValueError, match=r"one value per sample"):
        module.attach_data(from_client_tensors(classification_clients(), 3))


def test_a_loss_that_cannot_take_the_targets_is_named() -> None:
    module = FederatedModule(nn.Linear(4, 3), "fedavg", clients_per_round=2, loss="mse")
    with pytest.raises(ValueError, match="the loss 'mse' cannot take the model's outputs"):
        module.attach_data(from_client_tensors(classification_clients(), 3))


def test_torch_loss_module_metric_and_named_loss_in_one_run_log_their_names() -> None:
    module = FederatedModule(nn.Sequential(nn.Linear(4, 1), Squeeze()), {"name": "fedavg", "local_steps": 1},
                             clients_per_round=2, loss=nn.HuberLoss(), metrics={"mse": MeanSquaredError()})
    trainer = make_trainer(2)
    trainer.fit(module, FederatedDataModule(dataset=Dataset(regression_clients(), None), eval_every=2))
    assert {"val/mse_weighted", "val/mse_mean", "val/mse_worst10", "val/loss_weighted"} <= set(trainer.callback_metrics)
    assert "loss" not in module.hparams  # a module object is not stored as a hyper-parameter


def test_clients_with_an_undefined_metric_are_left_out_of_its_summaries() -> None:
    values = torch.tensor([0.5, math.nan, 0.9, 0.1], dtype=torch.float64)
    counts = torch.tensor([10.0, 5.0, 30.0, 20.0], dtype=torch.float64)
    out = summarize(values, counts, higher_is_better=True)
    assert float(out["weighted"]) == pytest.approx((5 + 27 + 2) / 60)
    assert float(out["mean"]) == pytest.approx(0.5)
    assert float(out["worst10"]) == pytest.approx(0.1)
    assert math.isnan(float(summarize(torch.full((3,), math.nan), counts[:3], True)["mean"]))


# ----------------------------------------------------------------------------------------------
# every task from the command line, with its config in configs/tasks/
# ----------------------------------------------------------------------------------------------
TASK_CONFIGS = {
    "classification": ("acc", True), "regression": ("mae", False), "multilabel": ("acc", True),
    "next_token": ("acc", True),
}


@pytest.mark.parametrize("task", sorted(TASK_CONFIGS))
def test_each_task_config_runs_from_the_cli_and_logs_its_metrics(task: str, tmp_path: Path) -> None:
    from lightning_fedmeta.cli import run
    from lightning_fedmeta.frontends.callbacks import read_history

    root = REPO
    cli = run(["fit", "--config", str(root / "configs" / "tasks" / f"{task}.yaml"), "--trainer.max_steps", "2",
               "--data.eval_every", "2", "--data.num_clients", "6", "--model.clients_per_round", "3",
               "--trainer.default_root_dir", str(tmp_path), "--trainer.enable_progress_bar", "false"])
    module = cli.model  # type: ignore[attr-defined]
    primary, higher = TASK_CONFIGS[task]
    assert module.data.task == task and module.primary_metric == primary
    assert module.metric_directions[primary] is higher
    assert f"val/{primary}_worst10" in cli.trainer.callback_metrics  # type: ignore[attr-defined]
    history = read_history(next(tmp_path.rglob("fedmeta_history.json")))
    assert history["primary_metric"] == primary and history["higher_is_better"] is higher
    checkpoint = torch.load(next(tmp_path.rglob("*.ckpt")), weights_only=True)
    assert checkpoint["fedmeta"]["evaluator"]["metric_state"]["total"].shape == (6,)
