"""Hugging Face ``transformers`` causal LMs with LoRA adapters through ``FederatedModule`` unchanged (issue 40):
a ``peft``-wrapped GPT-2 given as it is (its forward returns a ``ModelOutput``), a Llama built by
:class:`~lightning_fedmeta.models.hf.HuggingFaceCausalLM` with ``peft`` adapters, and a Llama with the library's
own :func:`~lightning_fedmeta.models.lora.add_lora`. All tiny, from configurations (nothing is downloaded), on the
synthetic next-token data (clients of unequal sizes, 3 of 7 a round): looped and batched clients agree, the frozen
base is bit-identical after training, no base tensor is exchanged, a resumed run is bit-exact, FedSA-LoRA's
``lora_B`` pattern picks ``peft``'s adapter names, and ``lora_dropout > 0`` runs the clients looped.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers", reason="pip install 'lightning-fedmeta[llm]'")
peft = pytest.importorskip("peft", reason="pip install 'lightning-fedmeta[llm]'")

from lightning_fedmeta import FederatedModule  # noqa: E402
from lightning_fedmeta.algorithms.fedsa_lora import personal_parameter_names  # noqa: E402
from lightning_fedmeta.client.execution import BatchingError, choose_batching  # noqa: E402
from lightning_fedmeta.client.functional import ClientContext, model_logits  # noqa: E402
from lightning_fedmeta.data.synthetic_tasks import make_synthetic_next_token  # noqa: E402
from lightning_fedmeta.loop.server import apply_server_step  # noqa: E402
from lightning_fedmeta.models import HuggingFaceCausalLM, add_lora, generate  # noqa: E402
from lightning_fedmeta.models.generation import context_length  # noqa: E402
from lightning_fedmeta.persistence.memory_store import flatten_state  # noqa: E402
from lightning_fedmeta.testing import (  # noqa: E402
    CHECKS,
    check_algorithm,
    check_loop_equals_vmap,
    check_resume_is_bit_exact,
)
from tests.helpers import REPO  # noqa: E402

VOCAB, T = 8, 6
GPT2 = {"n_layer": 2, "n_embd": 16, "n_head": 2, "vocab_size": VOCAB, "n_positions": T, "resid_pdrop": 0.0,
        "embd_pdrop": 0.0, "attn_pdrop": 0.0, "bos_token_id": 0, "eos_token_id": 0}
LLAMA = {"num_hidden_layers": 2, "hidden_size": 16, "intermediate_size": 32, "num_attention_heads": 2,
         "num_key_value_heads": 2, "vocab_size": VOCAB, "max_position_embeddings": T, "bos_token_id": 0,
         "eos_token_id": 0}
ALGORITHMS = {
    "fedavg": {"name": "fedavg", "local_steps": 2, "local_lr": 0.3},
    "fedsa_lora": {"name": "fedsa_lora", "local_steps": 2, "local_lr": 0.3},
}


def peft_gpt2(lora_dropout: float = 0.0) -> nn.Module:
    """A seeded 2-layer GPT-2 wrapped by ``peft`` (rank 4 on ``c_attn``): a ``PeftModel``, returning a
    ``ModelOutput``."""
    torch.manual_seed(0)
    base = transformers.GPT2LMHeadModel(transformers.GPT2Config(**GPT2))
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], lora_dropout=lora_dropout,
                             fan_in_fan_out=True)  # GPT-2's Conv1D stores its weight transposed
    return peft.get_peft_model(base, config)


def peft_llama() -> nn.Module:
    """A seeded 2-layer Llama with ``peft`` adapters on ``q_proj``/``v_proj``, built from arguments."""
    torch.manual_seed(0)
    return HuggingFaceCausalLM("llama", LLAMA, lora={"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"],
                                                     "lora_dropout": 0.0})


def builtin_llama() -> nn.Module:
    """The same Llama with the library's own adapters (:func:`add_lora`) instead of ``peft``'s."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA))
    return add_lora(model, ["q_proj", "v_proj"], rank=4, alpha=8.0)


MODELS: dict[str, Callable[[], nn.Module]] = {"peft_gpt2": peft_gpt2, "peft_llama": peft_llama,
                                              "builtin_llama": builtin_llama}


@pytest.fixture(scope="module")
def data() -> Any:
    data = make_synthetic_next_token(num_clients=7, vocab_size=VOCAB, seq_len=T, seed=0)
    assert len(set(data.train_counts.tolist())) > 1  # unequal clients
    return data


def bound(data: Any, model: nn.Module, algorithm: str = "fedavg", batching: str = "auto") -> FederatedModule:
    module = FederatedModule(model=model, algorithm=ALGORITHMS[algorithm], clients_per_round=3, seed=1,
                             client_batching=batching, compile_clients=False)
    module.attach_data(data)
    return module


def rounds(module: FederatedModule, count: int, optimizer: torch.optim.Optimizer) -> None:
    for r in range(count):
        result = module.engine.compute(r)
        assert result is not None
        uploads = module.engine.combine(result)
        assert uploads is not None and uploads.update is not None
        apply_server_step(optimizer, module.model, uploads.update.delta)
        module.engine.commit(result, uploads.update.server_state)


# ----------------------------------------------------------------------------------------------
# the engine takes a ModelOutput's logits, and nothing else changes
# ----------------------------------------------------------------------------------------------
def test_model_logits_unwraps_a_model_output_and_passes_a_tensor_through() -> None:
    t = torch.randn(2, 3)
    assert model_logits(t) is t  # every model returning a tensor: the very same object (no number moves)
    out = transformers.modeling_outputs.CausalLMOutput(logits=t)
    assert model_logits(out) is t
    other = (t, t)
    assert model_logits(other) is other  # anything else: unchanged, for the model-output check to report


def test_peft_model_runs_unchanged_batched_with_sdpa(data: Any) -> None:
    model = peft_gpt2()
    assert model.base_model.model.config._attn_implementation == "sdpa"
    x = data.train_x[:3]
    ctx = ClientContext(model, per_sample_loss=lambda logits, y: logits.sum((-1, -2)))
    adapters = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
    torch.testing.assert_close(ctx.predict(adapters, x), model(x).logits, rtol=0, atol=0)
    module = bound(data, model)
    assert module.engine.batching == "vmap"
    assert list(module.engine.global_params()) == list(adapters)
    assert all(".lora_A." in n or ".lora_B." in n for n in adapters)


# ----------------------------------------------------------------------------------------------
# the conformance kit: loop = vmap, exchange, resume
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("source", sorted(MODELS))
def test_lora_causal_lm_runs_looped_and_batched_alike(source: str, data: Any) -> None:
    check_loop_equals_vmap(ALGORITHMS["fedavg"], model=MODELS[source], data=data, clients_per_round=3,
                           holdout_clients=1, rounds=1, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
def test_no_base_tensor_is_downloaded_uploaded_or_stored(algorithm: str, data: Any) -> None:
    only_exchange = [c for c in CHECKS if c != "check_exchange"]
    check_algorithm(ALGORITHMS[algorithm], model=peft_gpt2, data=data, clients_per_round=3, holdout_clients=1,
                    skip=only_exchange)


def test_resume_of_a_peft_run_is_bit_exact(data: Any) -> None:
    check_resume_is_bit_exact(ALGORITHMS["fedsa_lora"], model=peft_gpt2, data=data, clients_per_round=3,
                              holdout_clients=1, rounds=2, resume_at=1, eval_every=1)


# ----------------------------------------------------------------------------------------------
# the base is never trained; FedSA-LoRA's pattern picks peft's names
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("source", ["peft_gpt2", "builtin_llama"])
def test_base_is_bit_identical_after_training(source: str, data: Any) -> None:
    module = bound(data, MODELS[source]())
    model = module.model
    assert model is not None
    base = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    adapters = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    assert base and set(module.engine.global_params()) == set(adapters)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)  # given every parameter
    rounds(module, 2, optimizer)
    for n, p in model.named_parameters():
        if n in base:
            assert torch.equal(p, base[n]), f"the frozen {n} changed"
    assert any(not torch.equal(dict(model.named_parameters())[n], v) for n, v in adapters.items())


def test_fedsa_lora_keeps_peft_lora_b_personal_and_shares_lora_a(data: Any) -> None:
    module = bound(data, peft_gpt2(), "fedsa_lora")
    names = [n for n, p in module.model.named_parameters() if p.requires_grad]
    b = personal_parameter_names(names, ["lora_B"])
    assert b == [n for n in names if n.endswith("lora_B.default.weight")] and len(b) == 2
    rounds(module, 1, torch.optim.SGD([p for p in module.model.parameters() if p.requires_grad], lr=1.0))
    stored = {k.split("/", 1)[1] for k in flatten_state(module.client_states.tensors)}
    assert stored == set(b)  # the personal B matrices, stored per client; every A shared and averaged


# ----------------------------------------------------------------------------------------------
# dropout: peft's lora_dropout (and transformers' own) run the clients looped, one seeded draw each
# ----------------------------------------------------------------------------------------------
def test_lora_dropout_runs_the_clients_looped(data: Any) -> None:
    model = peft_gpt2(lora_dropout=0.1)
    mode, reason = choose_batching(model, "auto")
    assert mode == "loop" and "lora_dropout" in reason
    with pytest.raises(ValueError, match="client_batching='vmap' is impossible.*lora_dropout"):
        choose_batching(model, "vmap")
    deltas = []
    for _ in range(2):  # the draws are seeded by (seed, round, client): the same round twice, the same update
        module = bound(data, peft_gpt2(lora_dropout=0.1))
        assert module.engine.batching == "loop"
        result = module.engine.compute(0)
        deltas.append(module.engine.combine(result).update.delta)
    assert all(torch.equal(deltas[0][k], deltas[1][k]) for k in deltas[0])
    assert any(float(v.abs().max()) > 0 for v in deltas[0].values())


def test_functional_attention_dropout_is_refused_batched_and_runs_looped(data: Any) -> None:
    """Llama draws its attention dropout as a function argument, not an nn.Dropout layer: the automatic choice
    cannot see it, the batched round refuses the draw by name, and client_batching='loop' runs it (docs)."""
    def llama() -> nn.Module:
        torch.manual_seed(0)
        return HuggingFaceCausalLM("llama", {**LLAMA, "attention_dropout": 0.1},
                                   lora={"r": 2, "target_modules": ["q_proj"]})

    module = bound(data, llama())
    assert module.engine.batching == "vmap"
    with pytest.raises(BatchingError, match="draws random numbers, which the batched client path refuses"):
        module.engine.compute(0)
    looped = bound(data, llama(), batching="loop")
    assert looped.engine.compute(0) is not None


# ----------------------------------------------------------------------------------------------
# HuggingFaceCausalLM: built from a config or a local directory, never downloaded
# ----------------------------------------------------------------------------------------------
def test_hf_causal_lm_returns_the_logits_and_freezes_the_base() -> None:
    model = peft_llama()
    x = torch.randint(0, VOCAB, (2, T))
    assert model(x).shape == (2, T, VOCAB)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert len(trainable) == 8 and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    full = HuggingFaceCausalLM("gpt2", GPT2)  # no lora: every parameter trained
    assert all(p.requires_grad for p in full.parameters())


def test_generate_runs_on_peft_models_with_their_context_length() -> None:
    wrapped, direct = peft_llama(), peft_gpt2()
    assert context_length(wrapped) == context_length(direct) == T
    for model in (wrapped, direct):
        out = generate(model, [1, 2, 3], max_new_tokens=2 * T)  # longer than the context: cropped, runs
        assert out.shape[-1] == 3 + 2 * T and int(out.max()) < VOCAB


def test_hf_causal_lm_loads_a_local_pretrained_directory(tmp_path: Path) -> None:
    torch.manual_seed(1)
    pretrained = transformers.GPT2LMHeadModel(transformers.GPT2Config(**GPT2))
    pretrained.save_pretrained(tmp_path / "base")
    torch.manual_seed(2)
    model = HuggingFaceCausalLM(pretrained=str(tmp_path / "base"),
                                lora={"r": 2, "target_modules": ["c_attn"], "fan_in_fan_out": True})
    x = torch.randint(0, VOCAB, (3, T))
    with torch.no_grad():
        torch.testing.assert_close(model(x), pretrained(x).logits, rtol=0, atol=1e-6)  # B = 0: the base's output


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    ({}, ValueError, "exactly one of model_type"),
    ({"model_type": "gpt2", "pretrained": "x"}, ValueError, "exactly one of model_type"),
    ({"pretrained": "gpt2"}, ValueError, "local directory written by save_pretrained"),
    ({"model_type": "no_such_model"}, ValueError, "'no_such_model' is not a transformers model type"),
    ({"model_type": "gpt2", "config": [1]}, TypeError, "config must be a mapping"),
    ({"model_type": "gpt2", "lora": "c_attn"}, TypeError, "lora must be a mapping"),
])
def test_hf_causal_lm_refuses_bad_arguments_with_the_reason(kwargs: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        HuggingFaceCausalLM(**kwargs)


@pytest.mark.parametrize("missing", ["transformers", "peft"])
def test_hf_causal_lm_without_the_llm_extra_names_it(missing: str, monkeypatch: Any) -> None:
    monkeypatch.setitem(sys.modules, missing, None)  # import fails as if not installed
    with pytest.raises(ImportError, match=rf"needs '{missing}', part of the optional extra 'llm'.*\[llm\]"):
        HuggingFaceCausalLM("gpt2", GPT2, lora={"r": 2, "target_modules": ["c_attn"], "fan_in_fan_out": True})


def test_the_core_does_not_import_transformers_or_peft() -> None:
    """No module of the library imports ``transformers`` or ``peft`` itself: :mod:`lightning_fedmeta.models.hf`
    loads them with ``importlib`` when the class is built (an install without the ``llm`` extra imports the rest)."""
    pattern = re.compile(r"^\s*(import|from)\s+(transformers|peft)\b", re.MULTILINE)
    offenders = [str(p.relative_to(REPO)) for p in (REPO / "lightning_fedmeta").rglob("*.py")
                 if pattern.search(p.read_text())]
    assert offenders == []
    assert "importlib.import_module(name)" in (REPO / "lightning_fedmeta" / "models" / "hf.py").read_text()


def test_peft_config_runs_from_the_cli_training_the_adapters_only(tmp_path: Path) -> None:
    from lightning_fedmeta.cli import run

    cli = run(["fit", "--config", str(REPO / "configs" / "lora_peft_gpt2_tiny.yaml"), "--trainer.max_steps", "2",
               "--data.eval_every", "2", "--data.num_clients", "6", "--model.clients_per_round", "3",
               "--trainer.default_root_dir", str(tmp_path), "--trainer.enable_progress_bar", "false"])
    module = cli.model  # type: ignore[attr-defined]
    assert isinstance(module.model, HuggingFaceCausalLM) and module.engine.batching == "vmap"
    adapters = [n for n, p in module.model.named_parameters() if p.requires_grad]
    assert adapters and all(n.endswith(("lora_A.default.weight", "lora_B.default.weight")) for n in adapters)
    assert list(module.engine.global_params()) == adapters
    assert "val/acc_weighted" in cli.trainer.callback_metrics  # type: ignore[attr-defined]


def test_the_feature_algorithms_read_the_logits_of_a_model_output() -> None:
    """FedProto/FedPAC-style algorithms run the model themselves (features_and_logits): a ``ModelOutput`` gives its
    ``.logits`` there as in the engine."""
    from transformers.modeling_outputs import SequenceClassifierOutput

    from lightning_fedmeta.algorithms.feature_common import features_and_logits, linear_head

    class Classifier(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Linear(5, 4)
            self.head = nn.Linear(4, 3)

        def forward(self, x: torch.Tensor) -> SequenceClassifierOutput:
            return SequenceClassifierOutput(logits=self.head(torch.tanh(self.body(x))))

    torch.manual_seed(0)
    model = Classifier()
    ctx = ClientContext(model)
    params = {k: v.detach() for k, v in model.named_parameters()}
    x = torch.randn(6, 5)
    z, logits = features_and_logits(ctx, params, x, linear_head(params, "head", "fedproto"))
    assert isinstance(logits, torch.Tensor)
    torch.testing.assert_close(logits, model(x).logits)
    torch.testing.assert_close(z, torch.tanh(model.body(x)))
