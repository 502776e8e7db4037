"""When the client steps are compiled (``model.compile_clients``).

``True`` compiles training and evaluation from the first round; ``False`` never compiles; ``"auto"`` times the
second eager round of a fit and compiles the training steps when the rounds left would spend at least
:data:`~lightning_fedmeta.compiled.AUTO_COMPILE_SECONDS` in eager client computation
(:func:`~lightning_fedmeta.compiled.worth_compiling`); evaluation stays eager. The decision is checkpointed so
a resumed run rounds as before, and under several processes rank 0's decision is broadcast.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

from lightning.pytorch.utilities import rank_zero_info

from lightning_fedmeta.compiled import PrimitiveCompiler, describe_decision, worth_compiling

__all__ = ["CompilePolicy"]


class CompilePolicy:
    """Owns the :class:`~lightning_fedmeta.compiled.PrimitiveCompiler` and switches it per phase."""

    def __init__(self, mode: bool | Literal["auto"]) -> None:
        if mode not in (True, False, "auto"):
            raise ValueError(f"compile_clients must be true, false or 'auto', got {mode!r}")
        self.mode = mode
        #: compiles the client primitives; switched on for training by ``True`` or by the "auto" decision
        self.compiler = PrimitiveCompiler(enabled=mode is True)
        #: "auto": whether this run compiles its training steps (None until decided; checkpointed)
        self.decision: bool | None = None if mode == "auto" else bool(mode)
        self.eager_rounds_timed = 0

    def deciding(self, batching: str) -> bool:
        """Whether this round's eager time is to be measured for the "auto" decision."""
        return self.decision is None and batching == "vmap"

    def observe(self, rounds_left: int | None, eager_seconds: float,
                broadcast: Callable[[bool], bool] | None = None) -> None:
        """One eager round took ``eager_seconds``: after the fit's second (the first carries one-time costs),
        decide (rank 0 decides for all ranks through ``broadcast``)."""
        self.eager_rounds_timed += 1
        if self.eager_rounds_timed < 2:
            return
        decision = worth_compiling(rounds_left, eager_seconds)
        if broadcast is not None:
            decision = bool(broadcast(decision))
        self.decision = decision
        rank_zero_info(f"[lightning_fedmeta] compile_clients='auto': "
                       f"{describe_decision(decision, rounds_left, eager_seconds)}")

    def for_training(self) -> PrimitiveCompiler:
        self.compiler.enabled = bool(self.decision)
        self.compiler.new_call()
        return self.compiler

    def for_evaluation(self) -> PrimitiveCompiler:
        self.compiler.enabled = self.mode is True  # "auto" compiles training only
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
