"""Federated text data (lightning_fedmeta.data.text_clients, text_records, tokenizers): JSONL per client, a table
with a client column, instruction records, the windows and the split checked by hand, and the refusals."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_fedmeta.data.federated import FederatedData
from lightning_fedmeta.data.text_clients import TextClients, split_windows, token_windows
from lightning_fedmeta.data.text_records import ALPACA_PROMPT, ALPACA_PROMPT_NO_INPUT, record_text
from lightning_fedmeta.data.tokenizers import ByteTokenizer, resolve_tokenizer

EOS = 256


def write_jsonl(path: Path, records: list[Any]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def folder(tmp_path: Path, clients: dict[str, list[str]]) -> Path:
    root = tmp_path / "clients"
    root.mkdir()
    for name, texts in clients.items():
        write_jsonl(root / f"{name}.jsonl", [{"text": t} for t in texts])
    return root


def same(a: FederatedData, b: FederatedData) -> None:
    assert a.client_names == b.client_names and a.num_classes == b.num_classes and a.task == b.task
    for field in ("train_x", "train_y", "train_offsets", "test_x", "test_y", "test_offsets"):
        assert torch.equal(getattr(a, field), getattr(b, field)), field


# ---- tokenizers --------------------------------------------------------------------------------------------------
def test_byte_tokenizer_round_trips_utf8_and_drops_special_ids() -> None:
    tok = ByteTokenizer()
    assert tok.vocab_size == 257 and tok.eos_id == 256 and tok.pad_id is None
    assert tok.encode("hé") == [104, 0xC3, 0xA9]
    assert tok.decode([104, 0xC3, 0xA9, EOS]) == "hé"
    assert tok.decode(torch.tensor([104, 0xC3])) == "h\ufffd"  # a cut character is replaced, not an error
    padded = ByteTokenizer(pad=True)
    assert padded.vocab_size == 258 and padded.pad_id == 257 and ByteTokenizer(eos=False).vocab_size == 256
    with pytest.raises(ValueError, match=r"outside \[0, 257\)"):
        tok.decode([257])


def make_bytes_without_eos() -> ByteTokenizer:
    """A tokenizer factory (not a class) named by a class_path."""
    return ByteTokenizer(eos=False)


def test_tokenizer_by_name_by_class_path_or_as_an_object() -> None:
    assert resolve_tokenizer("bytes") == ByteTokenizer()
    spec = {"class_path": "lightning_fedmeta.data.tokenizers.ByteTokenizer", "init_args": {"pad": True}}
    assert resolve_tokenizer(spec) == ByteTokenizer(pad=True)
    assert resolve_tokenizer({"class_path": f"{__name__}.make_bytes_without_eos"}) == ByteTokenizer(eos=False)
    mine = ByteTokenizer()
    assert resolve_tokenizer(mine) is mine
    with pytest.raises(ValueError, match="unknown tokenizer 'gpt2'"):
        resolve_tokenizer("gpt2")
    with pytest.raises(ValueError, match="does not name an importable"):
        resolve_tokenizer({"class_path": "lightning_fedmeta.data.tokenizers.NoSuchTokenizer"})
    with pytest.raises(ValueError, match="class_path: <dotted name>"):
        resolve_tokenizer({"class_path": "x.Y", "init_arg": {}})
    with pytest.raises(ValueError, match="lacks vocab_size"):
        resolve_tokenizer(type("NoSize", (), {"encode": lambda self, s: [0]})())


# ---- windows and split, by hand ----------------------------------------------------------------------------------
def test_windows_have_stride_seq_len_and_overlap_by_one_token() -> None:
    x, y = token_windows(torch.arange(10), 3)  # (10 - 1) // 3 = 3 windows of 4 tokens: 0-3, 3-6, 6-9
    assert x.tolist() == [[0, 1, 2], [3, 4, 5], [6, 7, 8]] and y.tolist() == [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
    x, y = token_windows(torch.arange(9), 3)  # 2 windows; token 8 fills none and is dropped
    assert x.tolist() == [[0, 1, 2], [3, 4, 5]] and y.tolist() == [[1, 2, 3], [4, 5, 6]]
    assert token_windows(torch.arange(3), 3)[0].shape == (0, 3)


def test_split_holds_out_a_seeded_fraction_and_keeps_training_windows_in_order() -> None:
    x = torch.arange(20).reshape(10, 2)
    trx, try_, tex, tey = split_windows(x, x + 100, 0.3, seed=1, client=0)
    assert tex.shape[0] == 3 and trx.shape[0] == 7 and torch.equal(try_, trx + 100) and torch.equal(tey, tex + 100)
    assert sorted(trx[:, 0].tolist() + tex[:, 0].tolist()) == x[:, 0].tolist()
    assert trx[:, 0].tolist() == sorted(trx[:, 0].tolist())
    again = split_windows(x, x + 100, 0.3, seed=1, client=0)[2]
    assert torch.equal(again, tex)
    draws = {tuple(split_windows(x, x, 0.3, seed=s, client=c)[2][:, 0].tolist()) for s in range(3) for c in range(3)}
    assert len(draws) > 1  # seed and client both move the draw
    assert split_windows(x[:2], x[:2], 0.9, 0, 0)[0].shape[0] == 1  # always one window left for training


def test_jsonl_folder_gives_hand_computed_windows_and_offsets(tmp_path: Path) -> None:
    # a: "abc" EOS "de" EOS = 97 98 99 256 100 101 256 (7 tokens): seq_len 3 gives (7 - 1) // 3 = 2 windows
    # b: "hello world" EOS = 12 tokens: (12 - 1) // 3 = 3 windows
    root = folder(tmp_path, {"b": ["hello world"], "a": ["abc", "de"]})
    data = TextClients(str(root), seq_len=3, test_fraction=0.5, seed=0).federated_data()
    assert data.client_names == ["a", "b"] and data.task == "next_token" and data.num_classes == 257
    # a: round(0.5·2) = 1 test window; b: round(0.5·3) = 2 (Python rounds half to even), one left for training
    assert data.train_offsets.tolist() == [0, 1, 2] and data.test_offsets.tolist() == [0, 1, 3]
    a = sorted(data.client_train(0)[0].tolist() + data.client_test(0)[0].tolist())
    assert a == [[97, 98, 99], [EOS, 100, 101]]
    a_targets = sorted(data.client_train(0)[1].tolist() + data.client_test(0)[1].tolist())
    assert a_targets == [[98, 99, EOS], [100, 101, EOS]]
    b = list(b"hello world") + [EOS]
    b_windows = sorted(data.client_train(1)[0].tolist() + data.client_test(1)[0].tolist())
    assert b_windows == sorted([b[0:3], b[3:6], b[6:9]])


def test_table_with_a_client_column_equals_the_folder_layout(tmp_path: Path) -> None:
    texts = {"bob": ["the quick brown fox", "jumps over"], "alice": ["lorem ipsum dolor sit amet"]}
    root = folder(tmp_path, texts)
    rows = [{"client": c, "text": t, "other": 1} for c in ("bob", "alice") for t in texts[c]]
    table = write_jsonl(tmp_path / "all.jsonl", rows)
    by_folder = TextClients(str(root), seq_len=4).federated_data()
    same(TextClients(table=str(table), seq_len=4).federated_data(), by_folder)
    csv = tmp_path / "all.csv"
    csv.write_text("user,text\n" + "".join(f'{r["client"]},"{r["text"]}"\n' for r in rows), encoding="utf-8")
    same(TextClients(table=str(csv), client_column="user", seq_len=4).federated_data(), by_folder)
    datasets = pytest.importorskip("datasets")
    hf = datasets.Dataset.from_list(rows)
    same(TextClients(table=hf, seq_len=4).federated_data(), by_folder)
    with pytest.raises(ValueError, match="no column 'speaker'"):
        TextClients(table=hf, client_column="speaker").client_data()


def test_instruction_records_use_the_alpaca_template(tmp_path: Path) -> None:
    with_input = {"instruction": "Add.", "input": "2 and 3", "output": "5"}
    without = {"instruction": "Say hi.", "output": "hi"}
    assert record_text(with_input, "r") == ALPACA_PROMPT.format(instruction="Add.", input="2 and 3") + "5"
    assert record_text(without, "r") == ALPACA_PROMPT_NO_INPUT.format(instruction="Say hi.") + "hi"
    assert record_text({**without, "input": ""}, "r") == record_text(without, "r")
    assert record_text(with_input, "r", "Q: {instruction} {input}\nA: ") == "Q: Add. 2 and 3\nA: 5"
    root = tmp_path / "inst"
    root.mkdir()
    write_jsonl(root / "c.jsonl", [with_input, without])
    data = TextClients(str(root), seq_len=8).federated_data()
    stream = (list(record_text(with_input, "").encode()) + [EOS] + list(record_text(without, "").encode()) + [EOS])
    x, _ = token_windows(torch.tensor(stream), 8)
    got = torch.cat([data.client_train(0)[0], data.client_test(0)[0]])
    assert sorted(got.tolist()) == sorted(x.tolist())


# ---- bad input ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("line", "message"), [
    ("{not json", r"bad\.jsonl:2: not valid JSON"),
    ("[1, 2]", r"bad\.jsonl:2: a record must be a JSON object"),
    ('{"prompt": "x"}', r"bad\.jsonl:2: a record needs a 'text' field, or 'instruction' and 'output'"),
    ('{"text": 7}', r"bad\.jsonl:2: field 'text' must be a string"),
    ('{"instruction": "i", "input": 3, "output": "o"}', r"bad\.jsonl:2: field 'input' must be a string"),
])
def test_a_malformed_line_names_the_file_and_line(tmp_path: Path, line: str, message: str) -> None:
    root = tmp_path / "c"
    root.mkdir()
    (root / "bad.jsonl").write_text('{"text": "fine"}\n' + line + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match=message):
        TextClients(str(root), seq_len=2).client_data()


def test_non_utf8_and_csv_rows_name_their_line(tmp_path: Path) -> None:
    root = tmp_path / "c"
    root.mkdir()
    (root / "x.jsonl").write_bytes(b'{"text": "ok"}\n\n{"text": "\xff"}\n')
    with pytest.raises(ValueError, match=r"x\.jsonl:3: not UTF-8"):
        TextClients(str(root), seq_len=2).client_data()
    csv = tmp_path / "t.csv"
    csv.write_text("client,text\na,hello\n,orphan\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"t\.csv:3: no client in column 'client'"):
        TextClients(table=str(csv), seq_len=2).client_data()
    csv.write_text("client,text\na,hello,extra\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"t\.csv:2: more cells than the header"):
        TextClients(table=str(csv), seq_len=2).client_data()


def test_a_client_too_short_for_two_windows_is_skipped_with_a_warning(tmp_path: Path) -> None:
    root = folder(tmp_path, {"long": ["x" * 40], "tiny": ["hi"]})  # tiny: 3 tokens < 2·4 + 1
    clients = TextClients(str(root), seq_len=4)
    with pytest.warns(UserWarning, match=r"skipped 1 client\(s\) with fewer than 2 windows .*tiny \(3 tokens\)"):
        assert clients.client_names == ["long"]
    (tmp_path / "s").mkdir()
    only_short = folder(tmp_path / "s", {"tiny": ["hi"]})
    with pytest.warns(UserWarning), pytest.raises(ValueError, match="no client has the 9 tokens of 2 windows"):
        TextClients(str(only_short), seq_len=4).client_data()


def test_links_out_of_the_folder_are_refused_unless_asked(tmp_path: Path) -> None:
    outside = write_jsonl(tmp_path / "secret.jsonl", [{"text": "x" * 30}])
    root = folder(tmp_path, {"a": ["y" * 30]})
    os.symlink(root / "a.jsonl", root / "alias.jsonl")  # inside the folder: read
    assert TextClients(str(root), seq_len=4).client_names == ["a", "alias"]
    os.symlink(outside, root / "b.jsonl")
    with pytest.raises(ValueError, match=r"b\.jsonl' is a link to .*secret\.jsonl', outside"):
        TextClients(str(root), seq_len=4)
    assert TextClients(str(root), seq_len=4, follow_symlinks=True).client_names == ["a", "alias", "b"]


def test_options_are_checked_before_reading(tmp_path: Path) -> None:
    root = folder(tmp_path, {"a": ["abcdefghij"]})
    for kwargs, message in (({"seq_len": 0}, "seq_len must be an integer >= 1"),
                            ({"test_fraction": 1.0}, r"test_fraction must be in \(0, 1\)"),
                            ({"vocab_size": 1}, "vocab_size must be an integer >= 2"),
                            ({"eos_id": 300}, r"eos_id must be an integer in \[0, vocab_size=257\)"),
                            ({"template": "no field"}, "template must contain {instruction}"),
                            ({"table": "x.csv"}, "exactly one of root")):
        with pytest.raises(ValueError, match=message):
            TextClients(str(root), **kwargs)
    with pytest.raises(ValueError, match="not a folder"):
        TextClients(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="has no eos_id/eos_token_id; pass eos_id"):
        TextClients(str(root), tokenizer=ByteTokenizer(eos=False))
    assert TextClients(str(root), tokenizer=ByteTokenizer(eos=False), eos_id=10, seq_len=2).num_classes == 256


class WordTokenizer:
    """A user's tokenizer: whitespace words from a fixed list, id 0 the end of text (the protocol only)."""

    def __init__(self, words: list[str]) -> None:
        self.ids = {w: i + 1 for i, w in enumerate(words)}
        self.vocab_size = len(words) + 1
        self.eos_token_id = 0

    def encode(self, text: str) -> list[int]:
        return [self.ids[w] for w in text.split()]


def test_a_user_tokenizer_and_its_vocabulary_size(tmp_path: Path) -> None:
    root = folder(tmp_path, {"a": ["one two three one two three"]})  # 1 2 3 1 2 3 0: windows s[0:4], s[3:7]
    data = TextClients(str(root), seq_len=3, tokenizer=WordTokenizer(["one", "two", "three"])).federated_data()
    assert data.num_classes == 4 and data.train_x.tolist() == data.test_x.tolist() == [[1, 2, 3]]
    assert sorted(torch.cat([data.train_y, data.test_y]).tolist()) == [[2, 3, 0], [2, 3, 1]]
    with pytest.raises(ValueError, match=r"token id 3 outside \[0, vocab_size=3\).*vocab_size=len\(tokenizer\)"):
        TextClients(str(root), seq_len=3, tokenizer=WordTokenizer(["one", "two", "three"]), vocab_size=3).client_data()


def test_a_hugging_face_tokenizer_follows_the_protocol(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    tokenizers = pytest.importorskip("tokenizers")
    from transformers import PreTrainedTokenizerFast

    vocab = {"[EOS]": 0, "[UNK]": 1, "hello": 2, "world": 3}
    core = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    core.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="[EOS]", unk_token="[UNK]")
    tok.add_tokens(["planet"])  # an added token: vocab_size leaves it out, len(tok) counts it
    assert tok.vocab_size == 4 and len(tok) == 5
    root = folder(tmp_path, {"a": ["hello world planet hello"] * 2})
    with pytest.raises(ValueError, match=r"token id 4 outside \[0, vocab_size=4\)"):
        TextClients(str(root), seq_len=2, tokenizer=tok).client_data()
    data = TextClients(str(root), seq_len=2, tokenizer=tok, vocab_size=len(tok)).federated_data()
    assert data.num_classes == 5 and sorted(torch.cat([data.train_x, data.test_x])[:, 0].tolist()) == [0, 2, 3, 4]
    tok.save_pretrained(tmp_path / "tok")  # the YAML form of docs/data.md: a class_path to a factory, from a folder
    spec = {"class_path": "transformers.AutoTokenizer.from_pretrained",
            "init_args": {"pretrained_model_name_or_path": str(tmp_path / "tok")}}
    same(TextClients(str(root), seq_len=2, tokenizer=spec, vocab_size=5).federated_data(), data)


# ---- configuration: YAML class_path and the registered name -----------------------------------------------------
def test_text_clients_from_a_class_path_config(tmp_path: Path) -> None:
    from jsonargparse import ArgumentParser

    from lightning_fedmeta.data.federated import FederatedDataset

    root = folder(tmp_path, {"a": ["some text for a client"], "b": ["and some more for another"]})
    parser = ArgumentParser(exit_on_error=False)
    parser.add_argument("--dataset", type=FederatedDataset)
    cfg = parser.parse_object({"dataset": {
        "class_path": "lightning_fedmeta.data.text_clients.TextClients",
        "init_args": {"root": str(root), "seq_len": 4, "tokenizer": {
            "class_path": "lightning_fedmeta.data.tokenizers.ByteTokenizer", "init_args": {"pad": True}}},
    }})
    ds = parser.instantiate_classes(cfg).dataset
    assert isinstance(ds, TextClients) and ds.tokenizer == ByteTokenizer(pad=True) and ds.num_classes == 258
    assert ds.client_names == ["a", "b"]


def test_text_jsonl_by_name_through_the_data_module(tmp_path: Path) -> None:
    from lightning_fedmeta.data import FederatedDataModule
    from lightning_fedmeta.registry import DATASETS

    if "text_jsonl" not in DATASETS.names():
        pytest.skip("the installed metadata predates the text_jsonl entry point (pip install -e . again)")
    root = folder(tmp_path, {c: [f"client {c} writes a line of text"] for c in "abc"})
    tokenizer = {"class_path": "lightning_fedmeta.data.tokenizers.ByteTokenizer"}
    dm = FederatedDataModule(dataset="text_jsonl", root=str(root), num_clients=2, data_seed=3,
                             dataset_options={"seq_len": 8, "tokenizer": tokenizer, "test_fraction": 0.25})
    dm.setup()
    direct = TextClients(str(root), seq_len=8, test_fraction=0.25, seed=3, max_clients=2).federated_data()
    same(dm.federated_data, direct)
    table = write_jsonl(tmp_path / "t.jsonl", [{"client": c, "text": f"client {c} writes a line of text"}
                                               for c in "abc"])
    dm = FederatedDataModule(dataset="text_jsonl", root=str(table), num_clients=2, data_seed=3,
                             dataset_options={"seq_len": 8, "test_fraction": 0.25})
    dm.setup()
    same(dm.federated_data, direct)
    with pytest.raises(ValueError, match="has no option"):
        FederatedDataModule(dataset="text_jsonl", root=str(root), dataset_options={"seqlen": 8})


def test_the_data_module_names_text_jsonl_and_asks_for_its_root() -> None:
    from lightning_fedmeta.data import DATASET_NAMES, FederatedDataModule

    assert "text_jsonl" in DATASET_NAMES
    with pytest.raises(ValueError, match=r"'text_jsonl' needs a `root` folder.*<client>\.jsonl"):
        FederatedDataModule(dataset="text_jsonl")
