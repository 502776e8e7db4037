"""Generation from a causal LM (lightning_fedmeta.models.generation): greedy decoding against hand-computed
continuations of hand-built models, context cropping, seeded sampling, and a client's personalised model after
federated training on text clients."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import Tensor, nn

from lightning_fedmeta.data.text_clients import TextClients
from lightning_fedmeta.data.tokenizers import ByteTokenizer
from lightning_fedmeta.models.generation import context_length, generate
from lightning_fedmeta.models.lora import LoRAModel, add_lora
from lightning_fedmeta.models.reference import TinyTransformer

V = 7


class PrefixSum(nn.Module):
    """Logits at position ``t`` are ``10 · one_hot((x_0 + ... + x_t) mod V)``: the greedy next token is the sum of the
    context mod V. ``max_len`` (if set) is its context length, and a longer input is an error (as TinyTransformer's)."""

    def __init__(self, max_len: int | None = None, out: str = "all") -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(10.0))
        self.out = out
        if max_len is not None:
            self.max_len = max_len
        self.lengths: list[int] = []

    def forward(self, x: Tensor) -> object:
        self.lengths.append(x.shape[1])
        if hasattr(self, "max_len") and x.shape[1] > self.max_len:
            raise ValueError("too long")
        logits = self.scale * nn.functional.one_hot(x.cumsum(1) % V, V).float()
        if self.out == "last":
            return logits[:, -1]
        if self.out == "object":
            return SimpleNamespace(logits=logits)
        return logits


def continuation(prompt: list[int], n: int, window: int | None) -> list[int]:
    seq = list(prompt)
    for _ in range(n):
        seq.append(sum(seq if window is None else seq[-window:]) % V)
    return seq


def test_greedy_equals_the_hand_computed_continuation() -> None:
    assert continuation([1, 2], 4, None) == [1, 2, 3, 6, 5, 3]  # 1+2, 1+2+3, 12 % 7, 17 % 7
    assert continuation([1, 2], 4, 2) == [1, 2, 3, 5, 1, 6]  # a Fibonacci mod 7 with a context of 2
    for out in ("all", "last", "object"):
        got = generate(PrefixSum(out=out), torch.tensor([1, 2]), 4, temperature=0)
        assert got.tolist() == continuation([1, 2], 4, None), out
    batch = generate(PrefixSum(), torch.tensor([[1, 2], [3, 3]]), 3, temperature=0)
    assert batch.tolist() == [continuation([1, 2], 3, None), continuation([3, 3], 3, None)]
    assert generate(PrefixSum(), [4], 0).tolist() == [4]


def test_the_context_is_cropped_to_the_models_max_len() -> None:
    model = PrefixSum(max_len=2)
    assert context_length(model) == 2
    assert generate(model, [1, 2], 4, temperature=0).tolist() == continuation([1, 2], 4, 2)
    assert max(model.lengths) == 2
    assert generate(PrefixSum(), [1, 2], 4, temperature=0, max_len=3).tolist() == continuation([1, 2], 4, 3)
    wrapped = LoRAModel(TinyTransformer(11, d_model=8, nhead=2, num_layers=1, max_len=5), ["head"], rank=1)
    assert context_length(wrapped) == 5 and context_length(nn.Linear(2, 2)) is None
    assert context_length(SimpleNamespace(config=SimpleNamespace(max_position_embeddings=1024))) == 1024
    assert generate(wrapped, [1, 2, 3], 9, temperature=0).shape == (12,)  # past max_len: cropped, no error


def test_sampling_is_reproducible_with_a_seeded_generator_and_top_k_1_is_greedy() -> None:
    torch.manual_seed(0)
    model = TinyTransformer(13, d_model=8, nhead=2, num_layers=1, max_len=16)
    prompt = torch.tensor([[1, 2, 3], [4, 5, 6]])

    def draw(seed: int, **kw: object) -> Tensor:
        return generate(model, prompt, 12, generator=torch.Generator().manual_seed(seed), **kw)

    assert torch.equal(draw(3), draw(3)) and not torch.equal(draw(3), draw(4))
    assert torch.equal(draw(3, top_k=1), generate(model, prompt, 12, temperature=0))
    assert torch.equal(draw(5, top_k=1, temperature=3.0), generate(model, prompt, 12, temperature=0))
    picked = draw(3, top_k=2, temperature=0.5)
    for t in range(3, picked.shape[1]):  # every draw is one of the two most likely tokens at its step
        top2 = model(picked[:, :t])[:, -1].topk(2).indices
        assert bool((top2 == picked[:, t:t + 1]).any(1).all())
    model.train()
    generate(model, prompt, 1)
    assert model.training  # the mode is restored


def test_generation_stops_once_every_row_has_ended() -> None:
    # from [2, 5] the sums run 0 (the eos id here), then the first row is filled with 0
    out = generate(PrefixSum(), torch.tensor([[2, 5], [1, 1]]), 6, temperature=0, eos_id=0)
    assert out.tolist()[0] == [2, 5, 0, 0, 0, 0, 0, 0]
    assert out.tolist()[1] == continuation([1, 1], 6, None)[:8]
    assert generate(PrefixSum(), torch.tensor([2, 5]), 6, temperature=0, eos_id=0).tolist() == [2, 5, 0]


def test_bad_arguments_are_refused() -> None:
    model = PrefixSum()
    for kwargs, message in (({"max_new_tokens": -1}, "max_new_tokens"), ({"temperature": -0.5}, "temperature"),
                            ({"top_k": 0}, "top_k")):
        with pytest.raises(ValueError, match=message):
            generate(model, [1], **{"max_new_tokens": 2, **kwargs})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="at least one token"):
        generate(model, [], 2)
    with pytest.raises(ValueError, match="integer token ids"):
        generate(model, torch.ones(2), 2)
    with pytest.raises(ValueError, match=r"\[B, T, V\] or \[B, V\] logits"):
        generate(NotAnLM(), [1], 1)


class NotAnLM(nn.Module):
    """``[B, T]`` → ``[B]``: not logits."""

    def forward(self, x: Tensor) -> Tensor:
        return x.float().sum(1)


def test_a_personalised_model_trained_on_text_clients_generates_text(tmp_path: Path) -> None:
    """FedSA-LoRA for 3 rounds on three clients' JSONL files (byte tokens), a LoRA'd TinyTransformer; each client's
    personalised model then continues a prompt past its max_len, and the ids decode to a string."""
    from lightning_fedmeta.module import FederatedModule
    from tests.conftest import run_plain_rounds

    root = tmp_path / "clients"
    root.mkdir()
    for name, line in (("ann", "abab abab abab "), ("bo", "xyz xyz xyz "), ("cy", "hello hello ")):
        (root / f"{name}.jsonl").write_text("".join(json.dumps({"text": line * 3}) + "\n" for _ in range(4)))
    data = TextClients(str(root), seq_len=12, test_fraction=0.25).federated_data()
    tok = ByteTokenizer()
    torch.manual_seed(0)
    model = add_lora(TinyTransformer(tok.vocab_size, d_model=16, nhead=2, num_layers=1, max_len=12),
                     ["qkv", "proj", "head"], rank=2, alpha=4.0)
    module = FederatedModule(model=model, algorithm={"name": "fedsa_lora", "local_steps": 2, "local_lr": 0.5,
                                                     "batch_size": 8}, clients_per_round=2, seed=1)
    module.attach_data(data)
    run_plain_rounds(module, 3)
    prompt = tok.encode("hello ")
    outs = []
    for i in range(data.num_clients):
        personal = module.personalize(i)
        ids = generate(personal, prompt, 20, temperature=0)
        assert ids.shape == (len(prompt) + 20,) and ids[: len(prompt)].tolist() == prompt
        text = tok.decode(ids)
        assert isinstance(text, str) and text.startswith("hello ")
        assert torch.equal(ids, generate(personal, prompt, 20, temperature=0))  # greedy is deterministic
        outs.append(ids)
    assert len({tuple(o.tolist()) for o in outs}) > 1  # the clients' lora_B differ, and so do their continuations
