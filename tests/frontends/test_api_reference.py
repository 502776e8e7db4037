"""The documentation a plugin author reads cannot go stale (issue 31, items 10 and 13).

* The API reference (docs/api/*.md) is plain Markdown written from the docstrings by
  docs/make_api_reference.py, readable on GitHub and in a terminal; a page out of date with the code
  fails here, naming the command that rewrites it. Every public object has its entry, and every link
  in the pages points at a heading that exists (GitHub and the site derive the same anchors).
* The facts the user guide copies from the code: the dataset and partition names in faq.md, and
  the options of the usage blocks in cli.md (``fedmeta fit --help``, ``fedmeta compare``).
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import re
import shutil
import sys

import pytest

from tests.helpers import REPO

API_DIR = REPO / "docs" / "api"
REGENERATE = "python docs/make_api_reference.py"


def _generator():
    """docs/make_api_reference.py, imported from its file (it is a script, not part of the package)."""
    spec = importlib.util.spec_from_file_location("make_api_reference", REPO / "docs" / "make_api_reference.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def generator():
    return _generator()


def _headings(text: str) -> list[str]:
    in_fence = False
    found = []
    for line in text.split("\n"):
        if line.startswith("```"):
            in_fence = not in_fence
        elif not in_fence and re.match(r"#{1,6} ", line):
            found.append(line.lstrip("#").strip())
    return found


def test_api_reference_pages_are_up_to_date(generator):
    stale = [str(p.relative_to(REPO)) for p in generator.stale_pages()]
    assert not stale, f"{stale} differ from the docstrings and signatures in lightning_fedmeta: run {REGENERATE}"


def test_a_changed_docstring_makes_its_page_stale_and_prose_is_kept(generator, tmp_path, monkeypatch):
    """The check compares with the code: a docstring edit is caught, hand-written prose survives a rewrite."""
    pages = tmp_path / "api"
    shutil.copytree(API_DIR, pages)
    assert generator.stale_pages(pages) == []
    from lightning_fedmeta import Algorithm

    monkeypatch.setattr(Algorithm.round_plan, "__doc__", "A new sentence about round plans.")
    assert generator.stale_pages(pages) == [pages / "algorithm.md"]
    written = generator.render_all(pages)[pages / "algorithm.md"]
    assert "A new sentence about round plans." in written
    assert "The contract between an algorithm and the federated loop" in written


def test_the_pages_are_plain_markdown(generator):
    """No site-generator directive and no Sphinx role is left for a GitHub or terminal reader."""
    for page in API_DIR.glob("*.md"):
        text = page.read_text(encoding="utf-8")
        assert not re.search(r"^:::", text, re.M), f"{page.name} holds a mkdocstrings directive"
        assert not generator.ROLE.search(text), f"{page.name} holds a Sphinx role: {generator.ROLE.search(text)[0]}"
        assert "<!-- api:" in text or page.name == "index.md", f"{page.name} documents no object"


def test_every_public_object_has_an_entry():
    import lightning_fedmeta
    import lightning_fedmeta.testing

    headings = {h.strip("`") for page in API_DIR.glob("*.md") for h in _headings(page.read_text(encoding="utf-8"))}
    wanted = [n for n in lightning_fedmeta.__all__ if not n.startswith("_")] + list(lightning_fedmeta.testing.__all__)
    wanted += ["FederatedDataModule", "list_algorithms", "load_algorithm", "create_algorithm", "describe_algorithms",
               "lightning_fedmeta.privacy.mechanism", "lightning_fedmeta.reliability.robust",
                   "lightning_fedmeta.reliability.participation",
               "lightning_fedmeta.reliability.attacks", "FederatedModule.personalize"]
    missing = [n for n in wanted if n not in headings]
    assert not missing, f"no entry in docs/api for {missing}: add an <!-- api: ... --> block and run {REGENERATE}"


def test_links_point_at_headings_that_exist(generator):
    """Each ``page.md#anchor`` link of the reference names a heading of that page, and no heading repeats."""
    slugs = {}
    for page in API_DIR.glob("*.md"):
        headings = _headings(page.read_text(encoding="utf-8"))
        repeated = sorted({h for h in headings if headings.count(h) > 1})
        assert not repeated, f"{page.name} repeats the headings {repeated}: GitHub and the site number them apart"
        slugs[page.name] = {generator.slug(h) for h in headings}
    for page in API_DIR.glob("*.md"):
        for target, anchor in re.findall(r"\]\(([\w.]*\.md)?#([\w-]+)\)", page.read_text(encoding="utf-8")):
            assert anchor in slugs.get(target or page.name, set()), f"{page.name}: dead link {target}#{anchor}"


def test_slug_matches_github_and_toc():
    slugify = pytest.importorskip("markdown.extensions.toc", reason="mkdocs (the docs extra) is not installed").slugify

    generator = _generator()
    for heading in ["`Algorithm.aggregate`", "`lightning_fedmeta.testing`", "`client_records`", "`CHECKS`"]:
        assert generator.slug(heading) == slugify(heading.replace("`", ""), "-")


def test_faq_lists_the_real_dataset_and_partition_names():
    from lightning_fedmeta.data import DATASET_NAMES, PARTITION_NAMES

    faq = (REPO / "docs" / "faq.md").read_text(encoding="utf-8")
    datasets = re.search(r"`unknown dataset '…'; choose one of \[(.*?)\]`", faq)
    partitions = re.search(r"`unknown partition '…'; choose one of \[(.*?)\]`", faq)
    assert datasets and partitions, "faq.md lost its rows for the unknown dataset / partition messages"
    assert datasets[1] == str(list(DATASET_NAMES))[1:-1], f"faq.md lists [{datasets[1]}], the code {DATASET_NAMES}"
    assert partitions[1] == str(list(PARTITION_NAMES))[1:-1], f"faq.md: [{partitions[1]}] != {PARTITION_NAMES}"
    data_page = (REPO / "docs" / "data.md").read_text(encoding="utf-8")
    assert not [n for n in DATASET_NAMES if f"`{n}`" not in data_page], "docs/data.md misses a built-in dataset"


def _usage_block(heading: str) -> str:
    """The first fenced block after ``heading`` in docs/cli.md."""
    text = (REPO / "docs" / "cli.md").read_text(encoding="utf-8")
    after = text[text.index(heading):]
    return after.split("```\n", 2)[1]


def _options(text: str) -> set[str]:
    return set(re.findall(r"(?<![\w-])(--[a-z_]+(?:\.[a-z_]+)?)(?![\w.])", text))



def test_cli_usage_blocks_list_the_real_options():
    from lightning_fedmeta.cli import run
    from lightning_fedmeta.frontends.compare import _parser

    real_fit = io.StringIO()
    with contextlib.redirect_stdout(real_fit), pytest.raises(SystemExit):
        run(["fit", "--help"])
    real = {o for o in _options(real_fit.getvalue()) if not o.startswith("--trainer.")}
    assert {"--model.algorithm", "--data.dataset", "--ckpt_path"} <= real, "the help was not captured"
    documented = _options(_usage_block("## `fedmeta fit --help` (abridged)"))
    assert documented - _options(real_fit.getvalue()) == set(), "docs/cli.md names fit options that do not exist"
    assert real - documented == set(), "docs/cli.md's fit usage misses these options: add them"
    compare_real = _options(_parser().format_usage())
    compare_documented = _options(_usage_block("## `fedmeta compare`"))
    assert compare_documented == compare_real, f"docs/cli.md's compare usage: {compare_documented} != {compare_real}"
