"""benchmarks/equal_work.py: equal client work, validation-only tuning, winner choice, paired report (issue 14)."""

from __future__ import annotations

import math

import pytest
import yaml

from benchmarks import equal_work as ew
from benchmarks.harness import REPO, sha256_text


def test_every_work_matched_entry_spends_16_gradient_evaluations_per_client_per_round() -> None:
    for e in ew.ENTRIES.values():
        if e.cell is not None:
            assert ew.entry_work(e) == e.cell[0], e.key  # the grid baseline: τ, as the matched baseline
        elif e.key != "mocha_linear":
            assert ew.entry_work(e) == ew.WORK == 16, e.key
    # MOCHA: 640 SDCA coordinate steps = 16 steps x batch 40 per-sample updates
    assert ew.ENTRIES["mocha_linear"].algorithm["local_iters"] == 16 * 40


#: how each issue-27 entry reaches 16: (gradient evaluations per step or per component-step, steps) by hand from
#: each algorithm's client_update (APFL, FedRoD: 2 per step; FedEM: one per component; FedALA: 4 W + 12 SGD steps)
PFL_WORK = {"fedbn_w16": (1, 16), "fedavg_ft_bn_w16": (1, 16), "lg_fedavg_w16": (1, 16), "fedbabu_w16": (1, 16),
            "fedamp_w16": (1, 16), "pfedhn_w16": (1, 16), "apfl_w16": (2, 8), "fedrod_w16": (2, 8),
            "fedem_w16": (2, 8),
            "fedala_w16": (1, 4 + 12), "fedproto_w16": (1, 16), "feddbe_w16": (1, 16), "fedfomo_w16": (1, 16),
            "fedpac_w16": (1, 4 + 12), "fedas_w16": (1, 4 + 8 + 4)}


def test_every_issue_27_entry_spends_16_gradient_evaluations_counted_from_its_config(tmp_path) -> None:
    """The committed-config route (``config_grad_evals`` reads the YAML the final runs train) gives 16 for every new
    entry and every sweep candidate, as the hand count does, and the algorithm accepts the config's arguments."""
    from benchmarks.accuracy import config_grad_evals
    from lightning_fedmeta.registry import load_algorithm

    assert set(ew.PFL_ENTRIES) == set(PFL_WORK)
    for key in ew.PFL_ENTRIES:
        e = ew.ENTRIES[key]
        per, steps = PFL_WORK[key]
        assert per * steps == 16, key
        for c in e.sweep:
            p = tmp_path / f"{key}.yaml"
            p.write_text(ew.final_config(e, c, [(c, 0.5)]))
            algo = yaml.safe_load(p.read_text())["model"]["algorithm"]
            assert config_grad_evals(p) == (algo["name"], 16), (key, c)
            load_algorithm(algo["name"])(**{k: v for k, v in algo.items() if k != "name"})


def test_the_issue_27_counting_rules_follow_the_steps_each_client_computes() -> None:
    from benchmarks.accuracy import grad_evals_per_round as g

    assert g("apfl", {"local_steps": 5}) == g("fedrod", {"local_steps": 5}) == 10  # two gradients per step
    assert g("fedem", {"num_components": 3, "local_steps": 5}) == 15  # τ steps per component
    # FedALA computes max(ala_steps, ala_start_steps) W-gradients every round (the extra ones at rate 0 after the first)
    assert g("fedala", {"ala_steps": 4, "ala_start_steps": 20, "local_steps": 12}) == 32
    assert g("fedala", {"ala_steps": 6, "ala_start_steps": 2, "local_steps": 10}) == 16
    for name in ("fedbn", "lg_fedavg", "fedbabu", "fedamp", "pfedhn", "fedproto", "feddbe", "fedfomo"):
        assert g(name, {"local_steps": 7}) == 7, name
    # FedPAC: head-only steps, then body steps; FedAS: alignment steps, training steps and one batch gradient per
    # Fisher batch (every training batch by default, at most those; none with fisher="off")
    assert g("fedpac", {"head_steps": 3, "local_steps": 5}) == 8
    assert g("fedas", {"align_steps": 2, "local_steps": 5}) == 2 + 5 + 5
    assert g("fedas", {"align_steps": 2, "local_steps": 5, "fisher_steps": 3}) == 2 + 5 + 3
    assert g("fedas", {"align_steps": 2, "local_steps": 5, "fisher_steps": 9}) == 2 + 5 + 5
    assert g("fedas", {"align_steps": 2, "local_steps": 5, "fisher": "off"}) == 2 + 5


def test_sweep_candidates_are_scored_on_the_validation_split_and_finals_on_the_test_set() -> None:
    for e in ew.ENTRIES.values():
        assert len(e.sweep) >= 3, e.key
        for c in e.sweep:
            doc = yaml.safe_load(ew.candidate_config(e, c))
            assert doc["data"]["validation_fraction"] == 0.2
            assert doc["trainer"]["max_steps"] == ew.SWEEP_ROUNDS
            for k, v in c.items():
                scope, name = k.split(".", 1)
                where = doc["model"]["algorithm"] if scope == "algorithm" else doc["model"]
                assert where[name] == v
        final = yaml.safe_load(ew.final_config(e, e.sweep[1], [(c, 0.5) for c in e.sweep]))
        assert "validation_fraction" not in final["data"]
        assert final["trainer"]["max_steps"] == 1000
        assert final["data"]["partition"] == "perfedavg_paper" and final["model"]["aggregation"] == "uniform"


def test_the_winner_is_the_best_validation_score_first_listed_on_ties_and_waits_for_every_candidate() -> None:
    a, b, c = {"algorithm.local_lr": 0.01}, {"algorithm.local_lr": 0.03}, {"algorithm.local_lr": 0.1}
    assert ew.pick_winner([(a, 0.7), (b, 0.8), (c, 0.75)]) == b
    assert ew.pick_winner([(a, 0.8), (b, 0.8), (c, 0.75)]) == a
    assert ew.pick_winner([(a, 0.7), (b, None), (c, 0.9)]) is None  # a candidate still to run
    assert ew.pick_winner([(a, 0.7), (b, ew.DIVERGED), (c, 0.6)]) == a  # a diverged run is a result
    assert ew.pick_winner([(a, ew.DIVERGED), (b, ew.DIVERGED), (c, ew.DIVERGED)]) is None


def _sweep_record(entry, cand, acc=None, error=None):
    rec = {"stage": "sweep", "entry": entry.key, "candidate": cand, "seed": ew.SWEEP_SEED, "rounds": ew.SWEEP_ROUNDS,
           "config_sha256": sha256_text(ew.candidate_config(entry, cand))}
    return rec | ({"error": error} if error else {"acc_weighted": acc})


def test_scores_read_the_records_of_the_current_configs_only_and_mark_divergence() -> None:
    e = ew.ENTRIES["ditto_w16"]
    recs = [_sweep_record(e, e.sweep[0], 0.61), _sweep_record(e, e.sweep[1], error="FloatingPointError: round 3: "
                                                                                     "non-finite loss"),
            _sweep_record(e, e.sweep[2], error="RuntimeError: killed"),
            {**_sweep_record(e, e.sweep[2], 0.99), "config_sha256": "stale"}]
    scores = ew.sweep_scores(e, recs)
    assert [s for _, s in scores] == [0.61, ew.DIVERGED, None]


def _final(entry_key, text, seed, acc):
    return {"stage": "final", "entry": entry_key, "seed": seed, "rounds": 1000, "config_sha256": sha256_text(text),
            "config_body_sha256": ew.body_sha256(text),
            "acc_weighted": acc, "acc_worst10": acc - 0.2, "new_acc_weighted": acc - 0.1, "best_acc_weighted": acc,
            "wall_s": 10.0}


def test_summary_means_and_paired_differences_against_equal_work_fedavg() -> None:
    fed, dit = ew.ENTRIES["fedavg_ft_w16"], ew.ENTRIES["ditto_w16"]
    sweep = [_sweep_record(e, c, [0.5, 0.7, 0.6][i]) for e in (fed, dit) for i, c in enumerate(e.sweep)]
    texts = {e.key: ew.final_config(e, e.sweep[1], ew.sweep_scores(e, sweep)) for e in (fed, dit)}
    fin = [_final("fedavg_ft_w16", texts["fedavg_ft_w16"], s, a) for s, a in [(0, 0.90), (1, 0.92), (2, 0.91)]]
    fin += [_final("ditto_w16", texts["ditto_w16"], s, a) for s, a in [(0, 0.93), (1, 0.93), (2, 0.96)]]
    rows = ew.summarise([fed, dit], sweep, fin, [0, 1, 2])
    r = {x["entry"]: x for x in rows}
    assert r["ditto_w16"]["winner"] == dit.sweep[1] and not r["ditto_w16"]["winner_at_edge"]
    assert r["ditto_w16"]["acc_weighted_mean"] == pytest.approx(0.94)
    assert r["ditto_w16"]["acc_weighted_std"] == pytest.approx(math.sqrt(0.0003))
    mean, std, n = ew.paired_against(rows, "fedavg_ft_w16")["ditto_w16"]
    # differences 0.03, 0.01, 0.05
    assert (mean, n) == (pytest.approx(0.03), 3) and std == pytest.approx(0.02)


def test_committed_winner_configs_follow_from_the_committed_sweep_records() -> None:
    """Every committed winner config is exactly what the generator writes from the committed sweep."""
    sweep_path = REPO / ew.RESULTS / "sweep_fashion_mnist.jsonl"
    committed = sorted((REPO / ew.WINNER_DIR).glob("*.yaml"))
    if not committed:
        pytest.skip("no sweep winner committed yet")
    records = ew.read_records(sweep_path)
    finals = ew.read_records(REPO / ew.RESULTS / "final_fashion_mnist.jsonl")
    for p in committed:
        entry = ew.ENTRIES[p.stem]
        assert ew._winner_text(entry, records, finals) == p.read_text(), p.name


def test_a_sweep_whose_best_value_is_at_its_edge_is_extended_on_the_ladder_then_stops() -> None:
    e = ew.ENTRIES["fedavg_ft_w16"]  # local_lr and the tied finetune_lr: 0.01, 0.03, 0.1
    recs = [_sweep_record(e, c, acc) for c, acc in zip(e.sweep, [0.90, 0.91, 0.92], strict=True)]
    scores = ew.sweep_scores(e, recs)
    up = {"algorithm.local_lr": 0.3, "algorithm.finetune_lr": 0.3}
    assert [c for c, _ in scores] == [*e.sweep, up] and scores[-1][1] is None  # 0.1 won at the edge: try 0.3
    assert ew.pick_winner(scores) is None  # no winner until the extension has run
    recs.append(_sweep_record(e, up, 0.93))  # 0.3 wins again: try 1.0, then stop (MAX_EXTENSIONS = 2)
    up2 = {"algorithm.local_lr": 1.0, "algorithm.finetune_lr": 1.0}
    assert [c for c, _ in ew.sweep_scores(e, recs)][-1] == up2
    recs.append(_sweep_record(e, up2, 0.94))
    scores = ew.sweep_scores(e, recs)
    assert len(scores) == 5 and ew.pick_winner(scores) == up2
    row = ew.summarise([e], recs, [], [0])[0]
    assert row["winner_at_edge"]  # still at the edge after the last extension: the report says so


def test_an_extension_that_diverges_or_loses_ends_the_sweep_with_an_interior_winner() -> None:
    e = ew.ENTRIES["fedmaml_w16"]  # server_lr 0.1, 0.3, 1.0
    recs = [_sweep_record(e, c, acc) for c, acc in zip(e.sweep, [0.90, 0.87, None], strict=True)]
    recs[2] = _sweep_record(e, e.sweep[2], error="FloatingPointError: round 11: non-finite loss")
    scores = ew.sweep_scores(e, recs)
    down = {"model.server_lr": 0.03}  # 0.1 won at the lower edge
    assert [c for c, _ in scores] == [down, *e.sweep]
    recs.append(_sweep_record(e, down, 0.85))
    scores = ew.sweep_scores(e, recs)
    assert len(scores) == 4 and ew.pick_winner(scores) == e.sweep[0]


def test_the_next_value_follows_the_ladder_or_the_sweeps_own_ratio() -> None:
    assert ew._next_value([0.01, 0.03, 0.1], up=True) == 0.3
    assert ew._next_value([0.01, 0.03, 0.1], up=False) == 0.003
    assert ew._next_value([0.005, 0.02, 0.05], up=True) == 0.12  # off the ladder: ratio 2.5, 2 digits
    assert ew._next_value([0.005, 0.02, 0.05], up=False) == 0.0013  # ratio 4


def test_finals_are_keyed_by_the_config_without_its_comments() -> None:
    e = ew.ENTRIES["ditto_w16"]
    a = ew.final_config(e, e.sweep[1], [(c, 0.5) for c in e.sweep])
    b = ew.final_config(e, e.sweep[1], [(c, 0.6) for c in e.sweep] + [({"algorithm.local_lr": 0.3}, 0.1)])
    assert a != b and ew.body_sha256(a) == ew.body_sha256(b)
    assert ew.body_sha256(a) != ew.body_sha256(ew.final_config(e, e.sweep[2], []))


def test_a_winner_whose_final_run_diverges_is_withdrawn_for_the_next_best_by_validation() -> None:
    e = ew.ENTRIES["fedavg_tuned_tau4_alpha0.001"]  # local_lr 0.003, 0.01, 0.03, 0.1
    recs = [_sweep_record(e, c, acc) for c, acc in zip(e.sweep, [0.78, 0.83, 0.85, 0.84], strict=True)]
    winner, scores, withdrawn = ew.choose(e, recs, [])
    assert winner == e.sweep[2] and withdrawn == []
    text = ew.final_config(e, winner, scores)
    boom = {**_final(e.key, text, 1, 0.0), "error": "FloatingPointError: round 13: non-finite loss"}
    other_error = {**_final(e.key, text, 2, 0.0), "error": "RuntimeError: killed"}  # not a divergence: retried
    assert ew.choose(e, recs, [other_error])[0] == e.sweep[2]
    winner, scores, withdrawn = ew.choose(e, recs, [boom, other_error])
    assert winner == e.sweep[3] and withdrawn == [(e.sweep[2], [1])]  # 0.1 is next best (0.84 > 0.83)
    assert "withdrawn: its final run diverged with seed(s) [1]" in ew.final_config(e, winner, scores, withdrawn)


def test_a_candidate_refused_at_setup_is_a_result_that_ends_the_sweep() -> None:
    """pFedMe's off-ladder sweep 0.005, 0.02, 0.05 extends to 0.12, then 0.29, which the library refuses
    (local_lr·λ < 2); the refusal is a result: 0.12 wins, inside its sweep, with no run left pending."""
    e = ew.ENTRIES["pfedme_w16"]
    key = next(iter(e.sweep[0]))
    recs = [_sweep_record(e, c, acc) for c, acc in zip(e.sweep, [0.788, 0.886, 0.903], strict=True)]
    up = ew.sweep_scores(e, recs)[-1][0]
    assert up[key] == 0.12
    recs.append(_sweep_record(e, up, 0.905))
    up2 = ew.sweep_scores(e, recs)[-1][0]
    assert up2[key] == 0.29
    recs.append(_sweep_record(e, up2, error="fedmeta: error: local_lr·lam must be < 2, got 0.29·15.0 = 4.35"))
    scores = ew.sweep_scores(e, recs)
    assert [s for _, s in scores][-1] == ew.REFUSED and ew.pick_winner(scores) == up
    row = ew.summarise([e], recs, [], [0])[0]
    assert row["winner"] == up and not row["winner_at_edge"]
    assert "refused at setup" in ew.final_config(e, up, scores)
    crashed = [*recs[:-1], _sweep_record(e, up2, error="RuntimeError: killed")]  # not a refusal: retried
    assert ew.sweep_scores(e, crashed)[-1][1] is None


def test_the_driver_runs_the_successors_finals_when_a_winner_is_withdrawn_mid_run(tmp_path, monkeypatch) -> None:
    """A run in which the best-by-validation candidate diverges in its final runs goes on to run all three finals of
    the next best in the same invocation (the old driver remembered the finals as tried by seed alone)."""
    e = ew.ENTRIES["fedavg_tuned_tau4_alpha0.001"]
    key = next(iter(e.sweep[0]))
    sweep_acc = {c[key]: acc for c, acc in zip(e.sweep, [0.78, 0.83, 0.84, 0.85], strict=True)}
    sweep_acc[ew._next_value([c[key] for c in e.sweep], up=True)] = 0.86  # the edge extension wins validation
    best = max(sweep_acc, key=sweep_acc.get)
    calls: list[tuple[str, float, int]] = []

    def fake_run(config_text, config_file, seed, rounds, out_dir, threads, extra, root=None):
        lr = yaml.safe_load(config_text)["model"]["algorithm"][key.split(".", 1)[1]]
        calls.append((extra["stage"], lr, seed))
        rec = {**extra, "seed": seed, "rounds": rounds, "config_sha256": sha256_text(config_text),
               "config_body_sha256": ew.body_sha256(config_text), "wall_s": 1.0}
        if extra["stage"] == "sweep":
            if lr not in sweep_acc:  # the second extension diverges
                return rec | {"error": "FloatingPointError: round 2: client 0 produced a non-finite loss"}
            return rec | {"acc_weighted": sweep_acc[lr]}
        if lr == best and seed in (0, 1):
            return rec | {"error": f"FloatingPointError: round 9: client 3 produced a non-finite loss (seed {seed})"}
        return rec | {"acc_weighted": 0.9 + seed / 100, "acc_worst10": 0.5, "new_acc_weighted": 0.8,
                      "best_acc_weighted": 0.91, "curve": [[1000, 0.9, 0.5, 0.8]], "per_client_acc": [0.9]}

    monkeypatch.setattr(ew, "_run", fake_run)
    monkeypatch.setattr(ew, "REPO", tmp_path)
    results = tmp_path / "results"
    ew.main(["--entries", e.key, "--jobs", "1", "--results", str(results), "--report-dir", str(tmp_path / "report"),
             "--runs", str(tmp_path / "runs")])
    finals = [(lr, s) for stage, lr, s in calls if stage == "final"]
    successor = max((lr for lr in sweep_acc if lr != best), key=sweep_acc.get)
    assert sorted(s for lr, s in finals if lr == successor) == [0, 1, 2]
    row = ew.summarise([e], ew.read_records(results / "sweep_fashion_mnist.jsonl"),
                       ew.read_records(results / "final_fashion_mnist.jsonl"), [0, 1, 2])[0]
    assert row["winner"][key] == successor and row["seeds_done"] == 3
    assert row["withdrawn"] and row["withdrawn"][0][0][key] == best
    md = (tmp_path / "report" / "equal_work.md").read_text()  # a run of one entry keeps every entry's row
    assert all(f"| {x.label} |" in md for x in ew.ENTRIES.values() if x.plugin is None)


def test_mnist_runs_the_same_comparison_on_its_own_validation_data_and_files(tmp_path, monkeypatch, capsys) -> None:
    """``--dataset mnist --root DIR``: the candidates and winners are MNIST configs, every run is told the root,
    and the records, winners and report are MNIST's own (the Fashion-MNIST ones are not touched)."""
    e = ew.ENTRIES["ditto_w16"]
    seen: list[tuple[str, str | None, str]] = []

    def fake_run(config_text, config_file, seed, rounds, out_dir, threads, extra, root=None):
        doc = yaml.safe_load(config_text)
        seen.append((doc["data"]["dataset"], root, extra["stage"]))
        rec = {**extra, "seed": seed, "rounds": rounds, "root": root, "config_sha256": sha256_text(config_text),
               "config_body_sha256": ew.body_sha256(config_text), "wall_s": 1.0}
        lr = doc["model"]["algorithm"]["local_lr"]
        return rec | {"acc_weighted": 0.9 - abs(lr - 0.03), "acc_worst10": 0.5, "new_acc_weighted": 0.8,
                      "best_acc_weighted": 0.9, "curve": [[1000, 0.9, 0.5, 0.8]], "per_client_acc": [0.9]}

    monkeypatch.setattr(ew, "_run", fake_run)
    monkeypatch.setattr(ew, "REPO", tmp_path)
    with pytest.raises(SystemExit):
        ew.main(["--entries", e.key, "--dataset", "mnist"])
    assert "--dataset mnist needs --root DIR" in capsys.readouterr().err
    results = tmp_path / "results"
    ew.main(["--entries", e.key, "--jobs", "1", "--dataset", "mnist", "--root", str(tmp_path / "mnist"),
             "--results", str(results), "--report-dir", str(tmp_path / "report"), "--runs", str(tmp_path / "runs")])
    assert seen and {(d, r) for d, r, _ in seen} == {("mnist", str(tmp_path / "mnist"))}
    assert sorted(stage for *_, stage in seen) == ["final"] * 3 + ["sweep"] * 3
    assert not (results / "sweep_fashion_mnist.jsonl").exists() and (results / "sweep_mnist.jsonl").exists()
    winner = tmp_path / "configs/paper/equal_work_mnist" / f"{e.key}.yaml"
    text = winner.read_text()
    assert yaml.safe_load(text)["data"]["dataset"] == "mnist" and "--data.root DIR" in text
    assert yaml.safe_load(text)["model"]["algorithm"]["local_lr"] == 0.03
    assert not (tmp_path / ew.WINNER_DIR).exists()
    md = (tmp_path / "report" / "equal_work_mnist.md").read_text()
    assert md.startswith("# Every algorithm at equal work, tuned on validation data (MNIST")
    assert (results / "equal_work_mnist_curves.png").exists()


def test_the_smoke_runs_each_first_candidate_for_a_few_rounds_only() -> None:
    """``--smoke`` checks configs in minutes: its config is the candidate's with trainer.max_steps cut to
    SMOKE_ROUNDS (it used to run the whole 300-round candidate) and evaluated at the end."""
    for e in ew.ENTRIES.values():
        cand = yaml.safe_load(ew.candidate_config(e, e.sweep[0]))
        smoke = yaml.safe_load(ew.smoke_config(e, e.sweep[0]))
        assert smoke["trainer"]["max_steps"] == ew.SMOKE_ROUNDS == smoke["data"]["eval_every"] < ew.SWEEP_ROUNDS
        assert smoke["model"] == cand["model"]
        assert {k: v for k, v in smoke["data"].items() if k != "eval_every"} == {
            k: v for k, v in cand["data"].items() if k != "eval_every"}
