"""Which parameters the federation trains: the trainable / frozen split of a model, fixed when it is bound.

A parameter with ``requires_grad=False`` is *frozen*: it is never trained, never sent, never stored per client and
never copied per client in a batched round. The trees the engine and every algorithm see (the global parameters,
client and server state built from them, deltas, uploads and downloads) hold the trainable parameters ``θ`` only;
the frozen ones ``φ`` travel with the buffers into ``functional_call`` (:class:`~lightning_fedmeta.client.
functional.ClientContext`), captured unbatched by ``vmap`` (``in_dims=None``), so a batched round of ``C`` clients
holds ``C·|θ|`` parameter floats per tree instead of ``C·(|θ| + |φ|)``.

The split is read from ``requires_grad`` once, when the model is bound (:class:`TrainableSet`); a model whose
trainable set changes afterwards, or one with no trainable parameter, is refused with a clear error.
"""

from __future__ import annotations

from torch import Tensor, nn

__all__ = ["TrainableSet", "trainable_parameters", "frozen_parameters"]


def trainable_parameters(model: nn.Module) -> dict[str, Tensor]:
    """``{name: p.detach()}`` for every parameter with ``requires_grad=True``, in ``named_parameters()`` order."""
    return {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}


def frozen_parameters(model: nn.Module) -> dict[str, Tensor]:
    """``{name: p.detach()}`` for every parameter with ``requires_grad=False`` (the shared, never-trained base)."""
    return {n: p.detach() for n, p in model.named_parameters() if not p.requires_grad}


class TrainableSet:
    """The names of a model's trainable parameters, fixed when the model is bound.

    Raises ``ValueError`` for a model with no trainable parameter (there is nothing to federate).
    """

    def __init__(self, model: nn.Module) -> None:
        params = list(model.named_parameters())
        self.names: tuple[str, ...] = tuple(n for n, p in params if p.requires_grad)
        self.frozen: tuple[str, ...] = tuple(n for n, p in params if not p.requires_grad)
        if not self.names:
            raise ValueError(
                f"the model has no trainable parameter ({len(params)} parameters, all with requires_grad=False): "
                "a federated round trains the parameters with requires_grad=True; unfreeze some (e.g. add adapters "
                "with lightning_fedmeta.models.lora.add_lora)"
            )

    def params(self, model: nn.Module) -> dict[str, Tensor]:
        """The model's trainable parameters (detached), checked against the set fixed at bind time.

        Raises ``RuntimeError`` when ``requires_grad`` changed since: the client and server state, compression
        residuals and optimizer were built for the bound set, so the split cannot change within a run.
        """
        params = trainable_parameters(model)
        if tuple(params) != self.names:
            now, bound = set(params), set(self.names)
            raise RuntimeError(
                "the model's trainable parameters changed after it was bound: "
                f"now trainable but frozen at bind time: {sorted(now - bound)[:5]}; "
                f"frozen now but trainable at bind time: {sorted(bound - now)[:5]}. The trainable set "
                "(requires_grad) is fixed when FederatedModule binds its data; set requires_grad before training "
                "starts and keep it for the whole run"
            )
        return params

    @property
    def has_frozen(self) -> bool:
        return bool(self.frozen)
