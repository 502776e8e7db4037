"""A client's personalised model as a standalone ``nn.Module`` (``FederatedModule.personalize``).

``w_i = algorithm.personalize(w, adapt batches, state_i, σ, record_i)`` computed exactly as the evaluation
computes it (model in eval mode, the client's BatchNorm statistics), copied into a deep copy of the model.
A client of the federation uses its stored state and its draws at ``round_idx``; a new client known only by
``(x, y)`` adapts from the global model like a held-out client (fresh state, record index −1).
"""

from __future__ import annotations

import copy

import torch
from torch import Tensor, nn

from lightning_fedmeta.algorithms.base import ClientRecord
from lightning_fedmeta.client.functional import ClientContext
from lightning_fedmeta.loop.engine import RoundEngine
from lightning_fedmeta.loop.gather import new_client_batches
from lightning_fedmeta.persistence.memory_store import map_state

__all__ = ["personal_model"]


def personal_model(engine: RoundEngine, model: nn.Module, client: int | tuple[Tensor, Tensor], round_idx: int,
                   device: torch.device, attached: bool) -> nn.Module:
    """The personalised model of ``client`` (an index of the attached federation, or a new client's ``(x, y)``)."""
    params = engine.global_params()
    if isinstance(client, int):
        if not attached:
            raise RuntimeError("attach data first: module.attach_data(datamodule.federated_data)")
        batches, state, record, buffers = engine.personal_inputs(client, round_idx)
    else:
        batches, records = new_client_batches(engine.seed, client, round_idx, engine.algorithm.eval_plan(), device)
        states = engine.algorithm.init_client_states(params, records)
        state = map_state(lambda v: v[0].to(device), states)
        record = ClientRecord(*(t[0].to(device) for t in records))
        buffers = {}  # a new client: the model's own running statistics
    ctx = engine.ctx if attached else ClientContext(model)
    if buffers:
        ctx = ctx.for_client(buffers)
    server_state = map_state(lambda v: v.to(device), engine.server_state)
    was_training = model.training
    model.eval()  # adapt exactly as the evaluation does (dropout off, batch statistics as scored)
    try:
        with torch.inference_mode(False), torch.enable_grad():
            w = engine.algorithm.personalize(ctx, params, batches, state, server_state, record)
    finally:
        model.train(was_training)
    personal = copy.deepcopy(model)
    with torch.no_grad():
        for name, p in personal.named_parameters():
            if name in w:  # frozen parameters (requires_grad=False) are the global model's, never personalised
                p.copy_(w[name])
        own = dict(personal.named_buffers())
        for name, v in buffers.items():  # the client's running statistics
            own[name].copy_(v)
    return personal.eval()
