"""docs/design.md's "Where things live" names every module of the package, so the map stays true."""

from __future__ import annotations

import re
from pathlib import Path

import lightning_fedmeta

ROOT = Path(lightning_fedmeta.__file__).parent
DESIGN = ROOT.parent / "docs" / "design.md"


def _where_things_live() -> str:
    text = DESIGN.read_text()
    start = text.index("## Where things live")
    return text[start:text.index("\n## ", start + 1)]


def test_every_package_module_appears_in_the_design_map() -> None:
    section = _where_things_live()
    names = set(re.findall(r"[\w/]+\.py|[\w]+/", section))
    missing = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT)
        if rel.name == "__init__.py":
            folder = f"{rel.parent.name}/"
            if rel.parent != Path(".") and folder not in names:
                missing.append(str(rel.parent) + "/")
            continue
        if rel.name not in names and str(rel) not in names:
            missing.append(str(rel))
    assert not missing, f"docs/design.md 'Where things live' does not name: {missing}"


def test_the_design_map_names_no_module_that_does_not_exist() -> None:
    section = _where_things_live().split("\nplugins/")[0]  # the package's block
    files = {p.name for p in ROOT.rglob("*.py")}
    named = set(re.findall(r"\b([a-z_]+\.py)\b", section))
    assert named - files == set(), f"named in docs/design.md but not in the package: {sorted(named - files)}"
