"""Captured client steps: a batched primitive of static shape recorded once as a CUDA graph and replayed.

Why: on a GPU a small model's step is latency-bound. One batched ``sgd_step`` of PFLlib's CNN for 10 clients is a
chain of ~100 kernels, each launched from Python through functorch's dispatch: 4.4 ms on an H100 at 20 %
utilisation (benchmarks/results/gpu.md), where the arithmetic takes well under a millisecond. A CUDA graph records
the chain once and replays it with one launch (PyTorch docs, "CUDA Graphs"; ``torch.cuda.graph``).

How: :class:`~lightning_fedmeta.client.compiled.PrimitiveCompiler` (``graphs=True``) leaves the clients' ``vmap``
exactly as
for a compiled primitive (every operand stacked along the client axis) and hands the stacked call to
:class:`GraphedCall`, one per primitive and shape: the first call clones the operands into static input buffers,
warms the program up on a side stream (cuBLAS workspaces, cuDNN's choice of algorithm, a compiled program's
compilation) and captures it; every call copies its operands into the static inputs, replays, and returns clones of
the static outputs (the next replay overwrites them, and a client step keeps each step's loss to the end).

Numbers: a replay runs the captured kernels on the copied inputs, so it gives the uncaptured call's numbers bit for
bit on the same device. What cannot be captured (an operation that synchronises with the host, a CPU tensor) fails
at capture: the primitive then runs as before, uncaptured, with one warning.

The graph backend is pluggable: :class:`CudaGraphs` on a GPU; :class:`RecordedGraphs` replays by recomputing into
the same static outputs, so the static-buffer logic is tested on a CPU.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import Tensor
from torch.utils._pytree import tree_flatten, tree_map

__all__ = ["CudaGraphs", "GraphBackend", "GraphedCall", "RecordedGraphs", "MAX_GRAPHS"]

#: at most this many captured calls are kept per compiler (each holds its own memory pool); later shapes run uncaptured
MAX_GRAPHS = 64


class GraphBackend(Protocol):
    def capture(self, fn: Callable[..., Any], static_in: tuple[Tensor, ...]) -> tuple[Callable[[], None], Any]:
        """Record ``fn(*static_in)``; returns ``(replay, static_out)``: ``replay()`` recomputes into ``static_out``
        from whatever ``static_in`` holds then."""


class CudaGraphs:
    """``torch.cuda.graph`` capture after ``warmup`` calls on a side stream (the PyTorch docs' recipe)."""

    def __init__(self, warmup: int = 2) -> None:
        self.warmup = warmup

    def capture(self, fn: Callable[..., Any], static_in: tuple[Tensor, ...]) -> tuple[Callable[[], None], Any]:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(self.warmup):
                fn(*static_in)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = fn(*static_in)
        return graph.replay, static_out


class RecordedGraphs:
    """A stand-in for tests on any device: ``replay`` recomputes ``fn(*static_in)`` and copies the result into the
    static outputs, which is what a CUDA graph's replay does to them."""

    def __init__(self) -> None:
        self.captures = 0
        self.replays = 0

    def capture(self, fn: Callable[..., Any], static_in: tuple[Tensor, ...]) -> tuple[Callable[[], None], Any]:
        self.captures += 1
        static_out = fn(*static_in)

        def replay() -> None:
            self.replays += 1
            fresh = tree_flatten(fn(*static_in))[0]
            for kept, new in zip(tree_flatten(static_out)[0], fresh, strict=True):
                kept.copy_(new)

        return replay, static_out


class GraphedCall:
    """``fn`` on inputs shaped like ``example``, captured once by ``backend`` and replayed on every call."""

    def __init__(self, fn: Callable[..., Any], example: tuple[Tensor, ...], backend: GraphBackend) -> None:
        self.static_in = tuple(t.detach().clone() for t in example)
        self.replay, self.static_out = backend.capture(fn, self.static_in)

    def __call__(self, *inputs: Tensor) -> Any:
        if len(inputs) != len(self.static_in):
            raise ValueError(f"a captured call takes {len(self.static_in)} inputs, got {len(inputs)}")
        for static, given in zip(self.static_in, inputs, strict=True):
            if static.shape != given.shape or static.dtype != given.dtype:
                raise ValueError(f"a captured call was recorded for {tuple(static.shape)} {static.dtype}, "
                                 f"got {tuple(given.shape)} {given.dtype}")
            static.copy_(given)
        self.replay()
        return tree_map(lambda t: t.clone() if isinstance(t, Tensor) else t, self.static_out)
