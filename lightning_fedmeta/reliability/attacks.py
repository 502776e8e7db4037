"""Simulated Byzantine clients: who they are, and what they upload instead of their honest delta.

A fixed fraction of the *training* clients is Byzantine for the whole run
(:func:`choose_byzantine_clients`, a pure function of the seed). In every round the Byzantine clients
among the sampled ones replace their upload (:func:`attack_rows`), or, for ``label_flip``, train on
flipped labels (:func:`flip_labels`; the upload is then their honest delta on poisoned data).

Notation: ``Δ_i`` is client i's honest delta this round, ``H`` the honest clients of the round,
``μ = 1/|H| Σ_{i∈H} Δ_i`` their mean and ``σ`` their coordinate-wise standard deviation (Bessel-corrected,
as ByzFL's ``ALittleIsEnough``); n is the number of clients in the round and f the number of
Byzantine ones among them.

============  ==================================================  ==============================================
attack        a Byzantine client i uploads                        source
============  ==================================================  ==============================================
sign_flip     ``−μ``                                              Allen-Zhu et al. 2021; ByzFL ``SignFlipping``
scaled        ``s · Δ_i`` (s = ``scale``, default 10)             Bhagoji et al. 2019 (explicit boosting)
gaussian      ``ξ ~ N(0, std² I)`` (std default 200)              Blanchard et al. 2017, Sec. 5
alie          ``μ + z σ``, ``z = Φ⁻¹((n − s)/n)``,                Baruch et al. 2019, Sec. 3; ByzFL
              ``s = ⌊n/2 + 1⌋ − f`` (unless ``z`` is given)       ``ALittleIsEnough``
ipm           ``−ε μ`` (ε = ``epsilon``, default 0.1)             Xie et al. 2020; ByzFL ``FallOfEmpires``
                                                                  with τ = 1 + ε
label_flip    its honest delta on labels ``y → C − 1 − y``        Tolpegin et al. 2020 (data poisoning)
============  ==================================================  ==============================================

``sign_flip``, ``alie`` and ``ipm`` are omniscient: they use the honest clients' deltas of the round.
All Byzantine clients of a round send the same vector for these three (as in ByzFL); ``gaussian``
draws an independent vector for each.

References:
    Allen-Zhu, Ebrahimian, Li, Alistarh. Byzantine-resilient non-convex stochastic gradient descent.
    ICLR 2021.
    Baruch, Baruch, Goldberg. A little is enough: circumventing defenses for distributed learning.
    NeurIPS 2019.
    Bhagoji, Chakraborty, Mittal, Calo. Analyzing federated learning through an adversarial lens.
    ICML 2019 (boosting by 1/α_m, the number of agents, 10 in their experiments).
    Blanchard, El Mhamdi, Guerraoui, Stainer. Machine learning with adversaries: Byzantine tolerant
    gradient descent. NeurIPS 2017 (Gaussian Byzantine vectors of standard deviation 200).
    Xie, Koyejo, Gupta. Fall of empires: breaking Byzantine-tolerant SGD by inner product
    manipulation. UAI 2020 (ε = 0.1 defeats median and Krum).
    Tolpegin, Truex, Gursoy, Liu. Data poisoning attacks against federated learning systems.
    ESORICS 2020.
    ByzFL (EPFL), byzfl/attacks/attacks.py.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import Tensor

from lightning_fedmeta.client.sampling import generator_for

__all__ = [
    "ATTACKS",
    "ByzantineSpec",
    "parse_byzantine",
    "choose_byzantine_clients",
    "attack_rows",
    "alie_z",
    "flip_labels",
]

ATTACKS: tuple[str, ...] = ("sign_flip", "scaled", "gaussian", "alie", "ipm", "label_flip")

#: the keys each attack accepts besides ``fraction`` and ``attack``
_ATTACK_KEYS: dict[str, tuple[str, ...]] = {
    "sign_flip": (),
    "scaled": ("scale",),
    "gaussian": ("std",),
    "alie": ("z",),
    "ipm": ("epsilon",),
    "label_flip": (),
}


@dataclass(frozen=True)
class ByzantineSpec:
    """The simulated Byzantine clients of a run.

    Attributes:
        fraction: the fraction of the training clients that are Byzantine (the same clients for the
            whole run), in (0, 0.5).
        attack: one of :data:`ATTACKS`.
        scale: ``scaled``: the factor applied to the client's honest delta (10: Bhagoji et al. 2019
            boost by the number of agents, 10 in their experiments).
        std: ``gaussian``: the standard deviation of the noise sent (200: Blanchard et al. 2017, Sec. 5).
        z: ``alie``: the number of standard deviations added to the honest mean; ``None``: Baruch et al.
            2019's ``z_max`` from the round's n and f (:func:`alie_z`).
        epsilon: ``ipm``: the upload is ``−ε μ`` (Xie et al. 2020; 0.1 is their setting against median
            and Krum).
    """

    fraction: float
    attack: str
    scale: float = 10.0
    std: float = 200.0
    z: float | None = None
    epsilon: float = 0.1

    @property
    def poisons_model(self) -> bool:
        """Whether the attack replaces the upload (every attack but ``label_flip``, which poisons data)."""
        return self.attack != "label_flip"


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def parse_byzantine(spec: Mapping[str, Any] | ByzantineSpec | None,
                    option: str = "model.byzantine") -> ByzantineSpec | None:
    """The :class:`ByzantineSpec` a user wrote (``None``: no Byzantine client).

    ``spec`` is a mapping with ``fraction`` and ``attack`` and the attack's own parameter (``scale``
    for ``scaled``, ``std`` for ``gaussian``, ``z`` for ``alie``, ``epsilon`` for ``ipm``). A missing
    or unknown key, a key of another attack, a wrong type or an out-of-range value is a ``ValueError``
    naming ``option.key``.
    """
    if spec is None:
        return None
    if isinstance(spec, ByzantineSpec):
        defaults = {k.name: k.default for k in fields(ByzantineSpec) if k.name not in ("fraction", "attack")}
        given = {"fraction": spec.fraction, "attack": spec.attack}
        given.update({k: getattr(spec, k) for k, v in defaults.items() if getattr(spec, k) != v})
        return parse_byzantine(given, option)
    if not isinstance(spec, Mapping):
        raise ValueError(f"{option} must be a mapping with 'fraction' and 'attack' (or null), "
                         f"got {type(spec).__name__} {spec!r}")
    for key in ("fraction", "attack"):
        if key not in spec:
            raise ValueError(f"{option}.{key} is required (e.g. {{fraction: 0.2, attack: sign_flip}})")
    attack = spec["attack"]
    if not isinstance(attack, str) or attack not in ATTACKS:
        raise ValueError(f"{option}.attack: unknown attack {attack!r}; choose one of {', '.join(ATTACKS)}")
    allowed = ("fraction", "attack", *_ATTACK_KEYS[attack])
    known = {k.name for k in fields(ByzantineSpec)}
    values: dict[str, Any] = {"attack": attack}
    for key, value in spec.items():
        where = f"{option}.{key}"
        if not isinstance(key, str) or key not in known:
            raise ValueError(f"{where}: unknown key; the {attack} attack accepts {', '.join(allowed)}")
        if key not in allowed:
            raise ValueError(f"{where} does not apply to the {attack} attack; it accepts {', '.join(allowed)}")
        if key == "attack":
            continue
        if key == "fraction":
            if not _is_number(value) or not 0.0 < float(value) < 0.5:
                raise ValueError(f"{where} must be a number in (0, 0.5), got {value!r}")
        elif key == "z":
            if value is not None and (not _is_number(value) or not math.isfinite(float(value))):
                raise ValueError(f"{where} must be a finite number (or null: Baruch et al.'s z_max), got {value!r}")
        elif key in ("std", "epsilon"):
            if not _is_number(value) or not math.isfinite(float(value)) or float(value) <= 0:
                raise ValueError(f"{where} must be a finite number > 0, got {value!r}")
        elif key == "scale":
            if not _is_number(value) or not math.isfinite(float(value)):
                raise ValueError(f"{where} must be a finite number, got {value!r}")
        values[key] = None if value is None else float(value)
    return ByzantineSpec(**values)


def choose_byzantine_clients(seed: int, eligible: Tensor, fraction: float) -> Tensor:
    """The Byzantine clients: ``round(fraction · len(eligible))`` of ``eligible`` (halves round up; at least
    1), drawn uniformly without replacement from ``generator_for(seed, "byzantine")``, sorted. A pure
    function of ``(seed, eligible, fraction)``, so every rank and a resumed run agree.

    Raises ``ValueError`` if it would leave no honest client.
    """
    k = int(eligible.numel())
    count = max(1, int(math.floor(fraction * k + 0.5)))
    if count >= k:
        raise ValueError(
            f"model.byzantine.fraction={fraction} makes {count} of the {k} training clients Byzantine: "
            f"no honest client is left"
        )
    perm = torch.randperm(k, generator=generator_for(seed, "byzantine"))
    return eligible.reshape(-1)[perm[:count].to(eligible.device)].sort().values


def alie_z(n: int, f: int) -> float:
    """Baruch et al. 2019 (Sec. 3, Algorithm 3): ``z_max = Φ⁻¹((n − s)/n)`` with ``s = ⌊n/2 + 1⌋ − f`` the
    number of honest clients the attackers need on their side. With ``s < 1`` (attackers already hold a
    majority) ``s = 1`` is used, so z stays finite. E.g. n = 10: f = 1 → 0, f = 2 → 0.253, f = 3 → 0.524."""
    s = max(math.floor(n / 2 + 1) - f, 1)
    return float(torch.special.ndtri(torch.tensor((n - s) / n, dtype=torch.float64)))


def attack_rows(spec: ByzantineSpec, rows: Tensor, byzantine: Tensor, generator: torch.Generator) -> Tensor:
    """``rows`` (the round's honest deltas ``[n, d]``) with the Byzantine rows (``byzantine``, bool ``[n]``)
    replaced by the attack's upload (see the module docstring); honest rows are returned bit-identical.

    Random draws (``gaussian``) come only from ``generator`` (a CPU generator; the draw is moved to
    ``rows.device``), in row order. ``label_flip`` returns ``rows`` unchanged: its poisoning happened
    in training (:func:`flip_labels`). If no row is Byzantine ``rows`` is returned as is. If no row is
    honest, the omniscient attacks (``sign_flip``, ``alie``, ``ipm``) use the statistics of all rows
    (the Byzantine clients' own honest deltas) instead.
    """
    mask = byzantine.to(device=rows.device, dtype=torch.bool).reshape(-1)
    if mask.shape[0] != rows.shape[0]:
        raise ValueError(f"attack_rows: byzantine has {mask.shape[0]} entries for {rows.shape[0]} rows")
    num_byz = int(mask.sum())
    if num_byz == 0 or not spec.poisons_model:
        return rows
    n = rows.shape[0]
    honest = rows[~mask] if num_byz < n else rows
    work = torch.float32 if rows.dtype in (torch.float16, torch.bfloat16) else rows.dtype
    if spec.attack == "scaled":
        sent = rows[mask] * spec.scale
    elif spec.attack == "gaussian":
        noise = torch.randn(num_byz, rows.shape[1], generator=generator, dtype=work)
        sent = (noise.to(rows.device) * spec.std).to(rows.dtype)
    else:
        h = honest.to(work)
        mu = h.mean(dim=0)
        if spec.attack == "sign_flip":
            vector = -mu
        elif spec.attack == "ipm":
            vector = -spec.epsilon * mu
        elif spec.attack == "alie":
            z = alie_z(n, num_byz) if spec.z is None else spec.z
            sigma = h.std(dim=0, correction=1) if h.shape[0] > 1 else torch.zeros_like(mu)
            vector = mu + z * sigma
        else:  # pragma: no cover - parse_byzantine admits only ATTACKS
            raise ValueError(f"attack_rows: unknown attack {spec.attack!r}")
        sent = vector.to(rows.dtype).expand(num_byz, -1)
    out = rows.clone()
    out[mask] = sent
    return out


def flip_labels(y: Tensor, num_classes: int) -> Tensor:
    """Label flipping (Tolpegin et al. 2020, the all-classes variant): ``y → num_classes − 1 − y``."""
    return (num_classes - 1) - y
