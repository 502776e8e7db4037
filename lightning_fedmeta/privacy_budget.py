"""The privacy spent by a run of ``model.dp``, and the stop before a round would exceed ``target_epsilon``.

ε after ``T`` rounds at ``δ`` is Opacus's RDP accountant for the subsampled Gaussian mechanism with sample rate
``q = m / N_train`` and one step per round (:class:`~lightning_fedmeta.privacy.PrivacyAccountant`). A run stops
*before* the round whose ε would exceed the target, so the published model never spent more than it.
"""

from __future__ import annotations

from lightning_fedmeta.privacy import DPSpec, PrivacyAccountant

__all__ = ["PrivacyBudget"]


class PrivacyBudget:
    """ε of ``dp`` at sample rate ``q`` after any number of rounds (the accountant advances incrementally)."""

    def __init__(self, dp: DPSpec, sample_rate: float) -> None:
        self.dp = dp
        self.sample_rate = sample_rate
        self._accountant = PrivacyAccountant(dp.noise_multiplier, sample_rate)
        self.stopped = False  # whether a run stopped on the target (checked by the frontend at the end)

    def epsilon(self, rounds: int) -> float:
        """ε after ``rounds`` rounds at ``dp.delta``."""
        if self._accountant.rounds != rounds:
            if self._accountant.rounds > rounds:
                self._accountant = PrivacyAccountant(self.dp.noise_multiplier, self.sample_rate)
            self._accountant.step(rounds - self._accountant.rounds)
        return self._accountant.epsilon(self.dp.delta)

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
        return (f"stopping before round {round_idx}: it would raise the privacy spent to ε = {after:.4g} > "
                f"model.dp.target_epsilon = {target:g} (δ = {self.dp.delta:g}); ε after {round_idx} rounds: "
                f"{spent:.4g}")
