"""A Hugging Face ``transformers`` causal language model with ``peft`` LoRA adapters, built from arguments (YAML).

:class:`HuggingFaceCausalLM` builds the network from a configuration, never from a download:

* ``model_type`` and ``config`` (``transformers.AutoConfig.for_model(model_type, **config)``, then
  ``AutoModelForCausalLM.from_config``): the architecture with its seeded random initialisation; or
* ``pretrained``: a local directory written by ``save_pretrained`` (loaded with ``local_files_only=True``; a hub
  name is refused, so nothing is fetched);

then, with ``lora`` (the keyword arguments of ``peft.LoraConfig``, e.g. ``{r: 4, target_modules: [c_attn]}``), wraps
it with ``peft.get_peft_model``: the base is frozen (``requires_grad=False``) and only the adapters
(``…lora_A.default.weight``, ``…lora_B.default.weight``) are trained, sent and stored per client
(:mod:`lightning_fedmeta.client.trainable`). Its forward takes token ids ``[B, T]`` and returns the logits
``[B, T, V]`` (the ``ModelOutput``'s ``logits``), so the next-token losses and metrics apply as to
:class:`~lightning_fedmeta.models.reference.TinyTransformer`.

A ``peft`` model passed to ``FederatedModule`` directly (``FederatedModule(model=get_peft_model(...))``) works as
well: the engine takes the ``logits`` of a ``ModelOutput`` (:func:`lightning_fedmeta.client.functional.model_logits`).
Dropout (``transformers``' ``*_pdrop``/``*_dropout`` layers, ``peft``'s ``lora_dropout > 0``) makes the clients run
looped, one seeded draw per client, as any dropout does; with every dropout 0 they run batched under ``vmap``.

``transformers`` and ``peft`` are the optional extra ``llm`` (``pip install 'lightning-fedmeta[llm]'``), imported
only when this class is built.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Mapping
from typing import Any

from torch import Tensor, nn

__all__ = ["HuggingFaceCausalLM"]


def _import(name: str) -> Any:
    """The module ``name`` (``transformers`` or ``peft``), or an ``ImportError`` naming the ``llm`` extra."""
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        raise ImportError(f"HuggingFaceCausalLM needs {name!r}, part of the optional extra 'llm': "
                          "pip install 'lightning-fedmeta[llm]' (transformers and peft)") from exc


class HuggingFaceCausalLM(nn.Module):
    """A ``transformers`` causal LM from a configuration (or a local pretrained directory), optionally with ``peft``
    LoRA adapters (module docstring); ``forward(x)`` returns the logits ``[B, T, V]`` for token ids ``x [B, T]``.

    Args:
        model_type: a ``transformers`` model type (``gpt2``, ``llama``, ...), built from ``config`` at its random
            initialisation (seeded by the run's seed).
        config: keyword arguments of that model type's configuration (``n_layer``, ``n_embd``, ``vocab_size``, ...).
        pretrained: instead of ``model_type``: a local directory holding a model saved with ``save_pretrained``
            (``config`` then overrides its settings). Never downloaded: a path that is not a directory is an error.
        lora: keyword arguments of ``peft.LoraConfig`` (``r``, ``lora_alpha``, ``target_modules``, ``lora_dropout``,
            ...); ``task_type`` defaults to ``CAUSAL_LM``. ``None``: no adapters, every parameter trained.
        attn_implementation: ``transformers``' attention implementation (``eager``, ``sdpa``); ``None`` keeps its
            default. Both run batched under ``vmap``; on CPU, ``sdpa`` under ``vmap`` is computed client by client
            by PyTorch's batching fallback (same numbers, slower), ``eager`` is batched.
    """

    def __init__(self, model_type: str | None = None, config: Mapping[str, Any] | None = None,
                 pretrained: str | None = None, lora: Mapping[str, Any] | None = None,
                 attn_implementation: str | None = None) -> None:
        super().__init__()
        if (model_type is None) == (pretrained is None):
            raise ValueError("HuggingFaceCausalLM needs exactly one of model_type (built from config) and pretrained "
                             f"(a local save_pretrained directory); got model_type={model_type!r}, "
                             f"pretrained={pretrained!r}")
        if config is not None and not isinstance(config, Mapping):
            raise TypeError(f"config must be a mapping of configuration arguments, got {type(config).__name__}")
        if lora is not None and not isinstance(lora, Mapping):
            raise TypeError(f"lora must be a mapping of peft.LoraConfig arguments, got {type(lora).__name__}")
        transformers = _import("transformers")
        settings = dict(config or {})
        extra = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
        if pretrained is not None:
            if not os.path.isdir(pretrained):
                raise ValueError(f"pretrained must be a local directory written by save_pretrained (nothing is "
                                 f"downloaded), got {pretrained!r}")
            model = transformers.AutoModelForCausalLM.from_pretrained(pretrained, local_files_only=True,
                                                                      **extra, **settings)
        else:
            try:
                hf_config = transformers.AutoConfig.for_model(model_type, **settings)
            except ValueError as exc:
                raise ValueError(f"model_type {model_type!r} is not a transformers model type: {exc}") from exc
            model = transformers.AutoModelForCausalLM.from_config(hf_config, **extra)
        model.config.use_cache = False  # training forwards: no key/value cache
        if lora is not None:
            peft = _import("peft")
            model = peft.get_peft_model(model, peft.LoraConfig(**{"task_type": "CAUSAL_LM", **lora}))
        self.model = model

    @property
    def config(self) -> Any:
        """The ``transformers`` configuration of the model (its ``n_positions`` / ``max_position_embeddings`` is the
        context length :func:`~lightning_fedmeta.models.generation.generate` crops to)."""
        return self.model.config

    def forward(self, x: Tensor) -> Tensor:
        """The logits ``[B, T, V]`` of the token ids ``x [B, T]``."""
        return self.model(input_ids=x).logits
