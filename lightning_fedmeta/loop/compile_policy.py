"""When the client steps are compiled (``model.compile_clients``).

``True`` compiles training and evaluation from the first round; ``False`` never compiles; ``"auto"`` times the
second eager round of a fit and compiles the training steps when the rounds left would spend at least
:data:`~lightning_fedmeta.client.compiled.AUTO_COMPILE_SECONDS` in eager client computation
(:func:`~lightning_fedmeta.client.compiled.worth_compiling`); evaluation stays eager. The decision is checkpointed so
a resumed run rounds as before, and under several processes rank 0's decision is broadcast.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

from lightning.pytorch.utilities import rank_zero_info

if TYPE_CHECKING:
    import torch

from lightning_fedmeta.client.compiled import PrimitiveCompiler, describe_decision, worth_compiling

__all__ = ["CompilePolicy"]


class CompilePolicy:
    """Owns the :class:`~lightning_fedmeta.client.compiled.PrimitiveCompiler` and switches it per phase."""

    def __init__(self, mode: bool | Literal["auto"], graphs: bool | Literal["auto"] = "auto") -> None:
        if mode not in (True, False, "auto"):
            raise ValueError(f"compile_clients must be true, false or 'auto', got {mode!r}")
        if graphs not in (True, False, "auto"):
            raise ValueError(f"cuda_graphs must be true, false or 'auto', got {graphs!r}")
        self.mode = mode
        #: ``model.cuda_graphs``: capture the batched client primitives as CUDA graphs ("auto": on a CUDA device)
        self.graphs_mode = graphs
        #: compiles the client primitives; switched on for training by ``True`` or by the "auto" decision
        self.compiler = PrimitiveCompiler(enabled=mode is True)
        #: "auto": whether this run compiles its training steps (None until decided; checkpointed)
        self.decision: bool | None = None if mode == "auto" else bool(mode)
        self.eager_rounds_timed = 0

    def place(self, device: torch.device, batching: str) -> None:
        """Switch graph capture for the device the clients run on (:mod:`lightning_fedmeta.client.graphs`)."""
        if self.graphs_mode is True and device.type != "cuda":
            raise ValueError(f"cuda_graphs=True needs a CUDA device; this run's clients are on {device.type!r} "
                             "(use cuda_graphs='auto', which captures only on a GPU)")
        self.compiler.graphs = bool(self.graphs_mode) and device.type == "cuda" and batching == "vmap"

    def deciding(self, batching: str) -> bool:
        """Whether this round's eager time is to be measured for the "auto" decision."""
        return self.decision is None and batching == "vmap"

    def observe(self, rounds_left: int | None, eager_seconds: float,
                broadcast: Callable[[Any], Any] | None = None, programs: int = 1) -> None:
        """One eager round took ``eager_seconds`` and would need ``programs`` compiled programs (its bucket sizes,
        :func:`~lightning_fedmeta.client.compiled.client_buckets`): after the fit's second round (the first carries
        one-time costs), decide (rank 0 decides for all ranks through ``broadcast``)."""
        self.eager_rounds_timed += 1
        if self.eager_rounds_timed < 2:
            return
        decision = worth_compiling(rounds_left, eager_seconds, programs=programs)
        if broadcast is not None:
            decision = bool(broadcast(decision))
        self.decision = decision
        rank_zero_info(f"[lightning_fedmeta] compile_clients='auto': "
                       f"{describe_decision(decision, rounds_left, eager_seconds, programs)}")

    def for_training(self, compact: bool = False, usual_clients: int | None = None) -> PrimitiveCompiler:
        """The compiler for a training round: compiling as decided, compacting empty steps (``compact``:
        ``step_schedule="compacted"``), the round's usual call size compiled whole (other sizes in buckets)."""
        self.compiler.enabled = bool(self.decision)
        self.compiler.compact = compact
        self.compiler.whole_sizes = set() if usual_clients is None else {usual_clients}
        self.compiler.new_call()
        return self.compiler

    def for_evaluation(self) -> PrimitiveCompiler:
        self.compiler.enabled = self.mode is True  # "auto" compiles training only
        self.compiler.compact = False  # evaluation batches are never empty steps of a schedule
        self.compiler.new_call()
        return self.compiler

    def report(self) -> str | None:
        """A line about what was compiled (``None`` when nothing was tried)."""
        stats = self.compiler.stats
        if not (stats.programs or stats.failures):
            return None
        return (f"[lightning_fedmeta] compiled client steps: {stats.programs} program(s), "
                f"{stats.compile_seconds:.1f} s compiling, {stats.compiled_calls} compiled calls"
                + (f"; could not compile: {'; '.join(stats.failures)}" if stats.failures else ""))

    def state_dict(self) -> dict[str, Any]:
        return {"compile_decision": self.decision}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.mode == "auto" and state.get("compile_decision") is not None:
            self.decision = bool(state["compile_decision"])
