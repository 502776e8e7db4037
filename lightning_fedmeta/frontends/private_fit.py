"""The start of a fit under ``model.dp``: continue the model's privacy record, and choose where the noise comes from.

A fit starts at round ``global_step`` (0, or a resumed checkpoint's step). The model may have released rounds in
earlier fits (a warm start: ``load_from_checkpoint`` then ``fit``); the checkpoint's privacy record (``history``,
``released``) says how many and at which ``(z, q)``:

    offset = released − global_step          the release index of this fit's round 0
    prior  = history without its last global_step rounds       (the resumed rounds are this fit's own)

so ε continues (:class:`~lightning_fedmeta.privacy.budget.PrivacyBudget`) and the DP draws of round ``r`` use the
release index ``offset + r``: a warm start never reuses an earlier fit's noise or cohorts. Under
``model.dp.secure_mode`` a fresh secret key (``os.urandom``, rank 0's broadcast to every rank) keys the draws
(:mod:`lightning_fedmeta.privacy.draws`); otherwise a one-line warning says the ε assumes a secret seed.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from lightning.pytorch.utilities import rank_zero_warn

from lightning_fedmeta.privacy.budget import SEEDED_NOISE_NOTE, History, PrivacyBudget, without_last_rounds
from lightning_fedmeta.privacy.draws import KEY_BYTES
from lightning_fedmeta.privacy.mechanism import hides_cohort_size

if TYPE_CHECKING:
    from lightning_fedmeta.loop.engine import RoundEngine
    from lightning_fedmeta.privacy.mechanism import DPSpec

__all__ = ["PrivateFit", "continue_privacy_record", "parse_privacy_record", "start_private_fit"]

#: what is said when a model whose earlier rounds have no privacy record starts a DP fit
NO_RECORD_NOTE = ("its {rounds} rounds were trained without model.dp or by an older release, and ε counts only the "
                  "rounds from now on")


def parse_privacy_record(record: Any) -> tuple[History, int]:
    """``(history, released)`` of a checkpoint's privacy record, checked (a ``ValueError`` names what is wrong)."""
    if not isinstance(record, Mapping) or not isinstance(record.get("history"), list):
        raise ValueError(f"the checkpoint's privacy record must be a mapping with a 'history' list, got {record!r}")
    history: History = []
    for phase in record["history"]:
        if not (isinstance(phase, (list, tuple)) and len(phase) == 3):
            raise ValueError(f"a privacy history phase is [noise_multiplier, sample_rate, rounds], got {phase!r}")
        z, q, n = float(phase[0]), float(phase[1]), phase[2]
        if not (z >= 0 and math.isfinite(z) and 0 < q <= 1 and isinstance(n, int) and n >= 0):
            raise ValueError(f"a privacy history phase is out of range: {phase!r}")
        history.append((z, q, n))
    released = record.get("released")
    if isinstance(released, bool) or not isinstance(released, int) or released < sum(n for _, _, n in history):
        raise ValueError(f"the privacy record's 'released' must be an int >= the rounds of its history, got "
                         f"{released!r}")
    return history, released


def _record(saved_privacy: Mapping[str, Any] | None, loaded_round: int, step: int) -> tuple[History, int]:
    if saved_privacy is not None:
        return parse_privacy_record(saved_privacy)
    if loaded_round > step:  # a warm start from a checkpoint without a record (no DP, or an older release)
        rank_zero_warn(f"[lightning_fedmeta] the loaded checkpoint has no privacy record: "
                       f"{NO_RECORD_NOTE.format(rounds=loaded_round)}", category=UserWarning)
        return [], loaded_round
    return [], step


def start_private_fit(dp: DPSpec, engine: RoundEngine, *, step: int, saved_privacy: Mapping[str, Any] | None,
                      loaded_round: int, broadcast: Callable[[bytes], bytes] | None = None) -> PrivacyBudget:
    """Start the engine's releases of this fit (its offset and DP draws: :meth:`RoundEngine.start_releases`) and
    return its privacy budget at ``q = m / N``. ``step`` is the fit's first round, ``saved_privacy`` and
    ``loaded_round`` a loaded checkpoint's record and round, ``broadcast`` gives every rank rank 0's secret key."""
    history, released = _record(saved_privacy, loaded_round, step)
    offset = released - step
    if offset < 0:
        raise ValueError(f"the checkpoint's privacy record says {released} rounds were released, fewer than its "
                         f"{step} steps: the record is damaged or from another run")
    prior = without_last_rounds(history, step) if history else []
    key = None
    if dp.secure_mode:
        key = os.urandom(KEY_BYTES)
        if broadcast is not None:
            key = broadcast(key)  # one secret for every rank: the same draws
    else:
        rank_zero_warn(f"[lightning_fedmeta] {SEEDED_NOISE_NOTE}; set model.dp.secure_mode: true for a guarantee "
                       "against them", category=UserWarning)
    engine.start_releases(offset, key, hides_cohort_size(dp))
    federation = engine.federation
    return PrivacyBudget(dp, federation.num_sampled / int(federation.eligible.numel()), prior, offset)


def continue_privacy_record(dp: Any, sample_rate: float, record: Any, rounds_done: int,
                            warn: Any) -> PrivacyBudget:
    """The budget of a run that resumes after ``rounds_done`` rounds with the checkpoint's privacy ``record``
    (``None``: none), as a warm start continues one: the recorded phases are kept with the ``(z, q)`` that released
    them, and the run's own rounds are counted from ``rounds_done`` on (``budget.epsilon(r + 1 − rounds_done)``
    after round ``r``), so a restart with another noise multiplier never lowers ε. Without a record after
    ``rounds_done > 0`` rounds, ``warn`` says that ε counts only the new rounds (they ran without DP)."""
    if record is None:
        history: History = []
        released = int(rounds_done)
        if rounds_done > 0:
            warn(f"the checkpoint has no privacy record: {NO_RECORD_NOTE.format(rounds=rounds_done)}")
    else:
        history, released = parse_privacy_record(record)
    if released < rounds_done:
        raise ValueError(f"the checkpoint's privacy record says {released} rounds were released, fewer than its "
                         f"{rounds_done} rounds: the record is damaged or from another run")
    return PrivacyBudget(dp, sample_rate, history, released)


class PrivateFit:
    """The privacy side of a module's fits under ``model.dp`` (``dp``): this fit's budget, ε, the checkpoint's
    record and the stop before ``target_epsilon``; ``sample_rate()`` is ``q = m / N`` (read only under DP, once
    the data is bound). Without DP every query says so (``None``, or a ``ValueError`` for ε)."""

    def __init__(self, dp: DPSpec | None, sample_rate: Callable[[], float]) -> None:
        self.dp = dp
        self.sample_rate = sample_rate
        self._budget: PrivacyBudget | None = None

    @property
    def started(self) -> PrivacyBudget | None:
        """This fit's budget once :meth:`start` or a query made it (``None``: not yet, or no DP)."""
        return self._budget

    def start(self, engine: RoundEngine, *, step: int, saved_privacy: Mapping[str, Any] | None, loaded_round: int,
              broadcast: Callable[[bytes], bytes] | None = None) -> None:
        """:func:`start_private_fit` for this fit (nothing without DP)."""
        if self.dp is not None:
            self._budget = start_private_fit(self.dp, engine, step=step, saved_privacy=saved_privacy,
                                             loaded_round=loaded_round, broadcast=broadcast)

    def budget(self) -> PrivacyBudget:
        """This fit's budget (made fresh if no fit started it: a module used outside ``fit``)."""
        if self.dp is None:
            raise ValueError("model.dp is not set: no privacy is accounted")
        if self._budget is None:
            self._budget = PrivacyBudget(self.dp, self.sample_rate())
        return self._budget

    def record(self, step: int) -> dict[str, Any] | None:
        """The checkpoint's privacy record after ``step`` rounds (``None`` without DP)."""
        return None if self.dp is None else self.budget().record(step)

    def refusal(self, step: int) -> str | None:
        """Why round ``step`` must not run (``model.dp.target_epsilon`` would be exceeded), else ``None``."""
        if self.dp is None or self.dp.target_epsilon is None:
            return None
        return self.budget().refusal(step)
