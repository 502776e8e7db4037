"""Client-level differential privacy for the federated loop (DP-FedAvg), as pure functions.

The mechanism (McMahan, Ramage, Talwar, Zhang, "Learning Differentially Private Recurrent Language
Models", ICLR 2018, Algorithm 1 "DP-FedAvg" with flat clipping) bounds what the aggregate reveals
about any one *client* (all of its data), not about one sample. In round r, with the m clients
``S`` sampled from the N training clients (a fixed-size cohort, ``FederatedModule(clients_per_round=m)``),
every client's update Δ_i (all parameters flattened into one row) is clipped in L2 norm and the
server adds Gaussian noise to the sum::

    clip_C(Δ_i) = Δ_i · min(1, C / ‖Δ_i‖₂)                                  (clip_rows)
    Δ           = Σ_{i∈S} (1/m) · clip_C(Δ_i)  +  (σ_Δ · C / m) · ξ,   ξ ~ N(0, I)   (gaussian_noise)

The weights are uniform (1/m, a fixed denominator, McMahan et al. 2018, the estimator f̃_f), whatever
the module's ``aggregation``: a weight that depends on a client's data size would let that client's
data move the aggregate by more than C/m. Changing one client's data changes the clipped sum by at
most C (add/remove adjacency), and the noise on the sum has standard deviation σ_Δ·C, so each round
is a Gaussian mechanism with noise multiplier σ_Δ on a sample of the clients.

By default (simulation) the noise is drawn on the CPU from a ``torch.Generator`` seeded per released round
from ``(seed, "dp-noise", release)`` (:func:`lightning_fedmeta.client.sampling.generator_for`; one draw per parameter
tensor, in the model's parameter order), and the adaptive clip's count noise from ``(seed, "dp-clip", release)``,
so a run is reproducible, the same on every rank and device, and a resumed run draws the same noise as an
uninterrupted one. *Such noise is not secret*: the seed is in every checkpoint and config, and whoever reads it
can subtract the noise from a published update. ``secure_mode: true`` draws the noise and the cohort from a
secret instead (:mod:`lightning_fedmeta.privacy.draws`); only then does ε bound what a reader of the config learns.
``release`` counts every round this model ever released, across warm starts, so no noise is drawn twice.

Adaptive clipping (Andrew, Thakkar, McMahan, Ramaswamy, "Differentially Private Learning with
Adaptive Clipping", NeurIPS 2021, Algorithm 1 with the geometric update) replaces the fixed C by an
online, private estimate of the γ-quantile of the update norms::

    b̄ = ½ + (Σ_{i∈S} (1[‖Δ_i‖₂ ≤ C] − ½) + N(0, σ_b²)) / m̂,     C ← C · exp(−η_C · (b̄ − γ))      (adapt_clip)

with m̂ the expected number of clients that answer (m without dropout), as in TensorFlow Privacy's
``QuantileEstimatorQuery``.

The clipped-count query is a second Gaussian mechanism on the same sample; by their Theorem 1 the pair
(update sum with multiplier σ_Δ, count with σ_b) is exactly as private as one Gaussian mechanism with
multiplier z when σ_Δ = (z⁻² − (2σ_b)⁻²)^(−1/2) (:func:`noise_multipliers`). The accountant is therefore
always given z (``DPSpec.noise_multiplier``), and adaptive clipping costs a slightly larger σ_Δ, not ε.

Accounting (:class:`PrivacyAccountant`): one step of the sampled Gaussian mechanism per round, with
noise multiplier z and sample rate q = m / N, composed over the rounds by Rényi DP (Mironov, Talwar,
Zhang, "Rényi Differential Privacy of the Sampled Gaussian Mechanism", 2019) and converted to (ε, δ)
(Balle et al., AISTATS 2020, Theorem 21), through Opacus's ``RDPAccountant`` analysis. Caveat: that
analysis assumes Poisson subsampling (each client joins a round independently with probability q,
add/remove-one-client adjacency), while the loop samples a fixed-size cohort of m clients without
replacement. Reporting the Poisson ε for fixed-size cohorts is common practice (TensorFlow Federated's
DP aggregators and the experiments of McMahan et al. 2018 and Andrew et al. 2021 do so), but it is an
approximation, not a proof: the exact accounting for sampling without replacement differs (Wang, Balle,
Kasiviswanathan, "Subsampled Rényi Differential Privacy and Analytical Moments Accountant", AISTATS
2019), and the gap can be material (Lebeda, Regehr, Kamath, Steinke, "Avoiding Pitfalls for Privacy
Accounting of Subsampled Mechanisms under Composition", 2024). The guarantee also covers only what the
server publishes (the noisy aggregates, hence the global model); client state kept outside the
aggregate (personal models, control variates) and the evaluation are not privatised.

Opacus (``pip install "lightning-fedmeta[privacy]"``) is imported only when ε is computed: importing it
costs seconds.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, fields
from types import SimpleNamespace
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "AdaptiveClipSpec",
    "DPSpec",
    "PrivacyAccountant",
    "adapt_clip",
    "clip_rows",
    "gaussian_noise",
    "noise_multipliers",
    "parse_dp",
]

#: the install command named when Opacus is missing
INSTALL_HINT = 'pip install "lightning-fedmeta[privacy]"'


@dataclass(frozen=True)
class AdaptiveClipSpec:
    """Adaptive clipping to a quantile of the update norms (Andrew et al., NeurIPS 2021, Algorithm 1).

    Attributes:
        target_quantile: γ, the fraction of updates left unclipped at the fixed point (0.5: the median,
            the paper's recommendation); in (0, 1).
        lr: η_C, the learning rate of the geometric update C ← C·exp(−η_C(b̄ − γ)) (0.2 in the paper):
            C changes by at most a factor exp(η_C) per round.
        count_noise_multiplier: σ_b, the standard deviation of the noise on the count of unclipped
            updates; ``None`` = the paper's default m/20 (m = clients per round, Section 3: "σ_b = m/20").
    """

    target_quantile: float = 0.5
    lr: float = 0.2
    count_noise_multiplier: float | None = None

    def __post_init__(self) -> None:
        _check_adaptive(self, "dp.adaptive_clip")


@dataclass(frozen=True)
class DPSpec:
    """Client-level differential privacy of the aggregate (DP-FedAvg; see the module docstring).

    Attributes:
        clip: C, the L2 bound on each client's update (the initial C when ``adaptive``); ``math.inf``
            means no clipping (allowed only with ``noise_multiplier = 0``: the noise scale is z·C).
        noise_multiplier: z, the noise standard deviation on the *sum* of clipped updates is z·C
            (on the mean, z·C/m); 0 adds no noise (and gives ε = ∞).
        delta: δ of the reported (ε, δ) guarantee; in (0, 1), customarily below 1/N.
        target_epsilon: stop training before the round that would make ε exceed it (``None``: never).
        adaptive: adaptive clipping (``None``: the fixed clip C).
        secure_mode: draw the noise and the cohort from a secret (:mod:`lightning_fedmeta.privacy.draws`) instead of
            ``model.seed``; without it anyone who reads the seed (every checkpoint and config holds it) can
            regenerate the noise, so the reported ε holds only against someone who does not know the seed.
        sampling: ``"fixed"`` (a cohort of exactly m clients, the accountant's Poisson ε is an approximation) or
            ``"poisson"`` (each training client joins a round independently with probability q = m / N, the
            sampling the accountant assumes, so its ε is the guarantee).
        batchnorm: BatchNorm running statistics of the published model: ``"private"`` (each client's change of
            the statistics is clipped together with its update and noised with it) or ``"local"`` (kept on the
            clients; the published model keeps its initial statistics).
    """

    clip: float = 1.0
    noise_multiplier: float = 1.0
    delta: float = 1e-5
    target_epsilon: float | None = None
    adaptive: AdaptiveClipSpec | None = None
    secure_mode: bool = False
    sampling: str = "fixed"
    batchnorm: str = "private"

    def __post_init__(self) -> None:
        _check_dp(self, "dp")


def hides_cohort_size(spec: DPSpec | None) -> bool:
    """Whether a round's cohort size is part of what ``spec`` hides: Poisson sampling (its size is random) from a
    secret (``secure_mode``). The byte counts of a round (``comm/*``: its cohort's size times one client's bytes)
    are then neither logged nor summed, in simulation and on Flower."""
    return spec is not None and bool(spec.secure_mode) and spec.sampling == "poisson"


# ----------------------------------------------------------------------------------------------
# parsing and validation
# ----------------------------------------------------------------------------------------------
def _number(value: Any, name: str, *, allow_inf: bool = False) -> float:
    """``value`` as a float: an int or a float (not a bool); with ``allow_inf``, also the strings
    ``"inf"``/``".inf"``/``"infinity"`` (what a YAML file may hold)."""
    if allow_inf and isinstance(value, str) and value.strip().lower().lstrip(".") in ("inf", "infinity"):
        return math.inf
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    out = float(value)
    if math.isnan(out) or (math.isinf(out) and not allow_inf):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return out


def _check_adaptive(spec: AdaptiveClipSpec, option: str) -> None:
    if not 0 < spec.target_quantile < 1:
        raise ValueError(f"{option}.target_quantile must be in (0, 1), got {spec.target_quantile!r}")
    if not (spec.lr > 0 and math.isfinite(spec.lr)):
        raise ValueError(f"{option}.lr must be a finite number > 0, got {spec.lr!r}")
    sb = spec.count_noise_multiplier
    if sb is not None and not (sb >= 0 and math.isfinite(sb)):
        raise ValueError(f"{option}.count_noise_multiplier must be a finite number >= 0 (or null), got {sb!r}")


def _check_dp(spec: DPSpec, option: str) -> None:
    if not spec.clip > 0:  # also refuses NaN
        raise ValueError(f"{option}.clip must be > 0 (or inf for no clipping), got {spec.clip!r}")
    if not (spec.noise_multiplier >= 0 and math.isfinite(spec.noise_multiplier)):
        raise ValueError(f"{option}.noise_multiplier must be a finite number >= 0, got {spec.noise_multiplier!r}")
    if not 0 < spec.delta < 1:
        raise ValueError(f"{option}.delta must be in (0, 1), got {spec.delta!r}")
    if math.isinf(spec.clip) and spec.noise_multiplier > 0:
        raise ValueError(
            f"{option}.clip=inf (no clipping) leaves the noise scale noise_multiplier·clip infinite; give a finite "
            f"clip, or noise_multiplier 0 (got {option}.noise_multiplier={spec.noise_multiplier!r})"
        )
    if math.isinf(spec.clip) and spec.adaptive is not None:
        raise ValueError(f"{option}.clip must be finite with adaptive_clip (it is the initial clip), got inf")
    if spec.target_epsilon is not None:
        if not (spec.target_epsilon > 0 and math.isfinite(spec.target_epsilon)):
            raise ValueError(f"{option}.target_epsilon must be a finite number > 0, got {spec.target_epsilon!r}")
        if spec.noise_multiplier == 0:
            raise ValueError(
                f"{option}.target_epsilon={spec.target_epsilon!r} needs noise: with noise_multiplier 0 the "
                "mechanism is not private (ε = ∞) and no round could run; set noise_multiplier > 0"
            )
    if spec.adaptive is not None:
        _check_adaptive(spec.adaptive, f"{option}.adaptive_clip")
    if not isinstance(spec.secure_mode, bool):
        raise ValueError(f"{option}.secure_mode must be true or false, got {spec.secure_mode!r}")
    for key, choices in (("sampling", SAMPLINGS), ("batchnorm", BATCHNORM_MODES)):
        if getattr(spec, key) not in choices:
            raise ValueError(f"{option}.{key} must be one of {list(choices)}, got {getattr(spec, key)!r}")


SAMPLINGS = ("fixed", "poisson")
BATCHNORM_MODES = ("private", "local")
_DP_KEYS = ("clip", "noise_multiplier", "delta", "target_epsilon", "adaptive_clip", "secure_mode", "sampling",
            "batchnorm")
_ADAPTIVE_KEYS = tuple(f.name for f in fields(AdaptiveClipSpec))


def _draft(cls: type, args: dict[str, Any]) -> Any:
    """The fields ``cls(**args)`` would have, unchecked (validated under the user's option name first)."""
    return SimpleNamespace(**{f.name: args.get(f.name, f.default) for f in fields(cls)})


def _parse_adaptive(value: Any, option: str) -> AdaptiveClipSpec | None:
    if value is None or value is False:
        return None
    if value is True:
        return AdaptiveClipSpec()
    if not isinstance(value, Mapping):
        raise ValueError(f"{option} must be true, false or a mapping of {list(_ADAPTIVE_KEYS)}, got {value!r}")
    unknown = sorted(str(k) for k in value if k not in _ADAPTIVE_KEYS)
    if unknown:
        raise ValueError(f"{option}.{unknown[0]} is not an option; choose from {list(_ADAPTIVE_KEYS)} "
                         f"(got {option}={dict(value)!r})")
    args: dict[str, Any] = {}
    for key in ("target_quantile", "lr"):
        if key in value:
            args[key] = _number(value[key], f"{option}.{key}")
    if value.get("count_noise_multiplier") is not None:
        args["count_noise_multiplier"] = _number(value["count_noise_multiplier"], f"{option}.count_noise_multiplier")
    _check_adaptive(_draft(AdaptiveClipSpec, args), option)  # named as the user wrote it, before the dataclass
    return AdaptiveClipSpec(**args)


def parse_dp(spec: Mapping[str, Any] | DPSpec | None, option: str = "model.dp") -> DPSpec | None:
    """The :class:`DPSpec` of a user's mapping (``FederatedModule(dp=...)``, ``model.dp`` in a config).

    Keys: ``clip``, ``noise_multiplier``, ``delta``, ``target_epsilon``, ``adaptive_clip`` (``true`` for the
    paper's defaults, or a mapping of :class:`AdaptiveClipSpec` fields: ``target_quantile``, ``lr``,
    ``count_noise_multiplier``), ``secure_mode``, ``sampling`` and ``batchnorm``; missing keys take
    :class:`DPSpec`'s defaults, ``None`` gives ``None`` (no DP) and a :class:`DPSpec` is returned as it is. An
    unknown key, a value of the wrong type or out of range raises ``ValueError`` naming ``f"{option}.{key}"`` and
    the value.
    """
    if spec is None:
        return None
    if isinstance(spec, DPSpec):
        return spec
    if not isinstance(spec, Mapping):
        raise ValueError(f"{option} must be a mapping of {list(_DP_KEYS)} (or null for no privacy), got {spec!r}")
    unknown = sorted(str(k) for k in spec if k not in _DP_KEYS)
    if unknown:
        raise ValueError(f"{option}.{unknown[0]} is not an option; choose from {list(_DP_KEYS)} "
                         f"(got {option}={dict(spec)!r})")
    args: dict[str, Any] = {}
    if "clip" in spec:
        args["clip"] = _number(spec["clip"], f"{option}.clip", allow_inf=True)
    for key in ("noise_multiplier", "delta"):
        if key in spec:
            args[key] = _number(spec[key], f"{option}.{key}")
    if spec.get("target_epsilon") is not None:
        args["target_epsilon"] = _number(spec["target_epsilon"], f"{option}.target_epsilon")
    args["adaptive"] = _parse_adaptive(spec.get("adaptive_clip"), f"{option}.adaptive_clip")
    for key in ("secure_mode", "sampling", "batchnorm"):
        if spec.get(key) is not None:
            args[key] = spec[key]
    _check_dp(_draft(DPSpec, args), option)  # named as the user wrote it, before the dataclass checks it again
    return DPSpec(**args)


# ----------------------------------------------------------------------------------------------
# the mechanism
# ----------------------------------------------------------------------------------------------
def clip_rows(rows: Tensor, clip: float | Tensor) -> tuple[Tensor, Tensor]:
    """Clip every row of ``rows`` ``[n, d]`` to L2 norm at most ``clip``: ``(rows·min(1, C/‖row‖₂), norms)``.

    Flat clipping of DP-FedAvg (McMahan et al., ICLR 2018, Algorithm 1, ``ClipFn``): a client's whole update
    is one row. ``norms`` (``[n]``, the norms *before* clipping) feed :func:`adapt_clip`'s count. A row
    already inside the ball (‖row‖ ≤ C, zero rows included) is multiplied by exactly 1, so it is returned bit
    for bit, and ``clip = inf`` returns ``rows`` itself. A clipped row's norm is C up to float rounding (a
    relative 1e-6 in float32, as in every DP-SGD implementation). Half-precision rows (float16, bfloat16) are
    clipped and returned in float32: rounded back to 8 mantissa bits a clipped bfloat16 row's norm reaches
    1.009·C, which would break the sensitivity bound the noise is calibrated to.
    """
    if rows.dim() != 2:
        raise ValueError(f"clip_rows takes rows of shape [n, d], got {tuple(rows.shape)}")
    if rows.dtype in (torch.float16, torch.bfloat16):  # a half-precision row rounded after clipping overshoots C
        rows = rows.float()
    norms = torch.linalg.vector_norm(rows, dim=1)
    if isinstance(clip, Tensor):
        c = clip.to(device=rows.device, dtype=norms.dtype)
        if bool(torch.isinf(c).all()):
            return rows, norms
    else:
        if math.isinf(clip):
            return rows, norms
        c = torch.tensor(clip, device=rows.device, dtype=norms.dtype)
    factor = torch.where(norms > c, c / norms, torch.ones_like(norms))
    return rows * factor.unsqueeze(1).to(rows.dtype), norms


def noise_multipliers(spec: DPSpec, cohort: int, *, option: str = "model.dp") -> tuple[float, float]:
    """``(σ_Δ, σ_b)``: the noise multipliers of the update sum and of the unclipped-count sum.

    Without adaptive clipping ``(z, 0)``. With it (Andrew et al., NeurIPS 2021, Theorem 1), σ_b is
    ``count_noise_multiplier`` or the paper's default ``cohort / 20``, and

        σ_Δ = (z⁻² − (2σ_b)⁻²)^(−1/2)

    so that releasing both sums is exactly as private as one Gaussian mechanism with multiplier z (the
    count has sensitivity 1/2 after centring b_i − 1/2, hence the 2σ_b). Requires z < 2σ_b; otherwise the
    count alone would spend more than the whole budget, and a ``ValueError`` names the option. With z = 0
    (no privacy) the result is ``(0, σ_b)`` with σ_b = ``count_noise_multiplier`` or 0 (no noise at all).
    """
    if isinstance(cohort, bool) or not isinstance(cohort, int) or cohort < 1:
        raise ValueError(f"cohort (clients per round) must be an integer >= 1, got {cohort!r}")
    z = float(spec.noise_multiplier)
    if spec.adaptive is None:
        return z, 0.0
    given = spec.adaptive.count_noise_multiplier
    if z == 0:
        return 0.0, float(given or 0.0)
    sigma_b = float(given) if given is not None else cohort / 20
    if not z < 2 * sigma_b:
        source = (f"{option}.adaptive_clip.count_noise_multiplier = {sigma_b!r}" if given is not None
                  else f"σ_b = the default m/20 = {cohort}/20 = {sigma_b!r}")
        raise ValueError(
            f"{option}.noise_multiplier={z!r} must be below 2·σ_b = {2 * sigma_b!r} ({source}): Andrew et al.'s "
            "Theorem 1 gives the update noise σ_Δ = (z⁻² − (2σ_b)⁻²)^(−1/2), which needs z < 2σ_b; raise "
            f"{option}.adaptive_clip.count_noise_multiplier, sample more clients per round, or lower "
            f"{option}.noise_multiplier"
        )
    return (z ** -2 - (2 * sigma_b) ** -2) ** -0.5, sigma_b


def gaussian_noise(like: Tensor, std: float, generator: torch.Generator) -> Tensor:
    """N(0, std²) noise with the shape, dtype and device of ``like``, drawn on the CPU from ``generator``.

    Drawing on the CPU makes the noise the same on every device and rank (float32 draws for half
    precision ``like``, then cast). ``std == 0`` gives exact zeros and draws nothing (never 0·inf)."""
    std = float(std)
    if not (std >= 0 and math.isfinite(std)):
        raise ValueError(f"the noise standard deviation must be a finite number >= 0, got {std!r}")
    if std == 0:
        return torch.zeros_like(like)
    dtype = torch.float64 if like.dtype == torch.float64 else torch.float32
    noise = torch.randn(like.shape, generator=generator, dtype=dtype, device="cpu") * std
    return noise.to(device=like.device, dtype=like.dtype)


def adapt_clip(
    clip: float, norms: Tensor, cohort: int, spec: DPSpec, standard_normal: float = 0.0, *,
    expected_answers: float | None = None, option: str = "model.dp",
) -> float:
    """The next round's clip by the geometric update (Andrew et al., NeurIPS 2021, Algorithm 1):

        b̄ = ½ + (Σ_{i answered} (1[‖Δ_i‖₂ ≤ C] − ½) + σ_b ξ) / m̂,   clamped to [0, 1]
        C ← C · exp(−η_C (b̄ − γ))

    ``norms``: the update norms (before clipping, :func:`clip_rows`) of the clients that answered; ``ξ`` =
    ``standard_normal`` (one N(0, 1) draw, ignored when σ_b = 0); σ_b from :func:`noise_multipliers`;
    γ = ``target_quantile``, η_C = ``lr``; ``m̂ = expected_answers``, the expected number of clients that answer
    (``cohort`` when every sampled client answers).

    The centred indicators and the expected denominator are those of the reference implementation,
    TensorFlow Privacy's ``QuantileEstimatorQuery`` (``tensorflow_privacy/privacy/dp_query/
    quantile_estimator_query.py``: ``below = (record <= estimate) − 0.5``, a ``GaussianAverageQuery`` with
    ``denominator=expected_num_records``, ``below_estimate = result + 0.5`` clipped to [0, 1]). Centring makes the
    count's sensitivity ½ (adding or removing one client moves the sum by at most ½), which Theorem 1's
    ``(2σ_b)⁻²`` in :func:`noise_multipliers` assumes; a client that did not answer contributes 0, so under
    dropout ``E[b̄] = ½ + m̂(F(C) − ½)/m̂ = F(C)``: C settles at the γ-quantile of the norms, whatever the dropout.
    With every client answering and m̂ = m this is ``(Σ_i 1[‖Δ_i‖ ≤ C] + σ_b ξ) / m``, the paper's form."""
    if spec.adaptive is None:
        raise ValueError(f"adapt_clip needs a DPSpec with adaptive clipping ({option}.adaptive_clip)")
    if norms.dim() != 1:
        raise ValueError(f"adapt_clip takes the answering clients' norms [n], got shape {tuple(norms.shape)}")
    expected = float(cohort if expected_answers is None else expected_answers)
    if not expected > 0:
        raise ValueError(f"adapt_clip: the expected number of answering clients must be > 0, got {expected!r}")
    _, sigma_b = noise_multipliers(spec, cohort, option=option)
    unclipped = float((norms.detach().double().cpu() <= clip).sum())
    unclipped += (expected - float(norms.numel())) / 2  # ½ per missing answer: the centred sum, shifted by m̂/2
    if sigma_b > 0:
        unclipped += sigma_b * float(standard_normal)
    fraction = min(1.0, max(0.0, unclipped / expected))
    return float(clip) * math.exp(-spec.adaptive.lr * (fraction - spec.adaptive.target_quantile))


# ----------------------------------------------------------------------------------------------
# accounting
# ----------------------------------------------------------------------------------------------
def _rdp_analysis() -> Any:
    """Opacus's RDP analysis module (``opacus.accountants.analysis.rdp``), imported on first use."""
    try:
        from opacus.accountants import RDPAccountant
        from opacus.accountants.analysis import rdp
    except ImportError as exc:  # pragma: no cover - the privacy extra is installed in the test environment
        raise ImportError(
            f"client-level differential privacy (model.dp) accounts ε with Opacus, which is not installed: "
            f"{INSTALL_HINT}"
        ) from exc
    return rdp, RDPAccountant.DEFAULT_ALPHAS


class PrivacyAccountant:
    """ε spent by the subsampled Gaussian mechanism, from Opacus's RDP accountant (opacus.accountants.RDPAccountant).

    One :meth:`step` per round of DP-FedAvg, with ``noise_multiplier`` z (the multiplier of the whole
    round's release: with adaptive clipping, Theorem 1 of Andrew et al. makes the pair of sums exactly as
    private as multiplier z, see :func:`noise_multipliers`) and ``sample_rate`` q = m / N (clients per round
    over training clients). The RDP of ``rounds`` steps at Opacus's default orders, converted to (ε, δ), is
    what ``RDPAccountant`` with the same history returns, bit for bit (per-step RDP is computed once and
    cached). The history is a list of ``(z, q, rounds)``, as Opacus keeps it, so a run resumed with other
    settings composes both phases correctly. Opacus's analysis assumes Poisson subsampling while the loop
    samples a fixed-size cohort (see the module docstring for this caveat and its references). Opacus's
    warning that the optimal order lies at the edge of the orders it searches is silenced: the bound is
    then valid, only looser.
    """

    def __init__(self, noise_multiplier: float, sample_rate: float) -> None:
        noise_multiplier, sample_rate = float(noise_multiplier), float(sample_rate)
        if not (noise_multiplier >= 0 and math.isfinite(noise_multiplier)):
            raise ValueError(f"noise_multiplier must be a finite number >= 0, got {noise_multiplier!r}")
        if not 0 < sample_rate <= 1:
            raise ValueError(f"sample_rate (clients per round / training clients) must be in (0, 1], "
                             f"got {sample_rate!r}")
        self.noise_multiplier = noise_multiplier
        self.sample_rate = sample_rate
        self.history: list[tuple[float, float, int]] = []
        self._rdp_cache: dict[tuple[float, float], Any] = {}

    @property
    def rounds(self) -> int:
        """Rounds accounted so far (all phases of the history)."""
        return sum(steps for _, _, steps in self.history)

    def step(self, rounds: int = 1) -> None:
        """Account ``rounds`` more rounds at the current (z, q)."""
        if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 0:
            raise ValueError(f"rounds must be an integer >= 0, got {rounds!r}")
        if rounds:
            self.history = self._extended(rounds)

    def _extended(self, rounds: int) -> list[tuple[float, float, int]]:
        history = list(self.history)
        if history and history[-1][:2] == (self.noise_multiplier, self.sample_rate):
            z, q, steps = history.pop()
            history.append((z, q, steps + rounds))
        elif rounds:
            history.append((self.noise_multiplier, self.sample_rate, rounds))
        return history

    def _epsilon_of(self, history: list[tuple[float, float, int]], delta: float) -> float:
        if not 0 < delta < 1:
            raise ValueError(f"delta must be in (0, 1), got {delta!r}")
        history = [h for h in history if h[2] > 0]
        if not history:
            return 0.0
        if any(z == 0 for z, _, _ in history):
            return math.inf
        rdp, orders = _rdp_analysis()
        total = sum(self._per_step_rdp(rdp, orders, z, q) * steps for z, q, steps in history)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Optimal order is the")
            eps, _ = rdp.get_privacy_spent(orders=orders, rdp=total, delta=delta)
        return float(eps)

    def _per_step_rdp(self, rdp: Any, orders: list[float], z: float, q: float) -> Any:
        key = (z, q)
        if key not in self._rdp_cache:
            self._rdp_cache[key] = rdp.compute_rdp(q=q, noise_multiplier=z, steps=1, orders=orders)
        return self._rdp_cache[key]

    def epsilon(self, delta: float) -> float:
        """ε of the (ε, δ) guarantee after the rounds so far: 0 before any round, inf when z = 0."""
        return self._epsilon_of(self.history, delta)

    def epsilon_after(self, extra_rounds: int, delta: float) -> float:
        """ε if ``extra_rounds`` more rounds ran at the current (z, q); the accountant is not changed."""
        if isinstance(extra_rounds, bool) or not isinstance(extra_rounds, int) or extra_rounds < 0:
            raise ValueError(f"extra_rounds must be an integer >= 0, got {extra_rounds!r}")
        return self._epsilon_of(self._extended(extra_rounds), delta)

    def state_dict(self) -> dict[str, Any]:
        """Plain values only (a checkpoint loads with ``torch.load(weights_only=True)``)."""
        return {
            "noise_multiplier": self.noise_multiplier,
            "sample_rate": self.sample_rate,
            "history": [[float(z), float(q), int(steps)] for z, q, steps in self.history],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the history of :meth:`state_dict`. The current (z, q) stay those given to the constructor,
        so the next rounds are accounted at this run's settings."""
        history = state.get("history")
        if not isinstance(history, list):
            raise ValueError(f"a PrivacyAccountant state needs a 'history' list, got keys {sorted(state)}")
        self.history = [(float(z), float(q), int(steps)) for z, q, steps in history]
