"""A LitGPT model with its own LoRA layers through ``FederatedModule`` unchanged (issue 40): ``litgpt.lora.GPT``
(a tiny config, nothing downloaded) after ``litgpt.lora.mark_only_lora_as_trainable``. Its rope caches (``cos``,
``sin``) are buffers shared by every client, its attention is PyTorch's SDPA; looped and batched clients agree, the
frozen base is bit-identical after training, no base tensor is exchanged, and a resumed run is bit-exact.

LitGPT is not an extra of the library: ``litgpt`` 0.5.13 pins ``jsonargparse<=4.41`` and ``huggingface-hub<1.4``,
older than what the library and ``transformers`` use, so ``pip install litgpt`` would downgrade them. The model code
these tests use needs none of those pins: ``pip install --no-deps litgpt`` (its remaining imports, ``lightning``,
``torch``, ``safetensors``, ``tokenizers``, ``huggingface_hub``, ``psutil``, are then whatever is installed).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

lora = pytest.importorskip("litgpt.lora", reason="pip install --no-deps litgpt (module docstring)")

from lightning_fedmeta import FederatedModule  # noqa: E402
from lightning_fedmeta.data.synthetic_tasks import make_synthetic_next_token  # noqa: E402
from lightning_fedmeta.loop.server import apply_server_step  # noqa: E402
from lightning_fedmeta.testing import (  # noqa: E402
    CHECKS,
    check_algorithm,
    check_loop_equals_vmap,
    check_resume_is_bit_exact,
)

VOCAB, T = 8, 6
FEDAVG = {"name": "fedavg", "local_steps": 2, "local_lr": 0.3}


def litgpt_lora() -> nn.Module:
    """A seeded 2-layer LitGPT with rank-4 adapters on the query and value projections, the rest frozen."""
    torch.manual_seed(0)
    config = lora.Config(n_layer=2, n_embd=16, n_head=2, vocab_size=VOCAB, padded_vocab_size=VOCAB, block_size=T,
                         lora_r=4, lora_alpha=8, lora_dropout=0.0, lora_query=True, lora_value=True)
    model = lora.GPT(config)
    lora.mark_only_lora_as_trainable(model)
    return model


@pytest.fixture(scope="module")
def data() -> Any:
    return make_synthetic_next_token(num_clients=7, vocab_size=VOCAB, seq_len=T, seed=0)


def test_litgpt_lora_model_runs_looped_and_batched_alike(data: Any) -> None:
    model = litgpt_lora()
    assert {n for n, _ in model.named_buffers()} >= {"cos", "sin"}  # the rope caches
    check_loop_equals_vmap(FEDAVG, model=litgpt_lora, data=data, clients_per_round=3, holdout_clients=1, rounds=1)


def test_litgpt_uploads_no_base_tensor_and_resumes_bit_exactly(data: Any) -> None:
    check_algorithm(FEDAVG, model=litgpt_lora, data=data, clients_per_round=3, holdout_clients=1,
                    skip=[c for c in CHECKS if c != "check_exchange"])
    check_resume_is_bit_exact(FEDAVG, model=litgpt_lora, data=data, clients_per_round=3, holdout_clients=1,
                              rounds=2, resume_at=1, eval_every=1)


def test_litgpt_base_is_bit_identical_after_training(data: Any) -> None:
    module = FederatedModule(model=litgpt_lora(), algorithm=FEDAVG, clients_per_round=3, seed=1,
                             compile_clients=False)
    module.attach_data(data)
    model = module.model
    assert module.engine.batching == "vmap"
    base = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    adapters = [n for n, p in model.named_parameters() if p.requires_grad]
    assert adapters and all(n.endswith(("lora_A", "lora_B")) for n in adapters)
    assert list(module.engine.global_params()) == adapters
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    for r in range(2):
        result = module.engine.compute(r)
        uploads = module.engine.combine(result)
        apply_server_step(optimizer, model, uploads.update.delta)
        module.engine.commit(result, uploads.update.server_state)
    for n, p in model.named_parameters():
        if n in base:
            assert torch.equal(p, base[n]), f"the frozen {n} changed"
