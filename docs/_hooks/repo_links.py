"""mkdocs hook: the user guide's links to repository files outside docs/, made valid on the site.

The pages are read on GitHub as well as on the built site, so they link to ``../configs/x.yaml``,
``../../benchmarks/...`` and to folders (``algorithms/``). On the site those targets do not exist
and ``mkdocs build --strict`` would fail on them. Before the page is rendered this hook rewrites:

* a link to a folder of docs/ that holds an ``index.md`` into a link to that page;
* a link to a file or folder of the repository outside docs/ into its repository path as inline
  code (the link text when it already is that path). The target must exist: a link to a missing
  file is left as it is, so mkdocs still reports it and the strict build fails.
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path

LINK = re.compile(r"(?<!!)\[(?P<text>[^\]]+)\]\((?P<target>[^)\s:#]+)(?P<anchor>#[^)\s]*)?\)")
FENCE = re.compile(r"^(\s*)(```|~~~)")


def _rewrite(match: re.Match[str], page_dir: Path, docs_dir: Path, repo: Path) -> str:
    target = match.group("target")
    resolved = (page_dir / target).resolve()
    text = match.group("text")
    if resolved.is_relative_to(docs_dir):
        if resolved.is_dir() and (resolved / "index.md").is_file():
            return f"[{text}]({posixpath.join(target, 'index.md')}{match.group('anchor') or ''})"
        return match.group(0)
    if not resolved.is_relative_to(repo) or not resolved.exists():
        return match.group(0)  # mkdocs reports it
    path = resolved.relative_to(repo).as_posix() + ("/" if resolved.is_dir() else "")
    if text.strip("`").rstrip("/") in (path.rstrip("/"), posixpath.basename(path.rstrip("/"))):
        return f"`{path}`"
    return f"{text} (`{path}`)"


def on_page_markdown(markdown: str, page, config, files) -> str:  # noqa: ANN001 (mkdocs' hook signature)
    docs_dir = Path(config["docs_dir"]).resolve()
    repo = Path(config["config_file_path"]).resolve().parent
    page_dir = (docs_dir / page.file.src_path).parent
    out, fence = [], None
    for line in markdown.splitlines(keepends=True):
        m = FENCE.match(line)
        if m and (fence is None or m.group(2) == fence):
            fence = m.group(2) if fence is None else None
        elif fence is None:
            line = LINK.sub(lambda mm: _rewrite(mm, page_dir, docs_dir, repo), line)
        out.append(line)
    return "".join(out)
