"""Personalised evaluation: every client's own model scored on its own test set (docs/design.md, contract 6).

For client ``i`` at round ``r``:  ``w_i = algorithm.personalize(w, adapt batches_i, state_i, σ, record_i)`` and
its test samples give masked sums of the loss and of each built-in metric. The clients run in chunks of
``client_chunk_size`` (streamed into :class:`~lightning_fedmeta.evaluation.metrics.ClientMetrics`: bounded memory for
any
``K``), looped or ``vmap``-ed like training. Summaries per group (training clients, held-out clients, honest
clients under ``model.byzantine``): the sample-weighted mean, the unweighted mean and the worst decile.
"""

from __future__ import annotations

import csv
import math
import os
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor

from lightning_fedmeta.algorithms.base import ClientRecord
from lightning_fedmeta.client.execution import AUTO_CHUNK, run_clients, training_chunk_size
from lightning_fedmeta.client.functional import Batch, Params
from lightning_fedmeta.client.sampling import generator_for
from lightning_fedmeta.evaluation.fairness import summaries_with_spread
from lightning_fedmeta.evaluation.metrics import ClientMetrics, MetricSpec
from lightning_fedmeta.evaluation.report import format_summary
from lightning_fedmeta.evaluation.scoring import score_client
from lightning_fedmeta.loop.engine import RoundEngine
from lightning_fedmeta.loop.ranks import RankSplit

__all__ = ["Evaluator", "Summary"]

Summary = dict[str, dict[str, Tensor]]


#: test rows predicted at once per client on the CPU (:func:`~lightning_fedmeta.evaluation.scoring.score_client`): a
#: Dir(0.1) client's padded test set of ~1,300 images under ``vmap`` ran at 0.65 ms an image against PFLlib's 0.25
CPU_EVAL_ROWS = 128

class Evaluator:
    """Scores the engine's clients with their personalised models and keeps the last evaluation."""

    def __init__(self, engine: RoundEngine) -> None:
        self.engine = engine
        self.metric_directions: dict[str, bool] = {}
        self.primary_metric = "loss"
        self.last_summary: Summary = {}
        self.last_summary_round = -1  # the round last_summary was measured after
        self.last_per_client: dict[str, Tensor] = {}
        self.last_evaluated: Tensor | None = None  # the clients the last evaluation scored (data.eval_clients)
        self._pending_state: dict[str, Tensor] | None = None
        self._sample_logged = False

    def bind(self, specs: dict[str, MetricSpec], num_clients: int) -> None:
        self.metric = ClientMetrics(specs, num_clients)
        self.metric_directions = dict(self.metric.directions)
        self.primary_metric = next(iter(self.metric_directions))
        if self._pending_state is not None:  # a checkpoint loaded before the data was attached
            self.restore(self._pending_state)
            self._pending_state = None

    # ------------------------------------------------------------------------------------------
    # scoring
    # ------------------------------------------------------------------------------------------
    def accuracy_of(self, scores: dict[str, Tensor], key: str = "acc") -> Tensor:
        """Per-client values of built-in metric ``key`` from :meth:`evaluate_clients`' sums."""
        col = list(self.metric.builtin).index(key)
        return scores["builtin"][:, col] / scores["total"].clamp_min(1)

    @property
    def last_per_client_accuracy(self) -> Tensor | None:
        """Deprecated alias: ``last_per_client[primary_metric]``."""
        return self.last_per_client.get(self.primary_metric) if self.last_per_client else None

    def report_test(self, directory: str, round_idx: int) -> None:
        """After a test: the summary table (of round ``round_idx``) to the log and the per-client values to a CSV
        in ``directory`` (nothing when no test ran)."""
        if not self.last_summary:
            return
        rank_zero_info(format_summary(self.last_summary, round_idx))
        path = self.write_per_client_csv(directory)
        rank_zero_info(f"per-client test accuracy written to {path}")

    def place(self, device: torch.device) -> None:
        """Move the per-client metric states to ``device`` (the module's, once per device)."""
        self.metric = self.metric.to(device)

    def _eval_fn(self, params: Params, server_state: dict[str, Tensor], adapt: Batch, test: Batch,
                 state: dict[str, Tensor], record: ClientRecord, buffers: dict[str, Tensor]) -> dict[str, Tensor]:
        """One client's personalised model scored on its padded test set (:func:`score_client`), with its
        BatchNorm statistics."""
        engine = self.engine
        ctx = engine.ctx.for_client(buffers) if buffers else engine.ctx
        return score_client(ctx, engine.algorithm, params, server_state, adapt, test, state, record,
                            self.metric.builtin_functions(), self.metric.needs_outputs,
                            rows=CPU_EVAL_ROWS if engine.device.type == "cpu" else None)

    def chunk_size(self) -> int:
        """``client_chunk_size``: as in training when ``"auto"``, ``max(clients per round, 100)`` when ``None``."""
        size = self.engine.client_chunk_size
        if size == "auto":  # the training rounds' rule: 10 clients per call for convolutions on the CPU, else 100
            assert self.engine.model is not None
            return training_chunk_size(self.engine.model, self.engine.device, "auto") or AUTO_CHUNK
        return int(size) if size is not None else max(self.engine.federation.num_sampled, AUTO_CHUNK)

    def chunks(self, clients: Tensor) -> list[Tensor]:
        """``clients`` cut into the chunks an evaluation runs (the same for the streamed and the stacked one, so
        they are bit-identical). One chunk when they fit in one; else ordered by test-set size, largest first
        (ties by index), so each chunk pads its test sets to its own widest client (:meth:`test_width`) rather
        than the federation's: on a Dirichlet(0.1) split of 20 clients in chunks of 10 that halves the padded
        rows the evaluation computes."""
        size = self.chunk_size()
        if clients.numel() > size:
            counts = self.engine.data.test_counts.cpu()[clients.cpu()] if self.engine.data is not None else None
            if counts is not None:
                clients = clients[torch.argsort(-counts, stable=True)]
        return [clients[start:start + size] for start in range(0, clients.numel(), size)]

    def test_width(self, clients: Tensor) -> int | None:
        """The padded width of a chunk's test sets: its widest client's (``None``, the federation's widest, when
        the metrics keep every output: their chunks are concatenated)."""
        if self.metric.needs_outputs or self.engine.data is None or not clients.numel():
            return None
        return max(1, int(self.engine.data.test_counts.cpu()[clients.cpu()].max()))

    def evaluate_chunk(self, clients: Tensor, round_idx: int) -> dict[str, Tensor]:
        """One chunk's scores: ``total``, ``loss_sum``, ``builtin`` ``[C, B]`` and, with torchmetrics metrics,
        ``outputs``, ``targets``, ``mask``; only this chunk's batches, states and statistics are gathered."""
        engine = self.engine
        adapt = engine.gatherer.batches("adapt", round_idx, clients, engine.algorithm.eval_plan())
        test = engine.gatherer.test_batches(clients, self.test_width(clients))
        states = engine.client_states.gather(clients)
        seeds = engine.loop_seeds("eval-dropout", round_idx, clients)
        engine.compile.for_evaluation()
        with torch.inference_mode(False), torch.enable_grad():
            out = run_clients(
                self._eval_fn, (engine.global_params(), engine.server_state),
                (adapt, test, states, engine.records(clients), engine.starting_buffers(clients)),
                clients.numel(), engine.batching, self.chunk_size(), seeds,
                label=f"{type(engine.algorithm).__name__}.personalize",
            )
        if "outputs" in out:
            out = {**out, "targets": test.y, "mask": test.mask}
        return out

    def evaluate_clients(self, clients: Tensor, round_idx: int) -> dict[str, Tensor]:
        """Every listed client's scores, stacked (the chunks of :meth:`chunks` concatenated)."""
        chunks = self.chunks(clients)
        parts = [self.evaluate_chunk(part, round_idx) for part in chunks]
        if len(parts) == 1:
            return parts[0]
        order = torch.cat(chunks)
        back = torch.searchsorted(order.sort().values, clients.cpu())  # listed order from the chunks' order
        rows = order.sort().indices[back]
        return {key: torch.cat([p[key] for p in parts])[rows.to(parts[0][key].device)] for key in parts[0]}

    # ------------------------------------------------------------------------------------------
    # which clients, and the evaluation itself
    # ------------------------------------------------------------------------------------------
    def evaluation_clients(self, stage: str, sample_size: int | None = None) -> Tensor:
        """The clients an evaluation scores, sorted: every client at ``test`` or without ``sample_size``; at
        ``val`` with ``N = sample_size < K`` a fixed stratified sample: ``N_new = round(N·|H|/K)`` held-out
        clients (at least 1 when ``H`` is not empty and ``N >= 2``, leaving at least one training client) and
        ``N − N_new`` training clients, each the first of a permutation drawn by
        ``generator_for(seed, "eval-clients", "train" | "new")``: the same clients at every validation, every rank."""
        federation = self.engine.federation
        k = federation.num_clients
        if stage == "test" or sample_size is None or sample_size >= k:
            return torch.arange(k)
        eligible, holdout = federation.eligible.cpu(), federation.holdout.cpu()
        n = int(sample_size)
        n_new = math.floor(n * holdout.numel() / k + 0.5)
        if holdout.numel() and n >= 2:
            n_new = max(1, n_new)
        if eligible.numel() and n >= 2:
            n_new = min(n_new, n - 1)
        n_new = min(n_new, holdout.numel())
        n_train = min(n - n_new, eligible.numel())
        n_new = n - n_train
        picks = [
            group[torch.randperm(group.numel(), generator=generator_for(federation.seed, "eval-clients", tag))[:m]]
            for group, tag, m in ((eligible, "train", n_train), (holdout, "new", n_new))
        ]
        return torch.cat(picks).sort().values

    def _log_sample(self, evaluated: Tensor) -> None:
        """Say once which clients the validations score (``data.eval_clients``)."""
        if self._sample_logged:
            return
        self._sample_logged = True
        is_holdout = self.engine.federation.is_holdout
        n_new = int(is_holdout[evaluated].sum())
        rank_zero_info(
            f"[lightning_fedmeta] data.eval_clients={evaluated.numel()}: every validation scores the same "
            f"{evaluated.numel()} of {is_holdout.numel()} clients ({evaluated.numel() - n_new} training, "
            f"{n_new} held out; drawn once per group in proportion to its size from model.seed="
            f"{self.engine.seed}, tag 'eval-clients'); test scores every client"
        )

    def run(self, stage: str, round_idx: int, sample_size: int | None, ranks: RankSplit) -> tuple[Summary, Tensor,
                                                                                                    bool]:
        """Score the stage's clients (this rank's share, streamed chunk by chunk), synchronise the per-client
        metric states over the ranks and summarise. Returns ``(summary, evaluated clients, sampled)``."""
        engine = self.engine
        assert engine.model is not None
        was_training = engine.model.training
        engine.model.eval()
        evaluated = self.evaluation_clients(stage, sample_size)
        sampled = evaluated.numel() < engine.federation.num_clients
        if sampled:
            self._log_sample(evaluated)
        clients = evaluated[ranks.share(evaluated.numel())]
        self.metric = self.metric.to(engine.device)
        self.metric.reset()
        for part in self.chunks(clients):  # streamed: one chunk's batches, states and outputs at a time
            scores = self.evaluate_chunk(part, round_idx)
            self.metric.update(part, scores)
            if "outputs" in scores:
                self.metric.update_outputs(part, scores["outputs"], scores["targets"], scores["mask"])
            del scores
        engine.model.train(was_training)
        self.metric.sync(clients, ranks.reduce if ranks.world > 1 else None)
        summary = self._summaries(evaluated if sampled else None)
        self._keep(summary, round_idx, evaluated, evaluated if sampled else None)
        return summary, evaluated, sampled

    def _summaries(self, evaluated: Tensor | None) -> Summary:
        """The metric states' summaries per client group (``evaluated``: the clients of a sampled evaluation), with
        the per-client spread of every metric under ``summary["_spread"]`` (kept out of the logged summaries)."""
        return summaries_with_spread(self.metric, self.engine.federation.summary_groups(evaluated))

    def _keep(self, summary: Summary, round_idx: int, scored: Tensor, evaluated: Tensor | None) -> None:
        self.last_summary = summary
        self.last_summary_round = round_idx
        self.last_evaluated = scored
        self.last_per_client = blank_unevaluated(summary["_per_client"], evaluated)

    # ------------------------------------------------------------------------------------------
    # state and output
    # ------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The last evaluation's per-client metric states (a resumed run reports the same per-client values) and the
        round it was measured after (``-1``: none yet)."""
        return {"metric_state": self.metric.state_dict() if hasattr(self, "metric") else None,
                "metric_round": self.last_summary_round}

    def load_state_dict(self, state: dict[str, Tensor] | None, attached: bool) -> None:
        if state is None:
            return
        if attached and hasattr(self, "metric"):
            self.restore(state)
        else:
            self._pending_state = state

    def restore(self, state: dict[str, Tensor]) -> None:
        """Load saved per-client metric states and the summaries they give (as after that evaluation), with the
        same groups an evaluation reports."""
        self.metric.load_state_dict(state)
        if float(self.metric.total.sum()) > 0:
            scored = (self.metric.total.cpu() > 0).nonzero().flatten()  # a data.eval_clients sample: those only
            evaluated = None if scored.numel() == self.metric.total.numel() else scored
            summary = self._summaries(evaluated)
            self.last_summary = summary
            self.last_evaluated = scored
            self.last_per_client = blank_unevaluated(summary["_per_client"], evaluated)

    def write_per_client_csv(self, directory: str) -> str:
        """Write ``test_per_client.csv`` (client, index, held_out, n_test, one column per metric, loss): one row
        per client the last evaluation scored."""
        engine = self.engine
        assert engine.data is not None
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, "test_per_client.csv")
        pc, keys = self.last_per_client, list(self.metric_directions)  # the metrics, then the loss
        names, is_holdout = engine.data.client_names, engine.federation.is_holdout
        with open(path, "w", newline="") as fh:
            writer = csv.writer(fh)
            writer.writerow(["client", "index", "held_out", "n_test", *keys])
            rows = range(len(names)) if self.last_evaluated is None else self.last_evaluated.tolist()
            for i in rows:
                writer.writerow([names[i], i, int(is_holdout[i]), int(pc["total"][i]),
                                 *(f"{float(pc[k][i]):.6f}" for k in keys)])
        return path


def blank_unevaluated(per_client: dict[str, Tensor], evaluated: Tensor | None) -> dict[str, Tensor]:
    """Per-client values on the CPU with NaN for every metric of a client not evaluated (``total`` stays 0), so
    the plots and summaries that drop NaN never read an unscored client as a zero."""
    out = {k: v.cpu() for k, v in per_client.items()}
    if evaluated is None:
        return out
    missing = torch.ones(out["total"].numel(), dtype=torch.bool)
    missing[evaluated.cpu()] = False
    return {k: v if k == "total" else v.masked_fill(missing, math.nan) for k, v in out.items()}
