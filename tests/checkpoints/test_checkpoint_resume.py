"""A run resumed from a Lightning checkpoint continues bit for bit (docs/design.md, contract 1)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn

from lightning_fedmeta import FederatedModule
from lightning_fedmeta.algorithms.base import Algorithm, ClientOutput, ClientRecord, started_from
from lightning_fedmeta.algorithms.local_steps import local_sgd
from lightning_fedmeta.client.functional import Batch, ClientContext, Params, tree_sub, tree_weighted_sum
from lightning_fedmeta.persistence.checksums import seal_checkpoint
from lightning_fedmeta.persistence.memory_store import flatten_state
from lightning_fedmeta.testing import check_algorithm
from tests.helpers import make_trainer, momentum_module, tiny_data, tiny_datamodule

SCAFFOLD = {"name": "scaffold", "local_lr": 0.2, "local_steps": 2, "batch_size": 4}


@pytest.mark.parametrize("eval_every", [2, 3], ids=["at-epoch-end", "mid-epoch"])
def test_resumed_run_is_bit_identical_to_uninterrupted_run(tmp_path: Path, eval_every: int) -> None:
    straight = momentum_module(SCAFFOLD)
    make_trainer(8).fit(straight, tiny_datamodule(eval_every=eval_every))

    ckpt = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=4, save_top_k=-1, save_last=True)
    first = momentum_module(SCAFFOLD)
    make_trainer(4, enable_checkpointing=True, callbacks=[ckpt]).fit(first, tiny_datamodule(eval_every=eval_every))
    path = tmp_path / "last.ckpt"
    assert path.exists()
    # plain values only: Trainer.fit(ckpt_path=...) loads with torch.load(weights_only=True)
    assert torch.load(path, weights_only=True)["global_step"] == 4

    resumed = momentum_module(SCAFFOLD, init_seed=123)  # different initial weights: they must come from the checkpoint
    trainer = make_trainer(8)
    trainer.fit(resumed, tiny_datamodule(eval_every=eval_every), ckpt_path=str(path))
    assert trainer.global_step == 8

    for k, v in straight.model.state_dict().items():
        assert torch.equal(resumed.model.state_dict()[k], v), k
    assert set(resumed.client_states.keys()) == {"c_i/weight", "c_i/bias"}
    for k, v in flatten_state(straight.client_states.tensors).items():
        assert torch.equal(flatten_state(resumed.client_states.tensors)[k], v), k
    for k, v in flatten_state(straight.server_state).items():
        assert torch.equal(flatten_state(resumed.server_state)[k], v), k
    assert straight.server_state["c"]["weight"].abs().sum() > 0
    # the interruption really happened: the 4-step model differs from the final one
    assert not torch.equal(first.model.weight, straight.model.weight)


def test_load_from_checkpoint_rebuilds_default_model_and_state(tmp_path: Path) -> None:
    module = FederatedModule(model=None, algorithm=SCAFFOLD, clients_per_round=2)
    trainer = make_trainer(2)
    trainer.fit(module, tiny_datamodule())
    path = tmp_path / "m.ckpt"
    trainer.save_checkpoint(path)

    loaded = FederatedModule.load_from_checkpoint(path)
    assert loaded.model is not None
    for k, v in module.model.state_dict().items():
        assert torch.equal(loaded.model.state_dict()[k], v), k
    for k, v in flatten_state(module.client_states.tensors).items():
        assert torch.equal(flatten_state(loaded.client_states.tensors)[k], v), k
    loaded.attach_data(tiny_data())  # keeps the loaded state rather than re-initialising it
    for k, v in flatten_state(module.client_states.tensors).items():
        assert torch.equal(flatten_state(loaded.client_states.tensors)[k], v), k


def test_load_from_checkpoint_with_a_custom_model_passed_again(tmp_path: Path) -> None:
    module = momentum_module(SCAFFOLD)
    trainer = make_trainer(2)
    trainer.fit(module, tiny_datamodule())
    path = tmp_path / "custom.ckpt"
    trainer.save_checkpoint(path)
    loaded = FederatedModule.load_from_checkpoint(path, model=nn.Linear(5, 3), weights_only=True)
    for k, v in module.model.state_dict().items():
        assert torch.equal(loaded.model.state_dict()[k], v), k
    assert loaded.hparams["algorithm"] == SCAFFOLD and loaded.hparams["clients_per_round"] == 3


def test_loading_a_foreign_checkpoint_names_the_problem() -> None:
    module = FederatedModule(model=nn.Linear(5, 3))
    with pytest.raises(ValueError, match="not written by lightning_fedmeta"):
        module.on_load_checkpoint({"state_dict": {}})


def test_testing_a_checkpoint_reproduces_the_validation_at_its_round(tmp_path: Path) -> None:
    """Evaluation draws (fine-tune batches) depend on the round: ``test(ckpt_path=...)`` must use the
    checkpoint's round, so it reports what validation reported at that round."""
    algorithm = {"name": "fedavg", "local_lr": 0.2, "local_steps": 2, "batch_size": 4,
                 "finetune_steps": 2, "finetune_batch_size": 2}
    module = momentum_module(algorithm)
    trainer = make_trainer(2)
    trainer.fit(module, tiny_datamodule(eval_every=2))
    val = dict(trainer.callback_metrics)
    path = tmp_path / "r2.ckpt"
    trainer.save_checkpoint(path)

    tester = make_trainer(1)
    tester.test(momentum_module(algorithm, init_seed=5), tiny_datamodule(eval_every=2), ckpt_path=str(path),
                verbose=False)
    for name in ("acc_weighted", "acc_mean", "loss_weighted"):
        torch.testing.assert_close(tester.callback_metrics[f"test/{name}"], val[f"val/{name}"])


def test_a_new_client_personalised_from_its_data_matches_the_held_out_evaluation(tmp_path) -> None:
    """personalize((x, y)) after load_from_checkpoint = the held-out client's evaluation model
    (full-batch adaptation, so both draw the same batch)."""
    dm = tiny_datamodule(eval_every=2)
    module = FederatedModule(
        model=torch.nn.Linear(5, 3), clients_per_round=2, holdout_clients=1,
        algorithm={"name": "fedavg", "finetune_steps": 2, "finetune_lr": 0.5, "finetune_batch_size": None},
    )
    ckpt = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    make_trainer(4, callbacks=[ckpt], enable_checkpointing=True, default_root_dir=tmp_path).fit(module, dm)
    held_out = int(module.holdout[0])
    by_index = module.personalize(held_out)
    loaded = FederatedModule.load_from_checkpoint(tmp_path / "last.ckpt", model=torch.nn.Linear(5, 3))
    x, y = dm.federated_data.client_train(held_out)
    by_data = loaded.personalize((x, y))
    for (name, a), (_, b) in zip(by_index.named_parameters(), by_data.named_parameters(), strict=True):
        torch.testing.assert_close(a, b, msg=name)
    with pytest.raises(ValueError, match="as many targets as inputs"):
        loaded.personalize((x, y[:1]))


# ----------------------------------------------------------------------------------------------
# nested state (issue 11): client state, server state and extras are pytrees, flattened only in the checkpoint
# ----------------------------------------------------------------------------------------------
class _NestedState(Algorithm):
    """Local SGD from a personal model kept as a parameter dict, with nested server state and extras."""

    name = "nested-state"

    def init_client_state(self, params: Params) -> dict[str, Any]:
        return {
            "personal": {k: v.detach().clone() for k, v in params.items()},
            "stats": {"rounds": torch.zeros((), dtype=torch.long)},
        }

    def init_server_state(self, params: Params) -> dict[str, Any]:
        return {"drift": {"sum": {k: torch.zeros_like(v) for k, v in params.items()}}, "rounds": torch.zeros(())}

    def client_update(self, ctx: ClientContext, params: Params, batches: Batch, state: dict[str, Any],
                      server_state: dict[str, Any], client: ClientRecord) -> ClientOutput:
        start = started_from(client, state["personal"], params)
        w, loss = local_sgd(ctx, start, batches, self.local_lr)
        return ClientOutput(
            delta=tree_sub(w, params),
            state={"personal": w, "stats": {"rounds": state["stats"]["rounds"] + 1}},
            extras={"drift": {"moved": tree_sub(w, start)}},
            metrics={"loss": loss},
        )

    def aggregate(self, params: Params, outputs: ClientOutput, weights: torch.Tensor, server_state: dict[str, Any],
                  clients: ClientRecord) -> tuple[Params, dict[str, Any]]:
        moved = tree_weighted_sum(outputs.extras["drift"]["moved"], weights)
        drift = {k: v + moved[k] for k, v in server_state["drift"]["sum"].items()}
        new_state = {"drift": {"sum": drift}, "rounds": server_state["rounds"] + 1}
        return tree_weighted_sum(outputs.delta, weights), new_state

    def personal_start(self, params: Params, state: dict[str, Any], server_state: dict[str, Any],
                       client: ClientRecord) -> Params:
        return started_from(client, state["personal"], params)


NESTED = _NestedState(local_steps=2, local_lr=0.2, batch_size=4)


def test_nested_state_algorithm_passes_check_algorithm() -> None:
    check_algorithm(NESTED)  # every check of CHECKS, bit-exact resume and bf16 included


def test_nested_state_resumes_bit_exact_and_is_saved_flat(tmp_path: Path) -> None:
    straight = momentum_module(NESTED)
    make_trainer(6).fit(straight, tiny_datamodule(eval_every=3))

    ckpt = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=3, save_last=True)
    first = momentum_module(NESTED)
    make_trainer(3, enable_checkpointing=True, callbacks=[ckpt]).fit(first, tiny_datamodule(eval_every=3))
    saved = torch.load(tmp_path / "last.ckpt", weights_only=True)["fedmeta"]
    # the checkpoint holds flat string keys, nested levels joined by "/"
    assert set(saved["engine"]["client_state"]) == {"personal/weight", "personal/bias", "stats/rounds"}
    assert set(saved["engine"]["server_state"]) == {"drift/sum/weight", "drift/sum/bias", "rounds"}
    assert int(saved["engine"]["client_state"]["stats/rounds"].sum()) == 3 * 3

    resumed = momentum_module(NESTED, init_seed=1)
    make_trainer(6).fit(resumed, tiny_datamodule(eval_every=3), ckpt_path=str(tmp_path / "last.ckpt"))
    assert isinstance(resumed.client_states.tensors["personal"], dict)
    assert isinstance(resumed.server_state["drift"]["sum"], dict)
    for k, v in straight.model.state_dict().items():
        assert torch.equal(resumed.model.state_dict()[k], v), k
    for name in ("client_states", "server_state"):
        ours = getattr(straight, name)
        theirs = getattr(resumed, name)
        ours, theirs = (t.tensors if name == "client_states" else t for t in (ours, theirs))
        assert flatten_state(ours).keys() == flatten_state(theirs).keys()
        for k, v in flatten_state(ours).items():
            assert torch.equal(flatten_state(theirs)[k], v) and flatten_state(theirs)[k].dtype == v.dtype, k
    assert torch.equal(straight.seen, resumed.seen)
    for k, v in straight.last_per_client.items():
        assert torch.equal(resumed.last_per_client[k], v), k


def test_a_flat_key_checkpoint_loads_as_flat_state(tmp_path: Path) -> None:
    """Checkpoints written before nested state (keys like ``c_i.weight``, no ``/``) load as the same flat dicts."""
    module = momentum_module(SCAFFOLD)
    trainer = make_trainer(2)
    trainer.fit(module, tiny_datamodule())
    path = tmp_path / "m.ckpt"
    trainer.save_checkpoint(path)
    checkpoint = torch.load(path, weights_only=True)
    flat_client = {"c_i.weight": torch.randn(6, 3, 5), "c_i.bias": torch.randn(6, 3)}
    flat_server = {"c.weight": torch.randn(3, 5), "c.bias": torch.randn(3)}
    checkpoint["fedmeta"]["engine"]["client_state"] = flat_client
    checkpoint["fedmeta"]["engine"]["server_state"] = flat_server
    seal_checkpoint(checkpoint)  # an edited checkpoint is re-sealed, or its checksum reports it damaged
    loaded = momentum_module(SCAFFOLD)
    loaded.on_load_checkpoint(checkpoint)
    assert set(loaded.client_states.tensors) == set(flat_client)
    assert set(loaded.server_state) == set(flat_server)
    for k, v in flat_client.items():
        assert torch.equal(loaded.client_states.tensors[k], v)
    for k, v in flat_server.items():
        assert torch.equal(loaded.server_state[k], v)
    again: dict[str, Any] = {}
    loaded.on_save_checkpoint(again)
    assert set(again["fedmeta"]["engine"]["client_state"]) == set(flat_client)
    assert set(again["fedmeta"]["engine"]["server_state"]) == set(flat_server)
