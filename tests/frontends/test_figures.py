"""Figures for papers (issue 31): the round of a test-only evaluation, ``fedmeta compare`` over seeds
(groups, bands, paired differences, PDF/SVG/PNG), and the y-limits and legends of every figure."""

from __future__ import annotations

import io
import json
import math
from pathlib import Path
from xml.etree import ElementTree

import numpy as np
import pytest
import yaml
from lightning.pytorch.callbacks import ModelCheckpoint
from PIL import Image

from lightning_fedmeta import FederatedModule
from lightning_fedmeta.data import FederatedDataModule
from lightning_fedmeta.frontends.callbacks import HISTORY_FILE, PlotCallback, read_history
from lightning_fedmeta.frontends.compare import CompareError, compare_main
from tests.helpers import make_trainer


def _synthetic_module() -> tuple[FederatedModule, FederatedDataModule]:
    dm = FederatedDataModule(dataset="synthetic", num_clients=8, eval_every=2)
    module = FederatedModule(algorithm={"name": "fedavg", "local_lr": 0.05, "local_steps": 2}, clients_per_round=3)
    return module, dm


def test_a_test_of_a_checkpoint_is_recorded_at_the_checkpoint_round(tmp_path: Path) -> None:
    module, dm = _synthetic_module()
    saver = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
    make_trainer(4, callbacks=[saver], enable_checkpointing=True, default_root_dir=str(tmp_path)).fit(module, dm)
    ckpt = tmp_path / "ckpt" / "last.ckpt"
    assert ckpt.is_file()

    fresh, dm = _synthetic_module()  # what `fedmeta test --ckpt_path` builds: a new module and a test-only Trainer
    plots = PlotCallback(tmp_path / "test")
    make_trainer(0, callbacks=[plots]).test(fresh, dm, ckpt_path=str(ckpt))
    doc = read_history(tmp_path / "test" / HISTORY_FILE)
    assert [(h["round"], h["stage"]) for h in doc["history"] if h["stage"] == "test"] == [(4, "test")]
    assert doc["per_client_round"] == 4  # the histogram's "after round 4"


# ------------------------------------------------------------------------------------------------
# fedmeta compare as a figure tool: runs written as `fedmeta fit` writes them (history + config.yaml)
# ------------------------------------------------------------------------------------------------
FINALS = {  # algorithm -> seed -> (final weighted, final worst decile, best weighted) at round 6
    "fedavg": {0: (0.83, 0.50, 0.84), 1: (0.85, 0.55, 0.85), 2: (0.84, 0.40, 0.86)},
    "perfedavg": {2: (0.88, 0.60, 0.88), 0: (0.87, 0.52, 0.87), 1: (0.86, 0.58, 0.89)},  # another order on purpose
}


def _write_run(folder: Path, algorithm: str, seed: int, finals: tuple[float, float, float], lr: float = 0.05) -> Path:
    """A run folder as `fedmeta fit` leaves it: fedmeta_history.json and config.yaml (seeds, algorithm, paths)."""
    weighted, worst, best = finals
    history = [
        {"round": 2, "stage": "val", "metrics": {"val/acc_weighted": weighted - 0.02, "val/acc_worst10": worst - 0.1}},
        {"round": 4, "stage": "val", "metrics": {"val/acc_weighted": best, "val/acc_worst10": worst - 0.05}},
        {"round": 6, "stage": "val", "metrics": {"val/acc_weighted": weighted, "val/acc_worst10": worst}},
    ]
    folder.mkdir(parents=True)
    (folder / HISTORY_FILE).write_text(json.dumps({"version": 2, "history": history, "primary_metric": "acc"}))
    config = {"seed_everything": seed, "trainer": {"max_steps": 6, "default_root_dir": str(folder)},
              "model": {"algorithm": {"name": algorithm, "local_lr": lr}, "seed": seed},
              "data": {"dataset": "synthetic", "data_seed": seed}}
    (folder / "config.yaml").write_text(yaml.safe_dump(config))
    return folder


def _six_runs(root: Path) -> list[str]:
    return [str(_write_run(root / f"{alg}_s{seed}" / "lightning_logs" / "version_0", alg, seed, finals))
            for alg, by_seed in FINALS.items() for seed, finals in by_seed.items()]


def _mean_std(values: list[float]) -> tuple[float, float]:
    mean = sum(values) / len(values)
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


def test_compare_groups_seeds_and_tabulates_means_and_paired_differences(tmp_path: Path) -> None:
    out = io.StringIO()
    result = compare_main([*_six_runs(tmp_path), "--baseline", "fedavg", "--out", str(tmp_path / "fig.pdf"),
                           "--table", str(tmp_path / "table.md")], stream=out)
    assert [(g.label, len(g.runs)) for g in result.groups] == [("fedavg", 3), ("perfedavg", 3)]
    rows = {ln.split(" | ")[0][2:]: ln for ln in result.table.split("\n\n")[0].splitlines() if ln.startswith("| ")}
    for alg in FINALS:
        cells = [_mean_std([FINALS[alg][s][i] for s in (0, 1, 2)]) for i in range(3)]
        assert rows[alg] == (f"| {alg} | 3 | 0, 1, 2 | "
                             + " | ".join(f"{m:.4f} ± {sd:.4f}" for m, sd in cells) + " | 4 | 6 |")
    # paired seed by seed (not by position: perfedavg's runs come in the order 2, 0, 1)
    diffs = [_mean_std([FINALS["perfedavg"][s][i] - FINALS["fedavg"][s][i] for s in (0, 1, 2)]) for i in range(3)]
    paired = [ln for ln in result.table.splitlines() if ln.startswith("| perfedavg | 0, 1, 2 |")]
    assert paired == ["| perfedavg | 0, 1, 2 | " + " | ".join(f"{m:+.4f} ± {sd:.4f}" for m, sd in diffs) + " |"]
    assert result.differences is not None
    assert result.differences["perfedavg"]["final_acc_weighted"] == pytest.approx(diffs[0][0])
    assert (tmp_path / "table.md").read_text() == result.table + "\n"
    assert result.table in out.getvalue()


def test_compare_pairs_only_the_seeds_both_groups_ran(tmp_path: Path) -> None:
    dirs = _six_runs(tmp_path)
    dirs.append(str(_write_run(tmp_path / "perfedavg_s7", "perfedavg", 7, (0.99, 0.9, 0.99))))
    result = compare_main([*dirs, "--baseline", "fedavg", "--out", str(tmp_path)], stream=io.StringIO())
    assert result.summaries["perfedavg"]["n"] == 4
    assert result.differences is not None and result.differences["perfedavg"]["seeds"] == ["0", "1", "2"]
    expected = sum(FINALS["perfedavg"][s][0] - FINALS["fedavg"][s][0] for s in (0, 1, 2)) / 3
    assert result.differences["perfedavg"]["final_acc_weighted"] == pytest.approx(expected)


def test_compare_writes_pdf_svg_and_png_by_extension(tmp_path: Path) -> None:
    paths = [tmp_path / "figs" / f"cmp.{ext}" for ext in ("pdf", "svg", "png")]
    compare_main([*_six_runs(tmp_path), "--out", *map(str, paths), "--dpi", "150"], stream=io.StringIO())
    pdf = paths[0].read_bytes()
    assert pdf.startswith(b"%PDF-") and b"/Title (Personalised accuracy vs. round)" in pdf
    assert b"/CreationDate" not in pdf  # no date: the same runs give the same file
    root = ElementTree.parse(paths[1]).getroot()
    assert root.tag == "{http://www.w3.org/2000/svg}svg"
    with Image.open(paths[2]) as png:
        assert png.format == "PNG" and png.info["dpi"] == pytest.approx((150, 150), abs=0.05)
        assert png.size == (round(6.4 * 150), round(4.0 * 150))
    with pytest.raises(CompareError, match=r"--out .*fig\.jpg: cannot write a \.jpg figure; give a \.pdf, \.svg"):
        compare_main([*_six_runs(tmp_path / "again"), "--out", str(tmp_path / "fig.jpg")])


def test_compare_figure_legend_band_and_limits_follow_the_data(tmp_path: Path) -> None:
    dirs = _six_runs(tmp_path)
    result = compare_main([*dirs, "--out", str(tmp_path)], stream=io.StringIO())
    ax = result.figure.axes[0]
    legend = ax.get_legend()
    assert [t.get_text() for t in legend.get_texts()] == ["fedavg (3 seeds)", "perfedavg (3 seeds)"]
    assert legend.get_title().get_text() == "mean over seeds; band: min–max over seeds"
    fedavg_band = ax.collections[0].get_paths()[0].vertices[:, 1]  # min–max over seeds, over all rounds
    lowest = min(min(FINALS["fedavg"][s][0] - 0.02, FINALS["fedavg"][s][0]) for s in (0, 1, 2))
    assert fedavg_band.min() == pytest.approx(lowest)
    assert fedavg_band.max() == pytest.approx(max(FINALS["fedavg"][s][2] for s in (0, 1, 2)))
    low, high = ax.get_ylim()  # the data (0.81 to 0.89) plus a margin, not 0..1
    assert 0.79 < low < 0.81 and 0.89 < high < 0.91
    std = compare_main([*dirs, "--band", "std", "--ylim", "0.5", "1", "--out", str(tmp_path)],
                       stream=io.StringIO())
    title = std.figure.axes[0].get_legend().get_title().get_text()
    assert title == "mean over seeds; band: ±1 sample std over seeds"
    assert std.figure.axes[0].get_ylim() == (0.5, 1.0)
    fedavg = [r.info["history"] for r in std.groups[0].runs]
    finals = np.array([[h[-1]["metrics"]["val/acc_weighted"]] for h in fedavg])
    band = std.figure.axes[0].collections[0].get_paths()[0].vertices
    at_last = band[band[:, 0] == 6, 1]  # the band's edges at the last round
    assert at_last.max() == pytest.approx(finals.mean() + finals.std(ddof=1))
    assert at_last.min() == pytest.approx(finals.mean() - finals.std(ddof=1))


def test_compare_names_groups_that_share_an_algorithm_by_their_difference(tmp_path: Path) -> None:
    dirs = [str(_write_run(tmp_path / f"lr{lr}_s{s}", "fedavg", s, FINALS["fedavg"][s], lr=lr))
            for lr in (0.05, 0.1) for s in (0, 1)]
    result = compare_main([*dirs, "--baseline", "fedavg (local_lr=0.05)", "--out", str(tmp_path)],
                          stream=io.StringIO())
    assert [g.label for g in result.groups] == ["fedavg (local_lr=0.05)", "fedavg (local_lr=0.1)"]
    assert result.differences is not None
    assert result.differences["fedavg (local_lr=0.1)"]["final_acc_weighted"] == 0  # the same finals, seed by seed
    named = compare_main([*dirs, "--labels", "slow", "fast", "--out", str(tmp_path)], stream=io.StringIO())
    legend = named.figure.axes[0].get_legend()
    assert [t.get_text() for t in legend.get_texts()] == ["slow (2 seeds)", "fast (2 seeds)"]


def test_compare_refuses_what_it_cannot_answer_honestly(tmp_path: Path) -> None:
    dirs = _six_runs(tmp_path)
    with pytest.raises(CompareError, match=r"--baseline 'fedprox' is not a group; the groups are fedavg, perfedav"):
        compare_main([*dirs, "--baseline", "fedprox", "--out", str(tmp_path)])
    twice = str(_write_run(tmp_path / "again", "fedavg", 0, FINALS["fedavg"][0]))
    with pytest.raises(CompareError, match=r"the same configuration and the same seed \(0\).*pass one of them"):
        compare_main([*dirs, twice, "--out", str(tmp_path)])
    plain = tmp_path / "plain"  # a history without a config: no seed to pair
    plain.mkdir()
    (plain / HISTORY_FILE).write_text((Path(dirs[0]) / HISTORY_FILE).read_text())
    with pytest.raises(CompareError, match=r"--baseline 'plain': run 'plain' records no seed"):
        compare_main([str(plain), dirs[3], "--baseline", "plain", "--out", str(tmp_path)])


def test_a_run_figure_names_the_algorithm_and_fits_its_values(tmp_path: Path) -> None:
    from lightning_fedmeta.frontends.plots import metric_vs_round_figure  # here: its absence fails this test alone

    history = [{"round": r, "stage": "val", "metrics": {"val/acc_weighted": w, "val/acc_worst10": w - 0.05}}
               for r, w in ((2, 0.83), (4, 0.86), (6, 0.88))]
    history.append({"round": 6, "stage": "test", "metrics": {"test/acc_weighted": 0.87}})
    ax = metric_vs_round_figure(history, algorithm="ditto").axes[0]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [
        "ditto: weighted mean", "ditto: worst 10% of clients", "ditto, test: weighted mean"]
    low, high = ax.get_ylim()
    assert 0.76 < low < 0.78 and 0.88 < high < 0.90
    module, dm = _synthetic_module()
    make_trainer(2, callbacks=[PlotCallback(tmp_path)]).fit(module, dm)
    assert read_history(tmp_path / HISTORY_FILE)["algorithm"] == "fedavg"
