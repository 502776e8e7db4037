"""Reading federated text records: one JSONL file per client, or one table with a column naming the client.

**Records.** Each record (a JSON object, a CSV row, a ``datasets`` row) is either

* plain text: ``{"text": "..."}``, or
* an instruction: ``{"instruction": "...", "input": "...", "output": "..."}`` (``input`` optional or empty),
  rendered with a prompt template followed by the output (:func:`record_text`). The default template is
  Alpaca's (Taori et al., 2023, https://github.com/tatsu-lab/stanford_alpaca): :data:`ALPACA_PROMPT` with an input,
  :data:`ALPACA_PROMPT_NO_INPUT` without one.

Other fields are ignored. A record with neither form, a field that is not a string, a line that is not JSON or
not an object, and a line that is not UTF-8 raise a ``ValueError`` naming the file and its line (1-based).

**Layouts.** ``folder/*.jsonl``: one client per file, the client's name is the file stem, clients in sorted name
order; other files and subfolders are ignored. A symbolic link whose target lies outside the folder is refused
(``ValueError`` naming it) unless ``follow_symlinks=True``; links inside the folder are read.
A table: a ``.jsonl`` or ``.csv`` file, or a Hugging Face ``datasets.Dataset`` (any object with ``column_names``
whose iteration yields dict rows), whose ``client_column`` names each record's client (clients in sorted name
order). Files are read line by line (streamed), never whole.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

__all__ = ["ALPACA_PROMPT", "ALPACA_PROMPT_NO_INPUT", "client_files", "folder_records", "record_text",
           "table_records"]

#: Alpaca's prompt for an instruction with an input; the output follows it directly.
ALPACA_PROMPT = (
    "Below is an instruction that describes a task, paired with an input that provides further context. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
)
#: Alpaca's prompt for an instruction without an input.
ALPACA_PROMPT_NO_INPUT = (
    "Below is an instruction that describes a task. Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Response:\n"
)


def record_text(record: Mapping[str, Any], where: str, template: str | None = None) -> str:
    """The text of one record: its ``text``, or ``prompt + output`` for an instruction record.

    ``template`` (``None``: Alpaca's pair) is a format string with ``{instruction}`` and ``{input}`` (the empty
    string when the record has none). ``where`` names the record in error messages."""
    if not isinstance(record, Mapping):
        raise ValueError(f"{where}: a record must be a JSON object, got {type(record).__name__}")
    if "text" in record and "instruction" not in record:
        return _string(record, "text", where)
    if "instruction" in record and "output" in record:
        instruction, output = _string(record, "instruction", where), _string(record, "output", where)
        given = record.get("input")
        inp = "" if given is None else _string(record, "input", where)
        if template is None:
            prompt = (ALPACA_PROMPT if inp else ALPACA_PROMPT_NO_INPUT).format(instruction=instruction, input=inp)
        else:
            prompt = template.format(instruction=instruction, input=inp)
        return prompt + output
    raise ValueError(f"{where}: a record needs a 'text' field, or 'instruction' and 'output' (optional 'input'); "
                     f"it has {sorted(record)[:8]}")


def _string(record: Mapping[str, Any], key: str, where: str) -> str:
    value = record[key]
    if not isinstance(value, str):
        raise ValueError(f"{where}: field {key!r} must be a string, got {type(value).__name__}")
    return value


def _jsonl_objects(path: Path) -> Iterator[tuple[int, Any]]:
    """``(line number, parsed value)`` of every non-blank line of a JSONL file, read one line at a time."""
    with path.open("rb") as f:
        for number, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{path}:{number}: not UTF-8 ({e.reason} at byte {e.start})") from None
            if not line.strip():
                continue
            try:
                yield number, json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{number}: not valid JSON ({e.msg} at column {e.colno})") from None


def client_files(root: str | Path, follow_symlinks: bool = False) -> list[Path]:
    """The ``*.jsonl`` files of ``root`` (not its subfolders), sorted by name.

    Raises:
        ValueError: ``root`` is not a folder, holds no ``*.jsonl`` file, or (``follow_symlinks=False``) holds a
            link whose target is outside it."""
    folder = Path(root)
    if not folder.is_dir():
        raise ValueError(f"text clients: {str(folder)!r} is not a folder (expected one <client>.jsonl per client)")
    inside = folder.resolve()
    files = []
    for path in sorted(folder.iterdir(), key=lambda p: p.name):
        if path.suffix != ".jsonl" or not path.is_file():
            continue
        if path.is_symlink() and not follow_symlinks and not path.resolve().is_relative_to(inside):
            raise ValueError(f"text clients: {str(path)!r} is a link to {str(path.resolve())!r}, outside "
                             f"{str(folder)!r}; copy the file in, or pass follow_symlinks=True to read it")
        files.append(path)
    if not files:
        raise ValueError(f"text clients: no *.jsonl file in {str(folder)!r} (expected one <client>.jsonl per client)")
    return files


def folder_records(files: list[Path], template: str | None = None) -> Iterator[tuple[str, str]]:
    """``(client name, text)`` of every record of every file (the client is the file stem), streamed."""
    for path in files:
        for number, obj in _jsonl_objects(path):
            yield path.stem, record_text(obj, f"{path}:{number}", template)


def table_records(table: Any, client_column: str, template: str | None = None) -> Iterator[tuple[str, str]]:
    """``(client name, text)`` of every row of a table: a ``.jsonl``/``.csv`` path, or a ``datasets.Dataset``-like
    object (``column_names`` and dict rows). The client name is ``str(row[client_column])``."""
    if isinstance(table, str | Path):
        path = Path(table)
        if not path.is_file():
            raise ValueError(f"text clients: table {str(path)!r} is not a file (.jsonl or .csv)")
        if path.suffix == ".jsonl":
            rows: Iterator[tuple[str, Any]] = ((f"{path}:{n}", obj) for n, obj in _jsonl_objects(path))
        elif path.suffix == ".csv":
            rows = _csv_rows(path)
        else:
            raise ValueError(f"text clients: table {str(path)!r} must end in .jsonl or .csv")
    elif hasattr(table, "column_names"):
        if client_column not in table.column_names:
            raise ValueError(f"text clients: the dataset has no column {client_column!r} (client_column); its "
                             f"columns: {list(table.column_names)}")
        rows = ((f"row {i}", row) for i, row in enumerate(table))
    else:
        raise ValueError(f"text clients: a table is a .jsonl/.csv path or a datasets.Dataset, got "
                         f"{type(table).__name__}")
    for where, row in rows:
        if not isinstance(row, Mapping):
            raise ValueError(f"{where}: a record must be a JSON object, got {type(row).__name__}")
        client = row.get(client_column)
        if client is None or client == "":
            raise ValueError(f"{where}: no client in column {client_column!r} (client_column)")
        yield str(client), record_text(row, where, template)


def _csv_rows(path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    """``("path:line", row)`` of a CSV file with a header, streamed; empty cells count as absent."""
    with path.open(newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        start = 2
        for row in reader:
            if None in row:
                raise ValueError(f"{path}:{start}: more cells than the header has columns")
            yield f"{path}:{start}", {k: v for k, v in row.items() if v not in (None, "")}
            start = reader.line_num + 1
