"""The privacy spent by a model under ``model.dp``, across fits, and the stop before a round would exceed
``target_epsilon``.

ε after the rounds released so far is Opacus's RDP accountant for the subsampled Gaussian mechanism with sample rate
``q = m / N_train`` and one step per round (:class:`~lightning_fedmeta.privacy.mechanism.PrivacyAccountant`). The
history of
``(z, q, rounds)`` phases travels with the model in its checkpoints (:meth:`PrivacyBudget.record`), so a warm start
(``load_from_checkpoint`` then a new ``fit``) continues ε instead of restarting it at 0, and continues the release
count, so it draws no noise and no cohort an earlier fit drew. A run stops *before* the round whose ε would exceed
the target, so the published model never spent more than it.
"""

from __future__ import annotations

from typing import Any

from lightning_fedmeta.privacy.mechanism import DPSpec, PrivacyAccountant

__all__ = ["PrivacyBudget", "SEEDED_NOISE_NOTE", "without_last_rounds"]

#: appended to every ε the library reports when the noise is drawn from the seed (``secure_mode`` off)
SEEDED_NOISE_NOTE = ("model.dp.secure_mode is off: the noise and cohorts are reproducible from model.seed, which "
                     "every checkpoint and config holds, so this ε holds only against someone who does not know it")

History = list[tuple[float, float, int]]


def without_last_rounds(history: History, rounds: int) -> History:
    """``history`` with its last ``rounds`` rounds removed (the rounds a resumed fit accounts itself)."""
    out = [list(h) for h in history]
    while rounds > 0 and out:
        take = min(rounds, int(out[-1][2]))
        out[-1][2] -= take
        rounds -= take
        if out[-1][2] == 0:
            out.pop()
    if rounds > 0:
        raise ValueError(f"the checkpoint's privacy record covers fewer rounds than its step ({rounds} missing)")
    return [(float(z), float(q), int(n)) for z, q, n in out]


class PrivacyBudget:
    """ε of ``dp`` at sample rate ``q`` after the ``prior`` phases (earlier fits) and any number of rounds of this fit.

    Args:
        dp: this fit's DP settings (z, δ, target).
        sample_rate: ``q = m / N`` of this fit.
        prior: the ``(z, q, rounds)`` phases the model released in earlier fits (a warm start's checkpoint).
        released_before: the number of rounds those fits released (the release index of this fit's round 0).
    """

    def __init__(self, dp: DPSpec, sample_rate: float, prior: History | None = None, released_before: int = 0) -> None:
        self.dp = dp
        self.sample_rate = sample_rate
        self.prior: History = list(prior or [])
        self.released_before = released_before
        self._accountant = PrivacyAccountant(dp.noise_multiplier, sample_rate)
        self.stopped = False  # whether a run stopped on the target (checked by the frontend at the end)

    def history(self, rounds: int) -> History:
        """Every phase released after ``rounds`` rounds of this fit (what a checkpoint stores)."""
        self._accountant.history = list(self.prior)
        self._accountant.step(rounds)
        return list(self._accountant.history)

    def epsilon(self, rounds: int) -> float:
        """ε at ``dp.delta`` after the earlier fits and ``rounds`` rounds of this one."""
        self.history(rounds)
        return self._accountant.epsilon(self.dp.delta)

    def record(self, rounds: int) -> dict[str, Any]:
        """The checkpoint's privacy record after ``rounds`` rounds of this fit (plain values only)."""
        return {"history": [[z, q, n] for z, q, n in self.history(rounds)], "released": self.released_before + rounds}

    def summary(self, rounds: int) -> str:
        """One line: ε after the model's rounds so far, and whether it holds against a reader of the seed."""
        total = self.released_before + rounds
        note = "noise from a secret (model.dp.secure_mode)" if self.dp.secure_mode else SEEDED_NOISE_NOTE
        return (f"[lightning_fedmeta] privacy: ε = {self.epsilon(rounds):.4g} at δ = {self.dp.delta:g} after {total} "
                f"released rounds; {note}")

    def refusal(self, round_idx: int) -> str | None:
        """Why round ``round_idx`` must not run (its ε would exceed ``target_epsilon``), else ``None``."""
        target = self.dp.target_epsilon
        if target is None:
            return None
        spent = self.epsilon(round_idx)
        after = self._accountant.epsilon_after(1, self.dp.delta)
        if after <= target:
            return None
        self.stopped = True
        earlier = f" (earlier fits included: {self.released_before} rounds)" if self.released_before else ""
        return (f"stopping before round {round_idx}: it would raise the privacy spent to ε = {after:.4g} > "
                f"model.dp.target_epsilon = {target:g} (δ = {self.dp.delta:g}); ε after {round_idx} rounds"
                f"{earlier}: {spent:.4g}{'' if self.dp.secure_mode else ' (' + SEEDED_NOISE_NOTE + ')'}")
