"""``compile_clients=True`` runs the same rounds as the eager batched path."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from lightning_fedmeta import FederatedModule
from tests.helpers import tiny_data


def _run(compile_clients: bool) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    torch.manual_seed(0)
    module = FederatedModule(
        model=nn.Linear(5, 3), algorithm={"name": "fedavg", "local_steps": 2, "batch_size": 4, "finetune_steps": 1},
        clients_per_round=3, compile_clients=compile_clients,
    )
    module.attach_data(tiny_data())
    opt = torch.optim.SGD(module.model.parameters(), lr=1.0)
    for r in range(2):
        module.engine.run_round(r, opt)
    correct = module.evaluate_clients(torch.arange(6), 2)["builtin"]
    return {k: v.detach().clone() for k, v in module.model.named_parameters()}, correct


@pytest.mark.spawns  # inductor runs the C++ compiler
def test_compiled_client_step_matches_the_eager_batched_path() -> None:
    eager_params, eager_correct = _run(False)
    compiled_params, compiled_correct = _run(True)
    for k in eager_params:
        torch.testing.assert_close(compiled_params[k], eager_params[k], atol=1e-6, rtol=1e-5)
    assert torch.equal(compiled_correct, eager_correct)



def test_a_step_dynamo_cannot_trace_falls_back_to_eager_with_the_same_numbers() -> None:
    """Per-FedAvg exact (forward-over-reverse HVP) is not traceable by dynamo on this torch."""

    def rounds(compile_clients: bool) -> dict[str, torch.Tensor]:
        torch.manual_seed(0)
        module = FederatedModule(
            model=nn.Linear(5, 3), clients_per_round=3, compile_clients=compile_clients,
            algorithm={"name": "perfedavg", "variant": "exact", "alpha": 0.1, "beta": 0.1, "local_steps": 2,
                       "batch_size": 4},
        )
        module.attach_data(tiny_data())
        _, out, weights = module.compute_round(0)
        return out.delta

    eager = rounds(False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled = rounds(True)
    fell_back = any("running it eagerly" in str(w.message) for w in caught)
    for k in eager:
        if fell_back:
            assert torch.equal(compiled[k], eager[k])
        else:  # a torch that can trace it: compiled numbers, same to rounding
            torch.testing.assert_close(compiled[k], eager[k], atol=1e-6, rtol=1e-5)
