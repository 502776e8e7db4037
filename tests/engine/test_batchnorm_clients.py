"""BatchNorm running statistics are client state: each client trains and is evaluated with its own.

The module's own buffers are the round-weighted mean of the statistics the last round's clients
returned, and clients that never trained use those. Everything is checked against PyTorch's own
BatchNorm in eval mode (the personalised ``nn.Module`` carries the client's statistics).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor, nn

from lightning_fedmeta import FederatedModule, from_client_tensors
from lightning_fedmeta.data import FederatedDataModule
from tests.helpers import fit, make_tiny_clients, make_trainer


class BNNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(5, 8), nn.BatchNorm1d(8), nn.Tanh())
        self.head = nn.Linear(8, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.body(x))


class Clients:
    num_classes = 3

    def client_data(self) -> list[tuple[Tensor, ...]]:
        clients = make_tiny_clients(6, train_sizes=[5, 9, 14, 20, 7, 11])
        # shift each client's inputs: per-client statistics differ
        return [(x + 2.0 * i, y, xt + 2.0 * i, yt) for i, (x, y, xt, yt) in enumerate(clients)]


def _module(batching: str = "auto", algorithm: dict | None = None) -> FederatedModule:
    algorithm = algorithm or {"name": "fedavg", "local_steps": 3, "local_lr": 0.1, "batch_size": 4,
                              "finetune_steps": 1, "finetune_lr": 0.1}
    return FederatedModule(BNNet(), algorithm, clients_per_round=3, client_batching=batching, holdout_clients=1)


def _fit(module: FederatedModule, rounds: int = 4, **kwargs: object) -> FederatedModule:
    return fit(module, FederatedDataModule(dataset=Clients(), eval_every=2), rounds, **kwargs)


def test_each_client_is_evaluated_with_its_own_running_statistics() -> None:
    module = _fit(_module())
    assert module.seen is not None
    stats = module.client_buffers.tensors["body.1.running_mean"]
    trained = module.seen.nonzero().flatten()
    assert trained.numel() >= 2 and not torch.allclose(stats[trained[0]], stats[trained[1]])
    for i in range(6):
        personal = module.personalize(i)  # a plain nn.Module in eval mode: PyTorch's BatchNorm
        expected = stats[i] if module.seen[i] else dict(module.model.named_buffers())["body.1.running_mean"]
        torch.testing.assert_close(personal.body[1].running_mean, expected)
        x, y = module.data.client_test(i)
        with torch.no_grad():
            acc = float((personal(x).argmax(1) == y).double().mean())
        assert abs(acc - float(module.last_per_client["acc"][i])) < 1e-6, i


def test_module_statistics_are_the_round_weighted_mean_of_the_clients() -> None:
    module = FederatedModule(BNNet(), {"name": "fedavg", "local_steps": 2, "local_lr": 0.1, "batch_size": 4},
                             clients_per_round=3)
    module.attach_data(from_client_tensors(Clients().client_data(), 3))
    result = module.engine.compute(0)
    sampled, out, weights = result
    buffers = result.buffers
    module.commit_round(sampled, out, module.server_state)
    own = dict(module.model.named_buffers())
    expected = (weights[:, None] * buffers["body.1.running_var"]).sum(0)
    torch.testing.assert_close(own["body.1.running_var"], expected)
    stored = module.client_buffers.tensors["body.1.running_var"][sampled]
    torch.testing.assert_close(stored, buffers["body.1.running_var"])
    assert int(own["body.1.num_batches_tracked"]) == 2  # two local steps, one forward each


def test_loop_and_vmap_give_the_same_models_and_statistics() -> None:
    runs = {mode: _fit(_module(mode), rounds=3) for mode in ("loop", "vmap")}
    for name, value in runs["loop"].client_buffers.tensors.items():
        torch.testing.assert_close(runs["vmap"].client_buffers.tensors[name].double(), value.double(), atol=1e-5,
                                   rtol=1e-5)
    for name, value in runs["loop"]._global_params().items():
        torch.testing.assert_close(runs["vmap"]._global_params()[name], value, atol=1e-5, rtol=1e-5)


def test_a_resumed_run_has_bit_identical_statistics(tmp_path: Path) -> None:
    straight = _fit(_module(), rounds=4)
    first = _module()
    trainer = make_trainer(2)
    trainer.fit(first, FederatedDataModule(dataset=Clients(), eval_every=2))
    trainer.save_checkpoint(tmp_path / "half.ckpt")
    resumed = _module()
    make_trainer(4).fit(resumed, FederatedDataModule(dataset=Clients(), eval_every=2),
                        ckpt_path=str(tmp_path / "half.ckpt"))
    for name, value in straight.client_buffers.tensors.items():
        assert torch.equal(resumed.client_buffers.tensors[name], value), name
    for name, value in dict(straight.model.named_buffers()).items():
        assert torch.equal(dict(resumed.model.named_buffers())[name], value), name
    assert torch.equal(resumed.last_per_client["acc"], straight.last_per_client["acc"])
