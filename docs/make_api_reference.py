"""Write the API reference (docs/api/*.md) as plain Markdown, from the docstrings and signatures.

The pages are read on GitHub, in a terminal and on the built site alike, so they hold the
reference itself rather than directives a site generator expands. Each page is prose written by
hand around blocks that this script generates and owns::

    <!-- api: lightning_fedmeta.Algorithm -->
    ... generated: the signature, the docstring and every public documented member ...
    <!-- end api -->

A block names a class, a function, a documented module-level value, or a module; a module may be
followed by the members to list (``<!-- api: lightning_fedmeta.registry: list_algorithms
load_algorithm -->``), shown then without the module's own heading. Everything between the two
markers is rewritten on every run: edit the docstring, not the page.

Usage (from the repository root)::

    python docs/make_api_reference.py          # rewrite the pages that are out of date
    python docs/make_api_reference.py --check  # exit 1 and name them, writing nothing

tests/frontends/test_api_reference.py fails when a committed page differs from what this writes.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import inspect
import re
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ForwardRef

REPO = Path(__file__).resolve().parent.parent
API_DIR = REPO / "docs" / "api"
REGENERATE = "python docs/make_api_reference.py"
BLOCK = re.compile(r"(?P<start><!-- api: (?P<spec>[^>]*?) -->\n)(?P<body>.*?)(?P<end><!-- end api -->)", re.S)
ROLE = re.compile(r":(?:class|meth|func|attr|mod|data|obj|exc|const):`(?P<tilde>~?)(?P<target>[\w.]+)`")
SECTION = re.compile(r"^(?P<name>Args|Arguments|Attributes|Raises|Returns|Yields|Example|Examples|Note|Notes):\s*$")
LISTED_SECTIONS = {"Args", "Arguments", "Attributes", "Raises"}
MAX_SIGNATURE = 88


@dataclass
class Entry:
    """One object rendered on a page: where its anchor is, and the names it answers to."""

    page: str
    anchor: str


@dataclass
class Reference:
    """Every documented object's page and anchor, filled while the pages are rendered."""

    entries: dict[int, Entry] = field(default_factory=dict)
    by_path: dict[str, Entry] = field(default_factory=dict)

    def add(self, obj: Any, path: str, page: str, anchor: str) -> None:
        """Record ``obj`` (also known as ``path``) as rendered at ``page#anchor``."""
        entry = Entry(page, anchor)
        if inspect.isclass(obj) or inspect.isroutine(obj) or inspect.ismodule(obj) or isinstance(obj, property):
            self.entries.setdefault(id(obj), entry)  # a value (a string, a number) is found by its path only
        self.by_path.setdefault(path, entry)


def slug(heading: str) -> str:
    """The anchor GitHub and Python-Markdown's ``toc`` both derive from a heading's text."""
    text = re.sub(r"[^\w\s-]", "", heading.replace("`", "")).strip().lower()
    return re.sub(r"[\s]+", "-", text)


def _annotation(annotation: Any) -> str:
    """An annotation as the source spells it (the package uses ``from __future__ import annotations``)."""
    if isinstance(annotation, str):
        return annotation
    if isinstance(annotation, ForwardRef):
        return annotation.__forward_arg__
    return inspect.formatannotation(annotation)


def _default(value: Any) -> str:
    """A default value's repr, without the memory addresses that would change on every run."""
    text = repr(value)
    if " at 0x" in text:
        name = getattr(value, "__qualname__", type(value).__qualname__)
        return f"<{name}>"
    return text


def _parameter(parameter: inspect.Parameter) -> str:
    text = parameter.name
    if parameter.kind is inspect.Parameter.VAR_POSITIONAL:
        text = "*" + text
    elif parameter.kind is inspect.Parameter.VAR_KEYWORD:
        text = "**" + text
    if parameter.annotation is not inspect.Parameter.empty:
        text += ": " + _annotation(parameter.annotation)
    if parameter.default is not inspect.Parameter.empty:
        text += (" = " if parameter.annotation is not inspect.Parameter.empty else "=") + _default(parameter.default)
    return text


def format_signature(name: str, signature: inspect.Signature, prefix: str = "") -> str:
    """``prefix name(params) -> ret``, one parameter a line when it would not fit on one."""
    parts: list[str] = []
    kinds = [p.kind for p in signature.parameters.values()]
    for i, parameter in enumerate(signature.parameters.values()):
        if parameter.kind is inspect.Parameter.KEYWORD_ONLY and inspect.Parameter.VAR_POSITIONAL not in kinds[:i] \
                and inspect.Parameter.KEYWORD_ONLY not in kinds[:i]:
            parts.append("*")
        parts.append(_parameter(parameter))
        if parameter.kind is inspect.Parameter.POSITIONAL_ONLY and (
                i + 1 == len(kinds) or kinds[i + 1] is not inspect.Parameter.POSITIONAL_ONLY):
            parts.append("/")
    returns = ""
    if signature.return_annotation is not inspect.Signature.empty:
        returns = " -> " + _annotation(signature.return_annotation)
    one_line = f"{prefix}{name}({', '.join(parts)}){returns}"
    if len(one_line) <= MAX_SIGNATURE or not parts:
        return one_line
    body = "".join(f"    {part},\n" for part in parts)
    return f"{prefix}{name}(\n{body}){returns}"


def _signature(obj: Any, drop_first: bool) -> inspect.Signature | None:
    try:
        signature = inspect.signature(obj)
    except (TypeError, ValueError):
        return None
    if drop_first and signature.parameters:
        first = next(iter(signature.parameters))
        if first in ("self", "cls"):
            signature = signature.replace(parameters=list(signature.parameters.values())[1:])
    return signature


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip(" "))


def _take_indented(lines: list[str], start: int, deeper_than: int) -> tuple[list[str], int]:
    """The lines from ``start`` that are blank or indented past ``deeper_than``, and where they end."""
    end = start
    while end < len(lines) and (not lines[end].strip() or _indent(lines[end]) > deeper_than):
        end += 1
    while end > start and not lines[end - 1].strip():
        end -= 1
    return lines[start:end], end


def _literal_blocks(lines: list[str]) -> list[str]:
    """reStructuredText literal blocks (a paragraph ending ``::``, then indented lines) as fenced code."""
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.rstrip().endswith("::") and not line.strip().startswith("```"):
            block, end = _take_indented(lines, i + 1, _indent(line))
            if any(b.strip() for b in block):
                out += [line.rstrip()[:-1], "", "```python", *textwrap.dedent("\n".join(block)).strip("\n").split("\n"),
                        "```"]
                i = end
                continue
        out.append(line)
        i += 1
    return out


ENTRY = re.compile(r"^(?P<name>[\w*.]+(?:\[[^\]]*\])?(?:, [\w*.]+)*)(?: \((?P<type>[^)]*)\))?:(?:\s+(?P<desc>.*))?$")


def _listed_section(name: str, body: list[str]) -> list[str]:
    """An ``Args:``-like section as a bullet list: ``* `name` (type): description``."""
    out = [f"**{name}:**", ""]
    for line in body:
        if not line.strip():
            continue
        m = ENTRY.match(line) if _indent(line) == 0 else None
        if m:
            kind = f" ({m.group('type')})" if m.group("type") else ""
            out.append(f"* `{m.group('name')}`{kind}: {m.group('desc') or ''}".rstrip())
        elif _indent(line) == 0:
            out.append(f"* {line}")
        else:
            out.append("    " + line.strip())
    return out + [""]


def _sections(lines: list[str]) -> list[str]:
    """Google-style sections (``Args:``, ``Returns:``, ...) as Markdown that reads the same everywhere."""
    out: list[str] = []
    i = 0
    while i < len(lines):
        m = SECTION.match(lines[i])
        if not m:
            out.append(lines[i])
            i += 1
            continue
        body, i = _take_indented(lines, i + 1, 0)
        body = textwrap.dedent("\n".join(body)).split("\n")
        if m.group("name") in LISTED_SECTIONS:
            out += _listed_section(m.group("name"), body)
        else:
            out += [f"**{m.group('name')}:**", "", *body, ""]
    return out


def markdown_docstring(doc: str | None, link: Any) -> str:
    """A docstring as Markdown: sections, literal blocks, and Sphinx roles as links (``link(target)``)."""
    if not doc:
        return ""
    lines = _literal_blocks(_sections(inspect.cleandoc(doc).split("\n")))
    out, fenced = [], False
    for line in lines:
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced:
            line = ROLE.sub(lambda m: link(m.group("target"), bool(m.group("tilde"))), line)
        out.append(line.rstrip())
    return re.sub(r"\n{3,}", "\n\n", "\n".join(out)).strip() + "\n"


def attribute_docs(source_module: Any, class_name: str | None = None) -> dict[str, tuple[str, str]]:
    """Module- or class-level assignments: name -> (the assignment's code, its docstring or ``#:`` comment or "")."""
    try:
        tree = ast.parse(inspect.getsource(source_module))
    except (OSError, TypeError):
        return {}
    source = inspect.getsource(source_module)
    body = tree.body
    if class_name is not None:
        body = next((n.body for n in tree.body if isinstance(n, ast.ClassDef) and n.name == class_name), [])
    docs: dict[str, tuple[str, str]] = {}
    lines = source.split("\n")
    for node, after in zip(body, [*body[1:], None], strict=True):
        doc = _comment_doc(lines, node.lineno - 2)
        if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str):
            doc = after.value.value
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) \
            else []
        for target in targets:
            if isinstance(target, ast.Name):
                docs[target.id] = (ast.get_source_segment(source, node) or target.id, doc)
    return docs


def _comment_doc(lines: list[str], last: int) -> str:
    """The ``#:`` comment lines that end at line index ``last`` (Sphinx's doc comments), as one text."""
    first = last
    while first >= 0 and lines[first].strip().startswith("#:"):
        first -= 1
    return "\n".join(line.strip()[2:].strip() for line in lines[first + 1:last + 1])


def _defining_module(module: Any, name: str) -> Any:
    """The module whose source assigns ``name``, following ``from x import name`` re-exports."""
    if name in attribute_docs(module):
        return module
    for node in ast.parse(inspect.getsource(module)).body:
        if isinstance(node, ast.ImportFrom) and node.module and any(a.name == name for a in node.names):
            return _defining_module(importlib.import_module(node.module), name)
    return module


def locate(path: str) -> tuple[Any, Any]:
    """The object a dotted path names, and the module to resolve its docstring's references in."""
    try:
        module = importlib.import_module(path)
        return module, module
    except ModuleNotFoundError:
        pass
    parent, _, name = path.rpartition(".")
    obj = getattr(importlib.import_module(parent), name)
    if inspect.isclass(obj) or inspect.isroutine(obj):
        return obj, sys.modules[obj.__module__]
    return obj, _defining_module(importlib.import_module(parent), name)


def _heading(level: int, text: str) -> str:
    return f"{'#' * level} `{text}`"


def _code(text: str) -> str:
    return f"```python\n{text}\n```\n"


class Renderer:
    """Renders the blocks of one page; records each object's anchor so that references become links."""

    def __init__(self, reference: Reference, page: str) -> None:
        self.reference = reference
        self.page = page
        self.used: set[str] = set()

    def _record(self, obj: Any, path: str, level: int, name: str) -> str:
        """The heading of ``obj`` (its full path when ``name`` is taken on this page), its anchor recorded."""
        if name in self.used:
            name = path
        self.used.add(name)
        heading = _heading(level, name)
        self.reference.add(obj, path, self.page, slug(heading))
        return heading

    def link(self, target: str, tilde: bool, scope: Any, owner: Any = None) -> str:
        """A Sphinx role's target as a link to its entry, resolved in ``owner``'s then ``scope``'s names."""
        shown = target.rsplit(".", 1)[-1] if tilde else target
        entry = self._resolve(target, scope, owner)
        if entry is None:
            return f"`{shown}`"
        href = f"#{entry.anchor}" if entry.page == self.page else f"{entry.page}#{entry.anchor}"
        return f"[`{shown}`]({href})"

    def _resolve(self, target: str, scope: Any, owner: Any) -> Entry | None:
        if target in self.reference.by_path:
            return self.reference.by_path[target]
        first, *rest = target.split(".")
        if owner is not None and first in vars(owner):
            obj, path = vars(owner)[first], f"{owner.__module__}.{owner.__qualname__}.{first}"
        elif first in vars(scope):
            obj, path = vars(scope)[first], f"{scope.__name__}.{first}"
        else:
            try:
                obj, path = importlib.import_module(first), first
            except ImportError:
                return None
        for name in rest:
            obj, path = inspect.getattr_static(obj, name, None), f"{path}.{name}"
            if obj is None:
                return None
        entry = self.reference.by_path.get(path) or self.reference.entries.get(id(obj))
        if entry is None and hasattr(obj, "__func__"):
            entry = self.reference.entries.get(id(obj.__func__))
        return entry

    def doc(self, doc: str | None, scope: Any, owner: Any = None) -> str:
        return markdown_docstring(doc, lambda target, tilde: self.link(target, tilde, scope, owner))

    def function(self, fn: Any, name: str, level: int, scope: Any, owner: Any = None) -> str:
        """A function or method: heading, signature, docstring."""
        raw = fn
        prefix = ""
        if isinstance(fn, classmethod | staticmethod):
            prefix, fn = f"{type(fn).__name__} ", fn.__func__
        signature = _signature(fn, drop_first=owner is not None and not isinstance(raw, staticmethod))
        heading = self._record(raw, f"{fn.__module__}.{fn.__qualname__}", level, name)
        shown = format_signature(fn.__name__, signature, prefix) if signature else prefix + fn.__name__
        return f"{heading}\n\n{_code(shown)}\n{self.doc(fn.__doc__, scope, owner)}"

    def prop(self, value: property, name: str, level: int, scope: Any, owner: Any) -> str:
        """A property: its type (the getter's return annotation) and the getter's docstring."""
        heading = self._record(value, f"{owner.__module__}.{owner.__qualname__}.{name.rsplit('.', 1)[-1]}", level, name)
        returns = inspect.signature(value.fget).return_annotation if value.fget else inspect.Signature.empty
        kind = "" if returns is inspect.Signature.empty else f": {_annotation(returns)}"
        shown = f"property {name.rsplit('.', 1)[-1]}{kind}"
        return f"{heading}\n\n{_code(shown)}\n{self.doc(value.__doc__, scope, owner)}"

    def data(self, value: Any, name: str, code: str, doc: str, level: int, scope: Any, path: str) -> str:
        """A documented module- or class-level value: the assignment as written, then its docstring."""
        heading = self._record(value, path, level, name)
        return f"{heading}\n\n{_code(code)}\n{self.doc(doc, scope)}"

    def klass(self, cls: type, name: str, level: int) -> str:
        """A class: heading, constructor signature, bases, docstring, then its own documented members."""
        scope = sys.modules[cls.__module__]
        heading = self._record(cls, f"{cls.__module__}.{cls.__qualname__}", level, name)
        signature = None if getattr(cls, "_is_protocol", False) else _signature(cls, drop_first=False)
        if signature is not None:
            signature = signature.replace(return_annotation=inspect.Signature.empty)
        shown = format_signature(cls.__name__, signature, "class ") if signature else f"class {cls.__name__}"
        bases = [b for b in cls.__bases__ if b.__name__ not in ("object", "Generic")]
        parts = [heading, "", _code(shown)]
        if bases:
            names = ", ".join(self.link(f"{b.__module__}.{b.__qualname__}", True, scope) for b in bases)
            parts += [f"Bases: {names}", ""]
        parts.append(self.doc(cls.__doc__, scope, cls))
        parts += self.members(cls, level + 1)
        return "\n".join(parts)

    def members(self, cls: type, level: int) -> list[str]:
        """The public members ``cls`` itself defines and documents, in source order."""
        scope = sys.modules[cls.__module__]
        documented = attribute_docs(scope, cls.__name__)
        out = []
        for key, value in vars(cls).items():
            name = f"{cls.__name__}.{key}"
            if key.startswith("_"):
                continue
            if isinstance(value, property) and value.__doc__:
                out.append(self.prop(value, name, level, scope, cls))
            elif isinstance(value, classmethod | staticmethod) or inspect.isfunction(value):
                func = value.__func__ if isinstance(value, classmethod | staticmethod) else value
                if func.__doc__:
                    out.append(self.function(value, name, level, scope, cls))
            elif documented.get(key, ("", ""))[1]:
                code, doc = documented[key]
                path = f"{cls.__module__}.{cls.__qualname__}.{key}"
                out.append(self.data(value, name, code, doc, level, scope, path))
        return out

    def module(self, module: Any, members: list[str], level: int) -> str:
        """A module: its docstring and members (``members``, else ``__all__``, else what it defines)."""
        parts = []
        if not members:
            heading = self._record(module, module.__name__, level, module.__name__)
            parts += [heading, ""]
            level += 1
        parts.append(self.doc(module.__doc__, module))
        for name in members or _public_names(module):
            parts.append(self.entry(f"{module.__name__}.{name}", level, name))
        return "\n".join(parts)

    def entry(self, path: str, level: int, name: str | None = None) -> str:
        """Whatever ``path`` names, rendered at heading ``level``."""
        obj, scope = locate(path)
        name = name or path.rsplit(".", 1)[-1]
        if inspect.ismodule(obj):
            return self.module(obj, [], level)
        if inspect.isclass(obj):
            return self.klass(obj, name, level)
        if inspect.isroutine(obj):
            return self.function(obj, name, level, scope)
        documented = attribute_docs(scope)
        short = path.rsplit(".", 1)[-1]
        if short not in documented:
            raise LookupError(f"{path} is neither a module, a class, a function nor a value assigned in "
                              f"{scope.__name__}: name what the package defines, or fix the <!-- api: --> block")
        code, doc = documented[short]
        return self.data(obj, name, code, doc, level, scope, f"{scope.__name__}.{short}")


def _public_names(module: Any) -> list[str]:
    """``__all__``, else the public classes, functions and documented values the module defines, in order."""
    if hasattr(module, "__all__"):
        return [n for n in module.__all__ if not n.startswith("_")]
    documented = attribute_docs(module)
    names = []
    for node in ast.parse(inspect.getsource(module)).body:
        if isinstance(node, ast.ClassDef | ast.FunctionDef) and not node.name.startswith("_"):
            obj = getattr(module, node.name, None)
            if obj is not None and obj.__doc__:
                names.append(node.name)
        for target in getattr(node, "targets", [getattr(node, "target", None)]):
            name = target.id if isinstance(target, ast.Name) else "_"
            if not name.startswith("_") and documented.get(name, ("", ""))[1]:
                names.append(name)
    return names


def render_block(spec: str, renderer: Renderer) -> str:
    """One ``<!-- api: path[: member member ...] -->`` block's generated Markdown."""
    path, _, members = spec.partition(":")
    if members.split():
        obj, _ = locate(path.strip())
        return renderer.module(obj, members.split(), 2)
    return renderer.entry(path.strip(), 2)


def render_page(text: str, page: str, reference: Reference) -> str:
    """The page with every generated block rewritten."""
    renderer = Renderer(reference, page)

    def block(m: re.Match[str]) -> str:
        return f"{m.group('start')}\n{render_block(m.group('spec'), renderer).strip()}\n\n{m.group('end')}"

    return BLOCK.sub(block, text)


def render_all(api_dir: Path = API_DIR) -> dict[Path, str]:
    """Every page of ``api_dir`` as this script would write it (two passes: the second links every reference)."""
    pages = sorted(api_dir.glob("*.md"))
    reference = Reference()
    for path in pages:
        render_page(path.read_text(encoding="utf-8"), path.name, reference)
    return {path: render_page(path.read_text(encoding="utf-8"), path.name, reference) for path in pages}


def stale_pages(api_dir: Path = API_DIR) -> list[Path]:
    """The pages whose committed text differs from what the docstrings give now."""
    return [path for path, text in render_all(api_dir).items() if path.read_text(encoding="utf-8") != text]


def main(argv: list[str] | None = None) -> int:
    """Rewrite the stale pages (or, with ``--check``, name them and exit 1)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if a page is out of date")
    args = parser.parse_args(argv)
    rendered = render_all()
    stale = [path for path, text in rendered.items() if path.read_text(encoding="utf-8") != text]
    for path in stale:
        rel = path.relative_to(REPO)
        if args.check:
            print(f"{rel} is out of date with the docstrings: run {REGENERATE}")
        else:
            path.write_text(rendered[path], encoding="utf-8")
            print(f"wrote {rel}")
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    sys.exit(main())
