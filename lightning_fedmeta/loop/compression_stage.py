"""The compression stages of a round (``model.compression``): each client's upload compressed on the client,
before anything the server does, and the model the clients download sent in 16 bits.

    ŵ      = float32(half(w))                       download (model.compression.download)
    Δ_i    = client_update(ŵ, ...) − ...            the client's computation
    Δ̂_i, e_i' = C(flat(Δ_i), e_i, u_i)              upload: compressed and decoded per client
    ...    ServerPipeline(Δ̂_i): attack, DP clip, rule, noise

``C`` is one of :mod:`lightning_fedmeta.communication.compressors`'s compressors on the client's flat row; ``u_i`` its
uniform
draws (a pure function of seed, round and client); ``e_i`` the top-k residual, kept as client state in its own
:class:`~lightning_fedmeta.persistence.memory_store.ClientStateStore` or disk store (``model.client_state``),
checkpointed with
the engine and written back when the round commits. Rows run looped or under ``vmap`` with the same numbers.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import Tensor
from torch.func import vmap

from lightning_fedmeta.algorithms.base import ClientOutput
from lightning_fedmeta.client.functional import Params
from lightning_fedmeta.communication.compressors import CompressionSpec, Compressor, compression_noise
from lightning_fedmeta.loop.client_storage import AnyStore, StoreLocation, restore_client_store
from lightning_fedmeta.persistence.disk_store import DiskClientStateStore, is_disk_manifest
from lightning_fedmeta.persistence.memory_store import ClientStateStore

__all__ = ["CompressionStage", "flat_rows", "unflat_rows", "run_rows"]


def flat_rows(tree: Params) -> Tensor:
    """``{name: [C, ...]}`` → ``[C, d]``, the entries concatenated in the dict's order."""
    return torch.cat([v.reshape(v.shape[0], -1) for v in tree.values()], dim=1)


def unflat_rows(rows: Tensor, like: Params) -> Params:
    """The inverse of :func:`flat_rows` (shapes and dtypes of ``like``)."""
    out, start = {}, 0
    for name, v in like.items():
        size = v[0].numel()
        out[name] = rows[:, start:start + size].reshape(v.shape).to(v.dtype)
        start += size
    return out


def run_rows(compressor: Compressor, rows: Tensor, residual: Tensor, noise: Tensor | None,
             batching: str) -> tuple[Tensor, Tensor]:
    """:meth:`Compressor.step` on every row: looped (one call per client) or under ``vmap``."""
    if batching == "vmap":
        if noise is None:
            return vmap(lambda r, e: compressor.step(r, e))(rows, residual)
        return vmap(compressor.step)(rows, residual, noise)
    pairs = [compressor.step(rows[i], residual[i], None if noise is None else noise[i]) for i in range(len(rows))]
    return torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])


class CompressionStage:
    """The run's compression: the upload compressor, the 16-bit download and the top-k residual store."""

    def __init__(self, spec: CompressionSpec | None) -> None:
        self.spec = spec
        self.residuals: AnyStore = ClientStateStore()

    @property
    def upload(self) -> Compressor | None:
        return None if self.spec is None else self.spec.upload

    @property
    def keeps_residual(self) -> bool:
        return self.upload is not None and self.upload.error_feedback

    def location(self, where: StoreLocation) -> StoreLocation:
        """The residual store's place: ``<client state folder>/compression_residual``."""
        return StoreLocation(where.mode, os.path.join(where.root(), "compression_residual"), None, where.rank)

    def bind(self, params: Params, num_clients: int, where: StoreLocation) -> None:
        """One zero residual per client and parameter (kept when a checkpoint already filled the store)."""
        if not self.keeps_residual or len(self.residuals):
            return
        from lightning_fedmeta.persistence import (
            disk_store as disk_state,  # the threshold is read at call time (tests lower it)
        )

        row_bytes = sum(p.numel() * 4 for p in params.values())
        disk = where.mode == "disk" or (where.mode == "auto"
                                        and num_clients * row_bytes > disk_state.DISK_STATE_THRESHOLD_BYTES)
        template = {name: torch.zeros_like(p, dtype=torch.float32, device="cpu") for name, p in params.items()}
        if disk:
            self.residuals = DiskClientStateStore.lazy(self.location(where).root(), num_clients, template,
                                                       rank=where.rank)
        else:
            self.residuals = ClientStateStore({n: t.expand(num_clients, *t.shape).clone()
                                               for n, t in template.items()})

    def download(self, params: Params) -> Params:
        """The model as the clients receive it: ``float32(half(w))`` with a 16-bit download, else ``w``."""
        if self.spec is None or self.spec.download is None:
            return params
        dtype = self.spec.download
        return {n: p.to(dtype).to(p.dtype) if p.is_floating_point() else p for n, p in params.items()}

    def compress(self, output: ClientOutput, clients: Tensor, seed: int, round_idx: int,
                 batching: str) -> tuple[ClientOutput, Params | None]:
        """Every client's delta replaced by its decoded compressed upload; the new residuals (error feedback)."""
        compressor = self.upload
        if compressor is None:
            return output, None
        rows = flat_rows(output.delta).to(torch.float32)
        noise = compression_noise(seed, round_idx, clients, rows.shape[1]).to(rows.device) if compressor.random \
            else None
        residual = flat_rows(self.residuals.gather(clients)).to(rows.device) if self.keeps_residual \
            else torch.zeros_like(rows)
        sent, kept = run_rows(compressor, rows, residual, noise, batching)
        decoded = unflat_rows(sent, output.delta)
        new_residual = unflat_rows(kept, {n: v.to(torch.float32) for n, v in output.delta.items()}) \
            if self.keeps_residual else None
        return output._replace(delta=decoded), new_residual

    def commit(self, clients: Tensor, residual: Params | None) -> None:
        """Write the round's clients' residuals back (when the round commits)."""
        if residual is not None:
            self.residuals.scatter(clients, residual)

    def to(self, device: torch.device) -> None:
        self.residuals.to(device)

    def checkpoint_state(self, round_idx: int) -> dict[str, Any]:
        return self.residuals.checkpoint_state(round_idx) if self.keeps_residual else {}

    def load_state_dict(self, entry: dict[str, Any] | None, where: StoreLocation,
                        num_clients: int | None = None) -> None:
        """A checkpoint's residuals (a disk manifest or flat tensors), in the store ``model.client_state`` asks
        (a manifest must name ``num_clients``, the run's own number of clients)."""
        if not entry or not self.keeps_residual:
            return
        disk_wanted = where.mode == "disk" or (where.mode == "auto" and is_disk_manifest(entry))
        self.residuals = restore_client_store(entry, self.location(where) if disk_wanted else where, self.residuals,
                                              num_clients)
