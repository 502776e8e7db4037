"""A Hugging Face ``transformers`` causal LM with ``peft`` LoRA adapters through the Flower apps (issue 40): the
deployment of a YAML config naming :class:`~lightning_fedmeta.models.HuggingFaceCausalLM` (a tiny GPT-2 from its
configuration, nothing downloaded) trains the adapters alone. Every message, down and up, carries adapter tensors
only (each node builds the same frozen base from the config's seed), FedSA-LoRA's personal ``lora_B`` stays on the
nodes, and the run equals the in-process ``FederatedModule`` run of the same config.

The deployment runs in this process (the ClientApp's handlers called by the in-process grid of
``tests/frontends/test_flower.py``).
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("flwr", reason="flwr is not installed (pip install lightning-fedmeta[flower])")
pytest.importorskip("transformers", reason="pip install 'lightning-fedmeta[llm]'")
pytest.importorskip("peft", reason="pip install 'lightning-fedmeta[llm]'")

from flwr.app import Message  # noqa: E402

import tests.frontends.test_flower as flower_tests  # noqa: E402
from lightning_fedmeta.flower import ClientStateFile  # noqa: E402
from lightning_fedmeta.models import HuggingFaceCausalLM  # noqa: E402
from tests.frontends.test_flower import (  # noqa: E402
    NUM_CLIENTS,
    PER_ROUND,
    ROUNDS,
    InProcessGrid,
    deployed,
    in_process,
    max_diff,
    task_identity,  # noqa: F401 - the autouse fixture that lets Messages be built outside a Flower process
)


class RecordingGrid(InProcessGrid):
    """The in-process grid, keeping every train message and its reply."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.train: list[tuple[Message, Message]] = []

    def push_messages(self, messages: Any) -> list[str]:
        messages = list(messages)
        ids = super().push_messages(messages)
        for msg, mid in zip(messages, ids, strict=True):
            if msg.metadata.message_type == "train":
                self.train.append((msg, self.replies[mid]))
        return ids


def write_config(tmp: Path) -> Path:
    """The Flower tests' federation shape (5 nodes, 3 a round, 3 rounds) on next-token data with a peft GPT-2."""
    path = tmp / "fedmeta.yaml"
    path.write_text(textwrap.dedent(f"""\
        seed_everything: 3
        trainer: {{max_steps: {ROUNDS}}}
        model:
          algorithm: {{name: fedsa_lora, local_lr: 1.0, local_steps: 3, batch_size: 8}}
          clients_per_round: {PER_ROUND}
          server_lr: 0.7
          seed: 11
          loss: cross_entropy
          metrics: {{acc: accuracy}}
          model:
            class_path: lightning_fedmeta.models.HuggingFaceCausalLM
            init_args:
              model_type: gpt2
              config: {{n_layer: 1, n_embd: 16, n_head: 2, vocab_size: 16, n_positions: 20, resid_pdrop: 0.0,
                        embd_pdrop: 0.0, attn_pdrop: 0.0, bos_token_id: 0, eos_token_id: 0,
                        initializer_range: 0.2}}
              lora: {{r: 2, lora_alpha: 4, target_modules: [c_attn], lora_dropout: 0.0, fan_in_fan_out: true}}
        data: {{dataset: synthetic_next_token, num_clients: {NUM_CLIENTS}, eval_every: 100}}
        """))
    return path


def test_deployment_of_a_peft_model_exchanges_the_adapters_only_and_equals_in_process(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg_path = write_config(tmp_path)
    reference = in_process(cfg_path)
    monkeypatch.setattr(flower_tests, "InProcessGrid", RecordingGrid)
    # FedSA-LoRA's aggregate reads no client state: the node keeps its B (node config upload-client-state=false)
    server, grid = deployed(cfg_path, tmp_path, node_config={"upload-client-state": False})
    model = reference.model
    assert isinstance(model, HuggingFaceCausalLM) and isinstance(server.model, HuggingFaceCausalLM)
    adapters = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    b = {n for n in adapters if n.endswith("lora_B.default.weight")}
    assert len(adapters) == 2 * len(b) == 2 and frozen
    # the global model: the adapters, trained, equal to the in-process run; the base bit-identical on both sides
    assert sorted(server.params()) == sorted(adapters) == sorted(server.init_params)
    assert max_diff(adapters, server.init_params) > 1e-4
    assert max_diff(adapters, server.params()) < 1e-5
    base = {n: p.detach() for n, p in model.named_parameters() if not p.requires_grad}
    assert max_diff(base, {n: p.detach() for n, p in server.model.named_parameters() if not p.requires_grad}) == 0
    # on the wire: adapter tensors only, down and up
    assert len(grid.train) == ROUNDS * PER_ROUND
    for msg, reply in grid.train:
        for content in (msg.content, reply.content):
            for record in content.array_records.values():
                for key in record.to_torch_state_dict():
                    assert not set(key.split("/")) & frozen, f"a frozen base tensor {key} was sent"
        # FedSA-LoRA's download and upload are the shared A: the personal B never travels, either way
        assert set(msg.content.array_records["params"].to_torch_state_dict()) == set(adapters) - b
        assert set(reply.content.array_records["delta"].to_torch_state_dict()) == set(adapters) - b
        state = reply.content.array_records["state"].to_torch_state_dict()
        assert state and all(float(v.abs().max()) == 0 for v in state.values())  # zeros in place of B_i
    # every node kept its own personal B, the engine's row of that client
    for pid in server.seen.nonzero().flatten().tolist():
        kept = ClientStateFile(tmp_path / "states", "t", pid).load(int(server.state_round[pid]))
        personal = {k: v for k, v in kept.items() if isinstance(v, dict)}
        flat = {f"{k}/{n}": t for k, tree in personal.items() for n, t in tree.items()}
        assert flat and {k.split("/", 1)[1] for k in flat} == b
        ref = {f"{k}/{n}": v[pid] for k, tree in reference.client_states.tensors.items() for n, v in tree.items()}
        assert max_diff(flat, ref) < 1e-5
