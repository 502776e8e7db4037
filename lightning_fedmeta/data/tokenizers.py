"""Tokenizers for federated text: the protocol a user's tokenizer follows, a byte-level one, and building one by name.

**The protocol** (:class:`Tokenizer`): anything with ``encode(text: str) -> list[int]`` and an integer ``vocab_size``
(every id ``encode`` returns lies in ``[0, vocab_size)``). A Hugging Face tokenizer has both, but its
``vocab_size`` leaves out the tokens added after training (special tokens among them): give the true size
explicitly, ``TextClients(..., tokenizer=tok, vocab_size=len(tok))``. ``decode(ids) -> str`` is optional (only
for reading generated text back), and so is the end-of-text id: ``eos_id`` or Hugging Face's ``eos_token_id``.

**By name** (:func:`resolve_tokenizer`), for configuration files: ``"bytes"`` (:class:`ByteTokenizer`), or a
mapping ``{class_path: <dotted name>, init_args: {...}}`` naming a class or any callable that returns a tokenizer
(e.g. ``transformers.AutoTokenizer.from_pretrained`` with ``init_args: {pretrained_model_name_or_path: <folder>}``);
an object that already follows the protocol is used as it is.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

__all__ = ["ByteTokenizer", "Tokenizer", "eos_id_of", "resolve_tokenizer"]


@runtime_checkable
class Tokenizer(Protocol):
    """What a user's tokenizer provides: ``encode(str) -> list[int]`` with ids in ``[0, vocab_size)``."""

    vocab_size: int

    def encode(self, text: str) -> list[int]:
        """The token ids of ``text``."""
        ...


@dataclass(frozen=True)
class ByteTokenizer:
    """UTF-8 bytes as tokens: id ``b`` is the byte ``b`` (``0..255``), then the special ids.

    ``eos=True`` adds the end-of-text id ``eos_id = 256``; ``pad=True`` adds a padding id after it
    (``pad_id = 256 + eos``). ``vocab_size = 256 + eos + pad``. ``encode`` never returns a special id;
    ``decode`` drops them and decodes the bytes with ``errors="replace"`` (a cut multi-byte character becomes
    U+FFFD), and refuses ids outside ``[0, vocab_size)``.
    """

    eos: bool = True
    pad: bool = False

    @property
    def vocab_size(self) -> int:
        return 256 + int(self.eos) + int(self.pad)

    @property
    def eos_id(self) -> int | None:
        return 256 if self.eos else None

    @property
    def pad_id(self) -> int | None:
        return 256 + int(self.eos) if self.pad else None

    def encode(self, text: str) -> list[int]:
        """``list(text.encode("utf-8"))``."""
        if not isinstance(text, str):
            raise TypeError(f"ByteTokenizer.encode takes a str, got {type(text).__name__}")
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int] | Any) -> str:
        """The text of ``ids`` (a list, or a 1-D tensor), special ids dropped, invalid UTF-8 replaced."""
        values = ids.tolist() if hasattr(ids, "tolist") else list(ids)
        bad = [v for v in values if not 0 <= int(v) < self.vocab_size]
        if bad:
            raise ValueError(f"ByteTokenizer.decode: ids outside [0, {self.vocab_size}): {bad[:5]}")
        return bytes(int(v) for v in values if int(v) < 256).decode("utf-8", errors="replace")


def eos_id_of(tokenizer: Any) -> int | None:
    """The tokenizer's end-of-text id: its ``eos_id`` or (Hugging Face) ``eos_token_id``; ``None`` if it has none."""
    for name in ("eos_id", "eos_token_id"):
        value = getattr(tokenizer, name, None)
        if value is not None:
            return int(value)
    return None


def _import_dotted(path: str) -> Any:
    """The object at a dotted path ``package.module.Attr[.attr...]`` (the longest importable module prefix)."""
    parts = path.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for attr in parts[cut:]:
                obj = getattr(obj, attr)
        except AttributeError:
            break
        return obj
    raise ValueError(f"tokenizer class_path {path!r} does not name an importable class or callable")


def resolve_tokenizer(spec: Any) -> Any:
    """A tokenizer from ``spec``: ``"bytes"`` → :class:`ByteTokenizer`; a mapping ``{class_path, init_args}`` →
    ``class_path(**init_args)``; an object with ``encode`` and ``vocab_size`` → itself.

    Raises:
        ValueError: an unknown name, a malformed mapping, or an object without ``encode``/``vocab_size``.
    """
    if isinstance(spec, str):
        if spec == "bytes":
            return ByteTokenizer()
        raise ValueError(f"unknown tokenizer {spec!r}: use 'bytes', a {{class_path, init_args}} mapping, or an "
                         "object with encode(str) -> list[int] and vocab_size")
    if isinstance(spec, Mapping):
        extra = set(spec) - {"class_path", "init_args"}
        if "class_path" not in spec or extra or not isinstance(spec.get("init_args", {}), Mapping):
            raise ValueError(f"a tokenizer mapping is {{class_path: <dotted name>, init_args: {{...}}}}, got "
                             f"{dict(spec)!r}")
        spec = _import_dotted(str(spec["class_path"]))(**dict(spec.get("init_args") or {}))
    if not callable(getattr(spec, "encode", None)) or getattr(spec, "vocab_size", None) is None:
        raise ValueError(f"a tokenizer needs encode(str) -> list[int] and an integer vocab_size; "
                         f"{type(spec).__name__} lacks {'encode' if not hasattr(spec, 'encode') else 'vocab_size'}")
    return spec
