"""Does a personal adapter beat the global one? Per-client perplexity without downloaded weights (issue 40).

    python -m benchmarks.lora_accuracy           # pretrain (cached), tune on validation, 3 seeds: lora_accuracy.md
    python -m benchmarks.lora_accuracy --quick   # smoke run: short pretraining, 3 rounds, 1 seed, no tuning

**Base model, pretrained here.** A byte-level GPT-style :class:`~lightning_fedmeta.models.TinyTransformer`
(vocabulary 256, d = 128, 4 heads, 4 layers, 64 positions; 0.87 M parameters) is pretrained by this script on the
Python documentation shipped with every Python installation (``pydoc_data.topics``: the language reference's 79
topics, 465 kB of English), AdamW (lr 3·10⁻³, batch 32 windows of 64 bytes), ``--pretrain-steps`` steps, seed 0,
and cached (``--cache``). No weights are downloaded.

**Clients: authors and styles.** Each client is one licence text shipped by Debian's ``base-files`` package in
``/usr/share/common-licenses`` (Apache-2.0, Artistic, BSD, CC0-1.0, GFDL-1.3, GPL-2, GPL-3, LGPL-2.1, MPL-2.0: nine
authors' legal styles, 1.5 kB to 35 kB, so the clients are very unequal), read through the library's text format
(one JSON-lines file per client, :mod:`lightning_fedmeta.data`); none of it is in the pretraining text. Each
client's text (one document, a newline after it: the byte vocabulary of the pretrained base has no special id) is
cut into windows of 64 bytes (a target at every position); 15 % of each client's windows are its
test set, 15 % of the rest its validation set (both seeded by the data seed 0, fixed across seeds).

**Rules compared at equal work.** Rank-8 adapters (``α = 16``) on every attention and MLP projection, base frozen;
every rule trains ``--rounds`` rounds of ``--per-round`` of the 9 clients (partial participation), τ = 5 local SGD
steps of batch 8, server step 1:

* ``fedavg``: the global adapter (FedIT: FedAvg over the adapters), scored as is on every client;
* ``fedsa_lora``: FedSA-LoRA, ``A`` shared, ``B`` personal; client i is scored with ``(A, B_i)``
  (``FederatedModule.personalize(i)``);
* and the frozen base without adapters, for reference.

The local learning rate of each rule is chosen on the validation windows (``--lrs``, seed 0, final-round mean
validation perplexity), never on the test windows; the chosen rate then runs ``--seeds``. Reported: each client's
test perplexity (``exp`` of its mean cross-entropy per byte) at the final round, mean ± standard deviation over the
seeds, and how many clients' personalised perplexity is below the global adapter's in every seed.

Records (one per rule, rate and seed) are appended to ``benchmarks/results/lora_accuracy.jsonl`` as each run
finishes; a re-run skips those there. The report is ``lora_accuracy.md`` with ``lora_accuracy.png``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.harness import REPO, append_record, git_commit, limit_threads, mean_std, records_by_key, utc_now

__all__ = ["LICENSES", "pretrain", "client_windows", "run_rule", "main"]

RESULTS = REPO / "benchmarks" / "results"
LICENSE_DIR = Path("/usr/share/common-licenses")
LICENSES = ("Apache-2.0", "Artistic", "BSD", "CC0-1.0", "GFDL-1.3", "GPL-2", "GPL-3", "LGPL-2.1", "MPL-2.0")
MODEL = {"vocab_size": 256, "d_model": 128, "nhead": 4, "num_layers": 4, "max_len": 64}
SEQ = 64
TARGETS = ["qkv", "proj", "mlp.0", "mlp.2"]
RULES = ("fedavg", "fedsa_lora", "fedavg_ft")
PERSONAL = ("fedsa_lora", "fedavg_ft")
LABELS = {"fedavg": "global adapter (fedavg)", "fedsa_lora": "personal B (fedsa_lora)",
          "fedavg_ft": "global adapter fine-tuned per client (fedavg + FT)"}
#: FedAvg + FT: local SGD steps from the global adapter on the client's own training windows before it is scored
FINETUNE_STEPS = 20


def pretraining_text() -> bytes:
    """The pretraining corpus: Python's own documentation topics (``pydoc_data.topics``), in sorted topic order."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics)).encode("utf-8")


def pretrain(steps: int, cache: Path, threads: int | None) -> Path:
    """The pretrained base's ``state_dict`` file (trained here once, then read from ``cache``)."""
    import torch
    import torch.nn.functional as F

    from lightning_fedmeta.models import TinyTransformer

    text = pretraining_text()
    key = hashlib.sha256(json.dumps([MODEL, steps, hashlib.sha256(text).hexdigest()]).encode()).hexdigest()[:16]
    path = cache / f"base_{key}.pt"
    if path.exists():
        return path
    limit_threads(threads)
    torch.manual_seed(0)
    model = TinyTransformer(**MODEL)
    data = torch.tensor(list(text), dtype=torch.long)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=steps, pct_start=0.05)
    g = torch.Generator().manual_seed(0)
    for step in range(steps):
        starts = torch.randint(0, data.numel() - SEQ - 1, (32,), generator=g)
        w = torch.stack([data[s:s + SEQ + 1] for s in starts.tolist()])
        loss = F.cross_entropy(model(w[:, :-1]).flatten(0, 1), w[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        if step % max(1, steps // 10) == 0 or step == steps - 1:
            print(f"[pretrain] step {step + 1}/{steps}: loss {loss.item():.3f} (ppl {math.exp(loss.item()):.2f})",
                  flush=True)
    cache.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save(model.state_dict(), tmp)
    tmp.replace(path)  # a crash never leaves a half-written base
    return path


def client_windows(folder: Path) -> Any:
    """The licences as the library's federated text data: one JSONL file per client, byte tokens, 64-byte
    windows, split into train / validation / test windows (module docstring): ``(fit_data, val_data)`` where
    ``fit_data``'s test windows are the test set and ``val_data`` holds the same training windows with the
    validation windows as its test set."""
    from lightning_fedmeta.data.text_clients import TextClients
    from lightning_fedmeta.data.tokenizers import ByteTokenizer
    from lightning_fedmeta.data.validation_split import validation_split

    for name in LICENSES:
        text = (LICENSE_DIR / name).read_text(encoding="utf-8")
        (folder / f"{name}.jsonl").write_text(json.dumps({"text": text}) + "\n", encoding="utf-8")
    data = TextClients(root=str(folder), seq_len=SEQ, tokenizer=ByteTokenizer(eos=False), eos_id=ord("\n"),
                       test_fraction=0.15, seed=0).federated_data()
    if data.client_names != list(LICENSES):
        raise RuntimeError(f"expected the clients {LICENSES}, got {data.client_names}")
    return data, validation_split(data, 0.15, seed=0)


def run_rule(rule: str, lr: str, seed: int, base: Path, data: Any, rounds: int, per_round: int) -> list[float]:
    """Train ``rule`` and return each client's final-round perplexity on ``data``'s test windows. ``lr`` is the
    local learning rate (``"1.0"``), for ``fedavg_ft`` the local and the fine-tuning rate (``"1.0:0.3"``)."""
    import torch
    import torch.nn.functional as F

    from lightning_fedmeta import FederatedModule
    from lightning_fedmeta.models import LoRAModel, TinyTransformer

    torch.manual_seed(seed)
    model = LoRAModel(TinyTransformer(**MODEL), targets=TARGETS, rank=8, alpha=16.0, base_weights=str(base))
    local, _, tune = lr.partition(":")
    algorithm = {"name": "fedavg" if rule == "fedavg_ft" else rule, "local_steps": 5, "local_lr": float(local),
                 "batch_size": 8}
    if rule == "fedavg_ft":
        algorithm.update(finetune_steps=FINETUNE_STEPS, finetune_lr=float(tune), finetune_batch_size=8)
    m = FederatedModule(model=model, algorithm=algorithm,
                        loss="cross_entropy", clients_per_round=per_round, seed=seed, compile_clients=False)
    m.attach_data(data)
    optimizer = torch.optim.SGD([p for p in m.model.parameters() if p.requires_grad], lr=1.0)
    for r in range(rounds):
        m.engine.run_round(r, optimizer)
    out = []
    offsets = data.test_offsets.tolist()
    for i in range(len(offsets) - 1):
        personal = m.personalize(i, round_idx=rounds)
        x, y = data.test_x[offsets[i]:offsets[i + 1]], data.test_y[offsets[i]:offsets[i + 1]]
        with torch.no_grad():
            out.append(math.exp(F.cross_entropy(personal(x).flatten(0, 1), y.flatten()).item()))
    return out


def base_perplexity(base: Path, data: Any) -> list[float]:
    """Each client's test perplexity under the pretrained base alone."""
    import torch
    import torch.nn.functional as F

    from lightning_fedmeta.models import TinyTransformer

    model = TinyTransformer(**MODEL)
    model.load_state_dict(torch.load(base, weights_only=True))
    offsets = data.test_offsets.tolist()
    with torch.no_grad():
        return [math.exp(F.cross_entropy(model(data.test_x[a:b]).flatten(0, 1), data.test_y[a:b].flatten()).item())
                for a, b in zip(offsets[:-1], offsets[1:], strict=True)]


def _mean_pm(mean: float | None, std: float | None) -> str:
    """``mean ± std`` (``mean`` alone for one seed, empty for none)."""
    if mean is None:
        return ""
    return f"{mean:.3f}" if std is None else f"{mean:.3f} ± {std:.3f}"


def report(records: dict[str, dict[str, Any]], chosen: dict[str, float], base: list[float], command: str,
           seeds: list[int], png: Path | None) -> str:
    finals = {rule: [records[f"test/{rule}/{chosen[rule]}/{s}"]["perplexity"] for s in seeds
                     if f"test/{rule}/{chosen[rule]}/{s}" in records] for rule in RULES}
    lines = ["# Personal against global LoRA adapters: per-client test perplexity", "",
             f"Command: `{command}` (benchmarks/lora_accuracy.py; records `lora_accuracy.jsonl`). Byte-level "
             "GPT-style model pretrained here on Python's documentation topics; clients are nine licence texts "
             "(`/usr/share/common-licenses`); rank-8 adapters, base frozen; final round; learning rates chosen on "
             "validation windows (seed 0): " + ", ".join(f"{r} {chosen[r]}" for r in RULES) +
             f" (fedavg + FT: local:fine-tuning rate, {FINETUNE_STEPS} fine-tuning steps of batch 8 before scoring, "
             f"so it does more work at evaluation); seeds {seeds}. Lower is better.", ""]
    if png is not None:
        lines += [f"![per-client perplexity]({png.name})", ""]
    lines += ["| client | test windows | base | " + " | ".join(LABELS[r] for r in RULES) + " | " +
              " | ".join(f"{r} < fedavg in every seed" for r in PERSONAL) + " |",
              "|---|---|---|" + "---|" * (len(RULES) + len(PERSONAL))]
    n = len(LICENSES)
    wins = dict.fromkeys(PERSONAL, 0)
    for i, name in enumerate(LICENSES):
        cells = [_mean_pm(*mean_std(run[i] for run in finals[rule])) for rule in RULES]
        marks = []
        for rule in PERSONAL:
            pairs = list(zip(finals["fedavg"], finals[rule], strict=False))
            win = bool(pairs) and all(p[i] < g[i] for g, p in pairs)
            wins[rule] += win
            marks.append("yes" if win else "no")
        count = records.get("meta", {}).get("test_windows", [""] * n)[i]
        lines.append(f"| {name} | {count} | {base[i]:.3f} | " + " | ".join(cells) + " | " + " | ".join(marks) + " |")
    means = {rule: mean_std(sum(run) / n for run in finals[rule]) for rule in RULES}
    lines += ["", "Below the global adapter on every client in every seed: " +
              "; ".join(f"{r} on {wins[r]} of {n} clients" for r in PERSONAL) + ". Mean over clients: base "
              f"{sum(base) / n:.3f}; " + "; ".join(f"{r} {_mean_pm(m, s)}" for r, (m, s) in means.items()) + ".", ""]
    return "\n".join(lines)


def plot(records: dict[str, dict[str, Any]], chosen: dict[str, float], base: list[float], seeds: list[int],
         out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4))
    x = list(range(len(LICENSES)))
    width = 0.8 / (len(RULES) + 1)
    ax.bar([i - 0.4 + width / 2 for i in x], base, width=width, label="base", color="0.7")
    for k, rule in enumerate(RULES):
        runs = [records[f"test/{rule}/{chosen[rule]}/{s}"]["perplexity"] for s in seeds]
        mean = [sum(r[i] for r in runs) / len(runs) for i in x]
        lo = [mean[i] - min(r[i] for r in runs) for i in x]
        hi = [max(r[i] for r in runs) - mean[i] for i in x]
        ax.bar([i - 0.4 + width * (k + 1.5) for i in x], mean, width=width, yerr=[lo, hi], label=LABELS[rule],
               capsize=2)
    ax.set_xticks(x, LICENSES, rotation=30, ha="right")
    ax.set_ylabel("test perplexity per byte (final round)")
    ax.set_title("Per-client perplexity: pretrained base, global adapter, personal adapters (min-max over seeds)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pretrain-steps", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--per-round", type=int, default=5, help="clients per round (of 9)")
    parser.add_argument("--lrs", type=float, nargs="+", default=[0.1, 0.3, 1.0, 3.0])
    parser.add_argument("--finetune-lrs", type=float, nargs="+", default=[0.1, 0.3])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "lightning_fedmeta" / "lora_accuracy")
    parser.add_argument("--quick", action="store_true", help="smoke run: 50 pretraining steps, 3 rounds, 1 seed")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.quick:
        args.pretrain_steps, args.rounds, args.seeds, args.lrs = 50, 3, [0], args.lrs[:1]
        args.finetune_lrs = args.finetune_lrs[:1]
    limit_threads(args.threads)
    stem = "lora_accuracy_quick" if args.quick else "lora_accuracy"
    path = args.out / f"{stem}.jsonl"
    records = records_by_key(path)
    base = pretrain(args.pretrain_steps, args.cache, args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        test_data, val_data = client_windows(Path(tmp))

    def run(kind: str, rule: str, lr: str, seed: int, data: Any) -> dict[str, Any]:
        key = f"{kind}/{rule}/{lr}/{seed}"
        if key not in records:
            print(f"[lora_accuracy] {key} ...", flush=True)
            ppl = run_rule(rule, lr, seed, base, data, args.rounds, args.per_round)
            records[key] = {"key": key, "kind": kind, "rule": rule, "lr": lr, "seed": seed, "perplexity": ppl,
                            "rounds": args.rounds, "per_round": args.per_round,
                            "pretrain_steps": args.pretrain_steps, "commit": git_commit(), "finished": utc_now()}
            append_record(path, records[key])
        return records[key]

    def best(rule: str, grid: list[str]) -> str:
        scores = {lr: sum(run("val", rule, lr, 0, val_data)["perplexity"]) for lr in grid}
        return min(scores, key=lambda lr: scores[lr] if math.isfinite(scores[lr]) else math.inf)

    chosen = {rule: best(rule, [str(lr) for lr in args.lrs]) for rule in ("fedavg", "fedsa_lora")}
    # FedAvg + FT trains as the chosen FedAvg and tunes its fine-tuning rate on the validation windows
    chosen["fedavg_ft"] = best("fedavg_ft", [f"{chosen['fedavg']}:{lr}" for lr in args.finetune_lrs])
    for seed in args.seeds:
        for rule in RULES:
            run("test", rule, chosen[rule], seed, test_data)
    records["meta"] = {"test_windows": (test_data.test_offsets[1:] - test_data.test_offsets[:-1]).tolist()}
    base_ppl = base_perplexity(base, test_data)
    png = args.out / f"{stem}.png"
    plot(records, chosen, base_ppl, args.seeds, png)
    command = "python -m benchmarks.lora_accuracy " + " ".join(argv if argv is not None else sys.argv[1:])
    (args.out / f"{stem}.md").write_text(report(records, chosen, base_ppl, command.strip(), args.seeds, png),
                                         encoding="utf-8")
    print(f"[lora_accuracy] report: {args.out / f'{stem}.md'}")


if __name__ == "__main__":
    main()
