"""The Python examples of the quick start (docs/index.md), the plugin guide (docs/plugins.md) and the
README run, so they cannot rot.

Every ```python block of those files is executed, in a temporary working directory. Each block
runs on its own unless an HTML comment right before it (blank lines allowed in between) says
otherwise:

* ``<!-- docs-test: continue -->``: the block continues the previous one; they run together as one
  program (so a block may also continue a class body started by the previous one);
* ``<!-- docs-test: requires pfedme -->``: skipped, with the reason, when the example plugin is not
  installed (``pip install ./plugins/fedmeta-pfedme``). A block that names ``fashion_mnist`` needs
  the Fashion-MNIST files (Debian package ``dataset-fashion-mnist``) and is skipped without them,
  no marker needed;
* ``<!-- docs-test: skip: <reason> -->``: not executed (a fragment; keep these rare).

Options combine with commas (``continue, requires pfedme``). The program is compiled under the
markdown file's name with every line at its line number there, so a failure's traceback points
at the documentation line.
"""

from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass, field
from pathlib import Path

import lightning
import pytest

from tests.helpers import REPO

ROOT = REPO
DOCUMENTS = ["README.md", "docs/index.md", "docs/plugins.md", "docs/testing.md", "docs/tasks.md",
             "docs/lightning_project.md"]

# README's example is written "inside an existing Lightning project": `my_net` is the reader's own
# network, and it trains 200 rounds of Ditto on Fashion-MNIST. The test supplies a network and stops
# its Trainer after a few rounds. docs/lightning_project.md's "after" example trains 10 rounds of Per-FedAvg on a
# CNN (the slowest example, over a minute on 2 busy cores): its Trainers stop at 5 steps, which still reaches its
# eval_every = 5 evaluation (the summary it prints) and runs its "before" Lightning fit over 5 of its 20 batches.
# The other pages' examples are small enough to run as written.
PRELUDE = {"README.md": "from lightning_fedmeta.models.reference import MLP\nmy_net = MLP(784, [80, 60], 10)\n"}
MAX_ROUNDS = {"README.md": 3, "docs/lightning_project.md": 5}

MARKER = re.compile(r"^\s*<!--\s*docs-test:(?P<options>.*?)-->\s*$")
FENCE = re.compile(r"^(?P<indent>[ ]*)(?P<fence>`{3,}|~{3,})\s*(?P<info>[^`]*)$")


@dataclass
class Block:
    path: str
    first_line: int  # 1-based line number of the block's first code line
    code: list[str]
    requires: list[str] = field(default_factory=list)


def _requirement_missing(name: str) -> str | None:
    """Why a requirement is not met, or ``None`` when it is."""
    if name == "pfedme":
        from lightning_fedmeta import list_algorithms

        if importlib.util.find_spec("fedmeta_pfedme") is None or "pfedme" not in {e.name for e in list_algorithms()}:
            return "the example plugin is not installed (pip install ./plugins/fedmeta-pfedme)"
        return None
    if name == "fashion-mnist":
        from lightning_fedmeta.data import DEFAULT_FASHION_MNIST_ROOT, has_dataset_files

        if not has_dataset_files("fashion_mnist", DEFAULT_FASHION_MNIST_ROOT):
            return f"Fashion-MNIST is not in {DEFAULT_FASHION_MNIST_ROOT} (apt-get install dataset-fashion-mnist)"
        return None
    raise ValueError(f"unknown docs-test requirement {name!r} (known: pfedme, fashion-mnist)")


def _parse_options(text: str, where: str) -> dict[str, object]:
    options: dict[str, object] = {"continue": False, "skip": None, "requires": []}
    for raw in text.split(","):
        option = raw.strip()
        if option == "continue":
            options["continue"] = True
        elif option.startswith("skip"):
            reason = option[len("skip"):].lstrip(":").strip()
            if not reason:
                raise ValueError(f"{where}: 'docs-test: skip' needs a reason ('skip: <why>')")
            options["skip"] = reason
        elif option.startswith("requires "):
            name = option[len("requires "):].strip()
            _requirement_missing(name)  # validates the name
            options["requires"].append(name)  # type: ignore[union-attr]
        else:
            raise ValueError(f"{where}: unknown docs-test option {option!r} (continue, skip: <why>, requires <what>)")
    return options


def collect_programs(path: str) -> list[list[Block]]:
    """The file's ```python blocks, grouped into programs (a block and the blocks that continue it)."""
    lines = (ROOT / path).read_text(encoding="utf-8").splitlines()
    programs: list[list[Block]] = []
    pending: tuple[dict[str, object], int] | None = None  # a marker waiting for its block
    i = 0
    while i < len(lines):
        line = lines[i]
        marker = MARKER.match(line)
        fence = FENCE.match(line)
        if marker:
            pending = (_parse_options(marker.group("options"), f"{path}:{i + 1}"), i + 1)
            i += 1
            continue
        if not fence:
            if line.strip() and pending is not None:
                raise ValueError(f"{path}:{pending[1]}: a docs-test marker must come right before a code block")
            i += 1
            continue
        indent, ticks = len(fence.group("indent")), fence.group("fence")
        language = (fence.group("info").split() or [""])[0]
        start = i + 1
        i += 1
        while i < len(lines) and not re.match(rf"^[ ]*{re.escape(ticks)}[`~]*\s*$", lines[i]):
            i += 1
        code = [ln[indent:] if ln[:indent].strip() == "" else ln for ln in lines[start:i]]
        i += 1
        options, pending = (pending[0] if pending else {"continue": False, "skip": None, "requires": []}), None
        if language != "python":
            if options["continue"] or options["requires"] or options["skip"]:
                raise ValueError(f"{path}:{start}: a docs-test marker on a {language or 'plain'} block")
            continue
        if options["skip"]:
            continue
        requires = list(options["requires"])  # type: ignore[call-overload]
        if "fashion_mnist" in "\n".join(code) and "fashion-mnist" not in requires:
            requires.append("fashion-mnist")  # every example on Fashion-MNIST needs its files
        block = Block(path, start + 1, code, requires)
        if options["continue"]:
            if not programs:
                raise ValueError(f"{path}:{start}: 'docs-test: continue' on the file's first Python block")
            programs[-1].append(block)
        else:
            programs.append([block])
    return programs


def _program_id(program: list[Block]) -> str:
    return f"{program[0].path}:{program[0].first_line}"


PROGRAMS = [program for path in DOCUMENTS for program in collect_programs(path)]


def test_the_documents_have_examples_to_run() -> None:
    """The collection itself: a renamed file or a broken fence must not make the test below vacuous."""
    by_file = {path: sum(len(p) for p in PROGRAMS if p[0].path == path) for path in DOCUMENTS}
    assert by_file["README.md"] >= 1 and by_file["docs/index.md"] >= 2 and by_file["docs/plugins.md"] >= 6, by_file


@pytest.mark.parametrize("program", PROGRAMS, ids=_program_id)
def test_documentation_example_runs(
    program: list[Block], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for block in program:
        for requirement in block.requires:
            reason = _requirement_missing(requirement)
            if reason is not None:
                pytest.skip(f"{block.path}:{block.first_line} needs {requirement}: {reason}")
    path = program[0].path
    source: list[str] = []
    for block in program:  # every code line at its line number in the markdown file
        source += [""] * (block.first_line - 1 - len(source))
        source += block.code
    monkeypatch.chdir(tmp_path)  # lightning_logs/, checkpoints and plots land in a temporary folder
    monkeypatch.setenv("MPLBACKEND", "Agg")
    if path in MAX_ROUNDS:
        cap = MAX_ROUNDS[path]

        class CappedTrainer(lightning.Trainer):
            def __init__(self, *args: object, max_steps: int = -1, **kwargs: object) -> None:
                super().__init__(*args, max_steps=cap if max_steps < 0 else min(max_steps, cap), **kwargs)

        monkeypatch.setattr(lightning, "Trainer", CappedTrainer)
    namespace: dict[str, object] = {"__name__": "__docs_example__"}
    exec(compile(PRELUDE.get(path, ""), f"<prelude of {path}>", "exec"), namespace)
    exec(compile("\n".join(source) + "\n", str(ROOT / path), "exec"), namespace)
