"""A federated next-token dataset from text: tokenised client documents cut into windows.

Records come from one JSONL file per client or one table with a client column
(:mod:`~lightning_fedmeta.data.text_records`: plain ``text`` or Alpaca-style instruction records); the tokenizer is
the user's (:mod:`~lightning_fedmeta.data.tokenizers`, ``"bytes"`` by default).

For each client, in record order: ``s = encode(d_1) + [eos] + encode(d_2) + [eos] + ... + encode(d_m) + [eos]``
(an end-of-text id after every document), then windows of ``seq_len + 1`` tokens with stride ``seq_len``,
``w_j = s[j·seq_len : j·seq_len + seq_len + 1]`` for ``j = 0 .. n_w − 1``, ``n_w = (len(s) − 1) // seq_len``
(every token but the first is a target exactly once; the tail that fills no window is dropped). A sample is
``x = w[:-1]``, ``y = w[1:]`` (``[seq_len]`` int64 each). The client's windows are shuffled with a generator
seeded by ``(seed, client index)`` and ``n_test = min(n_w − 1, max(1, round(test_fraction · n_w)))`` of them
become its test set, the rest (in their original order) its training set. Consecutive windows share one token,
so a test window's first input token may be a training target.

A client with fewer than 2 windows (``len(s) < 2·seq_len + 1`` tokens) is **skipped with a warning** naming it
and its token count; when no client is left, a ``ValueError``. ``num_classes`` is the vocabulary size
(``vocab_size``, or the tokenizer's); a token id outside it raises a ``ValueError`` naming the client.

Instruction records are trained on in full (prompt and response): the library's losses and metrics average over
every target position (there is no ignore index), so the prompt tokens are not masked out of the loss.
"""

from __future__ import annotations

import zlib
from array import array
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import Tensor

from lightning_fedmeta.data.federated import FederatedData, from_client_tensors
from lightning_fedmeta.data.lazy_clients import ClientTensors, LazyClientData
from lightning_fedmeta.data.text_records import client_files, folder_records, table_records
from lightning_fedmeta.data.tokenizers import eos_id_of, resolve_tokenizer

__all__ = ["TextClients", "split_windows", "text_jsonl", "token_windows"]


def token_windows(tokens: Tensor, seq_len: int) -> tuple[Tensor, Tensor]:
    """``(x, y)``, each ``[n_w, seq_len]`` int64: the stride-``seq_len`` windows of ``seq_len + 1`` tokens of the 1-D
    ``tokens`` (``n_w = (len − 1) // seq_len``, possibly 0), ``x = w[:-1]``, ``y = w[1:]``."""
    n = max((tokens.numel() - 1) // seq_len, 0)
    if n == 0:
        empty = torch.zeros(0, seq_len, dtype=torch.long)
        return empty, empty.clone()
    w = tokens[: n * seq_len + 1].unfold(0, seq_len + 1, seq_len)
    return w[:, :-1].contiguous(), w[:, 1:].contiguous()


def split_windows(x: Tensor, y: Tensor, test_fraction: float, seed: int, client: int) -> ClientTensors:
    """One client's ``(train_x, train_y, test_x, test_y)``: ``n_test = min(n − 1, max(1, round(f · n)))`` windows
    drawn with a generator seeded by ``(seed, client)``, the rest kept in order for training (``n >= 2``)."""
    n = x.shape[0]
    n_test = min(n - 1, max(1, round(test_fraction * n)))
    g = torch.Generator().manual_seed(zlib.crc32(f"text_clients/{seed}/{client}".encode()))
    test = torch.randperm(n, generator=g)[:n_test].sort().values
    keep = torch.ones(n, dtype=torch.bool)
    keep[test] = False
    return x[keep], y[keep], x[test], y[test]


class TextClients(LazyClientData):
    """Federated next-token data from text files (read on first use): ``task="next_token"``, ``x``/``y``
    ``[n, seq_len]`` int64, ``num_classes`` the vocabulary size, one client per JSONL file or per value of the
    table's ``client_column`` (module docstring: the windows, the split and the skipped clients).

    Args:
        root: a folder of ``<client>.jsonl`` files (or ``None`` with ``table``).
        table: a ``.jsonl``/``.csv`` file or a ``datasets.Dataset`` with a ``client_column`` (or ``None``).
        seq_len: tokens per input window, ``>= 1`` (a model's ``max_len`` must be at least this).
        tokenizer: ``"bytes"`` (:class:`~lightning_fedmeta.data.tokenizers.ByteTokenizer`), a
            ``{class_path, init_args}`` mapping, or an object with ``encode(str) -> list[int]`` and ``vocab_size``.
        vocab_size: the number of token ids (``num_classes``); ``None`` takes the tokenizer's ``vocab_size``. For a
            Hugging Face tokenizer pass ``len(tokenizer)``, which counts its added tokens.
        eos_id: the id put after every document; ``None`` takes the tokenizer's ``eos_id``/``eos_token_id``.
        test_fraction: each client's share of windows held out for testing, in ``(0, 1)``.
        seed: seed of the per-client split.
        client_column: the column of ``table`` that names the client.
        template: the instruction prompt, a format string with ``{instruction}`` and ``{input}``; ``None``: Alpaca's.
        max_clients: keep the first ``max_clients`` clients by name; ``None`` keeps all.
        follow_symlinks: read ``*.jsonl`` links of ``root`` that point outside it (refused otherwise).
    """

    task = "next_token"

    def __init__(
        self,
        root: str | None = None,
        table: Any = None,
        seq_len: int = 64,
        tokenizer: Any = "bytes",
        vocab_size: int | None = None,
        eos_id: int | None = None,
        test_fraction: float = 0.2,
        seed: int = 0,
        client_column: str = "client",
        template: str | None = None,
        max_clients: int | None = None,
        follow_symlinks: bool = False,
    ) -> None:
        if (root is None) == (table is None):
            raise ValueError("text clients: give exactly one of root (a folder of <client>.jsonl files) and table")
        for name, value, low in (("seq_len", seq_len, 1), ("max_clients", max_clients, 1)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < low):
                raise ValueError(f"text clients: {name} must be an integer >= {low}, got {value!r}")
        if not isinstance(test_fraction, int | float) or not 0 < test_fraction < 1:
            raise ValueError(f"text clients: test_fraction must be in (0, 1), got {test_fraction!r}")
        if template is not None and ("{instruction}" not in template):
            raise ValueError(f"text clients: template must contain {{instruction}}, got {template!r}")
        self.tokenizer = resolve_tokenizer(tokenizer)
        size = self.tokenizer.vocab_size if vocab_size is None else vocab_size
        if isinstance(size, bool) or not isinstance(size, int) or size < 2:
            raise ValueError(f"text clients: vocab_size must be an integer >= 2, got {size!r}")
        eos = eos_id_of(self.tokenizer) if eos_id is None else eos_id
        if eos is None:
            raise ValueError(f"text clients: {type(self.tokenizer).__name__} has no eos_id/eos_token_id; pass eos_id, "
                             "the id put after every document")
        if isinstance(eos, bool) or not isinstance(eos, int) or not 0 <= eos < size:
            raise ValueError(f"text clients: eos_id must be an integer in [0, vocab_size={size}), got {eos!r}")
        self.root, self.table, self.seq_len = root, table, seq_len
        self.vocab_size, self.eos_id, self.test_fraction, self.seed = size, int(eos), float(test_fraction), seed
        self.client_column, self.template = client_column, template
        self.max_clients, self.follow_symlinks = max_clients, follow_symlinks
        self._files = client_files(root, follow_symlinks) if root is not None else None
        self._names: list[str] = []
        self._clients: list[ClientTensors] | None = None

    @property
    def num_classes(self) -> int:  # type: ignore[override]
        """The vocabulary size."""
        return self.vocab_size

    @property
    def client_names(self) -> list[str]:
        """The kept clients' names (file stems or ``client_column`` values), sorted."""
        self._load()
        return list(self._names)

    def _read_clients(self) -> list[ClientTensors]:
        records = (folder_records(self._files, self.template) if self._files is not None
                   else table_records(self.table, self.client_column, self.template))
        streams: dict[str, array[int]] = {}  # 8 bytes a token, not a Python int's 28 + 8
        for client, text in records:
            stream = streams.setdefault(client, array("q"))
            stream.extend(self.tokenizer.encode(text))
            stream.append(self.eos_id)
        names = sorted(streams)
        if self.max_clients is not None:
            names = names[: self.max_clients]
        clients, kept, short = [], [], []
        for name in names:
            stream = streams.pop(name)
            tokens = torch.frombuffer(stream, dtype=torch.long).clone()  # never empty: an eos per record
            bad = (tokens < 0) | (tokens >= self.vocab_size)
            if bool(bad.any()):
                raise ValueError(f"text clients: client {name!r} has token id {int(tokens[bad][0])} outside [0, "
                                 f"vocab_size={self.vocab_size}); for a Hugging Face tokenizer pass "
                                 "vocab_size=len(tokenizer)")
            x, y = token_windows(tokens, self.seq_len)
            if x.shape[0] < 2:
                short.append(f"{name} ({tokens.numel()} tokens)")
                continue
            clients.append(split_windows(x, y, self.test_fraction, self.seed, len(kept)))
            kept.append(name)
        source = self.root if self.root is not None else (self.table if isinstance(self.table, str | Path)
                                                           else type(self.table).__name__)
        if short:
            rank_zero_warn(f"text clients from {source}: skipped {len(short)} client(s) with fewer than 2 windows "
                           f"(< {2 * self.seq_len + 1} tokens with seq_len={self.seq_len}): {', '.join(short[:10])}")
        if not kept:
            raise ValueError(f"text clients from {source}: no client has the {2 * self.seq_len + 1} tokens of 2 "
                             f"windows (one train, one test) at seq_len={self.seq_len}; lower seq_len or add text")
        rank_zero_info(f"text clients from {source}: {len(kept)} clients, seq_len={self.seq_len}, "
                       f"vocab_size={self.vocab_size}, {sum(c[0].shape[0] for c in clients)} train windows")
        self._names = kept
        return clients

    def federated_data(self) -> FederatedData:
        """The clients as a :class:`~lightning_fedmeta.data.federated.FederatedData`."""
        return from_client_tensors(self.client_data(), self.num_classes, self.client_names, self.task)


def text_jsonl(num_clients: int, seed: int, root: str | None = None, seq_len: int = 64, tokenizer: Any = "bytes",
               vocab_size: int | None = None, eos_id: int | None = None, test_fraction: float = 0.2,
               client_column: str = "client", template: str | None = None,
               follow_symlinks: bool = False) -> FederatedData:
    """The ``text_jsonl`` dataset: :class:`TextClients` from ``data.root`` (a folder of ``<client>.jsonl`` files, or
    one ``.jsonl``/``.csv`` table with ``client_column``), the first ``data.num_clients`` clients by name, split
    with ``data.data_seed``; the other arguments are ``data.dataset_options``."""
    if root is None:
        raise ValueError("dataset 'text_jsonl' needs data.root: a folder of <client>.jsonl files, or a .jsonl/.csv "
                         "table with a client column")
    is_table = Path(root).is_file()
    clients = TextClients(
        root=None if is_table else root, table=root if is_table else None, seq_len=seq_len, tokenizer=tokenizer,
        vocab_size=vocab_size, eos_id=eos_id, test_fraction=test_fraction, seed=seed, client_column=client_column,
        template=template, max_clients=num_clients, follow_symlinks=follow_symlinks,
    )
    return clients.federated_data()
