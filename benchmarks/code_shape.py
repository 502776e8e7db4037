"""The package's shape: function lengths (body lines, signature and docstring excluded) and the longest ones.

Usage: ``python -m benchmarks.code_shape [lightning_fedmeta] [--limit 50]``: prints every function longer than the
limit, then the count, the median and the maximum. Issue 24 measured ``FederatedModule.__init__`` at 127 body
lines this way (median 5); after the round engine the longest function is 48.
"""

from __future__ import annotations

import argparse
import ast
import statistics
from pathlib import Path


def body_lines(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Lines from the first statement after the docstring to the end of the function."""
    body = node.body
    first = body[0]
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        body = body[1:]
    return node.end_lineno - body[0].lineno + 1 if body and node.end_lineno is not None else 0


def function_lengths(root: Path) -> list[tuple[int, str]]:
    """``(body lines, "path:line name")`` for every function and method under ``root``."""
    rows = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                rows.append((body_lines(node), f"{path}:{node.lineno} {node.name}"))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("root", nargs="?", default="lightning_fedmeta", type=Path)
    parser.add_argument("--limit", type=int, default=50)
    args = parser.parse_args(argv)
    rows = function_lengths(args.root)
    for n, where in sorted(rows, reverse=True):
        if n > args.limit:
            print(n, where)
    lengths = [n for n, _ in rows]
    print(f"{sum(n > args.limit for n in lengths)} functions over {args.limit} body lines; {len(lengths)} functions, "
          f"median {statistics.median(lengths)}, max {max(lengths)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
