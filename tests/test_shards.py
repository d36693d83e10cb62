"""gputravel.data: llm.c shards, loading a holder's tokens, prepare, demo data and the CLI."""

from __future__ import annotations

import itertools
import struct
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from gputravel.cli.data import data_app
from gputravel.data.holder_tokens import load_tokens
from gputravel.data.prepare import prepare
from gputravel.data.shakespeare import shakespeare_holders
from gputravel.data.shards import list_shards, read_shard, write_shard
from gputravel.data.tokenizer import ByteTokenizer, read_tokenizer_record, write_tokenizer_record
from gputravel.errors import BadInput

MAGIC = 20240520


def llmc_shard(tokens: list[int], *, magic: int = MAGIC, version: int = 1, count: int | None = None) -> bytes:
    """A shard laid out by llm.c's rules, independently of gputravel's writer."""
    header = [magic, version, len(tokens) if count is None else count] + [0] * 253
    return struct.pack("<256i", *header) + struct.pack(f"<{len(tokens)}H", *tokens)


# ----------------------------------------------------------------------------- one shard
def test_round_trip(tmp_path: Path) -> None:
    tokens = np.array([0, 1, 50256, 65535, 7], dtype=np.uint16)
    write_shard(tmp_path / "a.bin", tokens)
    got = read_shard(tmp_path / "a.bin")
    assert got.dtype == np.uint16 and got.tolist() == tokens.tolist()
    write_shard(tmp_path / "b.bin", [3, 2, 1])  # plain Python ints work too
    assert read_shard(tmp_path / "b.bin").tolist() == [3, 2, 1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.bin", "b.bin"]  # no temporaries left


def test_written_bytes_follow_the_llmc_layout(tmp_path: Path) -> None:
    write_shard(tmp_path / "a.bin", [5, 300, 65535])
    assert (tmp_path / "a.bin").read_bytes() == llmc_shard([5, 300, 65535])


def test_reads_a_shard_laid_out_by_llmc_rules(tmp_path: Path) -> None:
    tokens = [50256, 15496, 11, 995, 0, 65535]
    (tmp_path / "x.bin").write_bytes(llmc_shard(tokens))
    assert read_shard(tmp_path / "x.bin").tolist() == tokens
    (tmp_path / "empty.bin").write_bytes(llmc_shard([]))
    assert read_shard(tmp_path / "empty.bin").size == 0


@pytest.mark.parametrize("tokens", [[-1, 2], [65536], [1.5, 2.0], [[1, 2], [3, 4]]])
def test_write_rejects_tokens_a_shard_cannot_hold(tmp_path: Path, tokens) -> None:
    with pytest.raises(BadInput, match=r"a\.bin"):
        write_shard(tmp_path / "a.bin", tokens)
    assert list(tmp_path.iterdir()) == []  # nothing half-written


@pytest.mark.parametrize(("data", "message"), [
    (llmc_shard([1, 2], magic=20240801), "not an llm.c token shard"),
    (llmc_shard([1, 2], version=2), "version is not supported"),
    (llmc_shard([1, 2, 3])[:-2], "truncated: the file has 1028 bytes"),
    (llmc_shard([1, 2]) + b"\x00\x00\x00", "trailing bytes: the file has 1031 bytes"),
    (llmc_shard([1, 2], count=-4), "negative"),
    (b"\x00" * 100, "100 bytes is shorter than an llm.c shard header"),
    (b"", "0 bytes is shorter"),
])
def test_bad_shards_are_rejected_naming_the_file(tmp_path: Path, data: bytes, message: str) -> None:
    path = tmp_path / "bad_000001.bin"
    path.write_bytes(data)
    with pytest.raises(BadInput, match=message) as info:
        read_shard(path)
    assert str(path) in str(info.value)


@pytest.mark.parametrize("fields", [{"magic": 987654321}, {"version": 987654321}, {"count": 987654321}])
def test_a_bad_header_is_named_never_quoted(tmp_path: Path, fields: dict[str, int]) -> None:
    # A file that is no shard holds other bytes there, a holder's; these words reach the launcher.
    path = tmp_path / "notes.bin"
    path.write_bytes(llmc_shard([1, 2], **fields))
    with pytest.raises(BadInput) as info:
        read_shard(path)
    assert "987654321" not in str(info.value)


def test_missing_shard(tmp_path: Path) -> None:
    with pytest.raises(BadInput, match="does not exist"):
        read_shard(tmp_path / "nope.bin")


# ----------------------------------------------------------------------------- a holder's shards
def test_list_shards_sorted_by_name(tmp_path: Path) -> None:
    for name in ("d_000010.bin", "d_000002.bin", "d_000001.bin"):
        write_shard(tmp_path / name, [1])
    (tmp_path / "notes.txt").write_text("not a shard")
    assert [p.name for p in list_shards(tmp_path)] == ["d_000001.bin", "d_000002.bin", "d_000010.bin"]


def test_list_shards_errors(tmp_path: Path) -> None:
    with pytest.raises(BadInput, match=f"no \\*.bin shards in {tmp_path}"):
        list_shards(tmp_path)
    with pytest.raises(BadInput, match="does not exist"):
        list_shards(tmp_path / "missing")


def test_load_tokens_concatenates_in_sorted_shard_order(tmp_path: Path) -> None:
    # Written out of order: the training order is the file name order, not creation order.
    write_shard(tmp_path / "h_000001.bin", [20, 21])
    write_shard(tmp_path / "h_000000.bin", [10, 11, 12])
    write_shard(tmp_path / "h_000002.bin", [30])
    write_tokenizer_record(tmp_path, ByteTokenizer())
    holder = load_tokens(tmp_path)
    assert holder.tokens.tolist() == [10, 11, 12, 20, 21, 30]
    assert holder.tokens.dtype == np.uint16 and not holder.tokens.flags.writeable
    assert [Path(f).name for f in holder.files] == ["h_000000.bin", "h_000001.bin", "h_000002.bin"]
    assert (holder.tokenizer, holder.vocab_size, holder.eot, len(holder)) == ("bytes", 257, 256, 6)
    single = load_tokens(tmp_path / "h_000001.bin")  # one shard: the record sits in its directory
    assert single.tokens.tolist() == [20, 21] and single.tokenizer == "bytes"


def test_shards_without_a_record_are_llmc_gpt2_unless_told(tmp_path: Path) -> None:
    (tmp_path / "tiny_shakespeare_val.bin").write_bytes(llmc_shard([50256, 5962, 22307]))
    holder = load_tokens(tmp_path)
    assert (holder.tokenizer, holder.vocab_size, holder.eot) == ("gpt2", 50257, 50256)
    with pytest.raises(BadInput, match="a token is outside the bytes vocabulary") as info:
        load_tokens(tmp_path, tokenizer="bytes")
    assert "tiny_shakespeare_val.bin" in str(info.value)


def test_explicit_tokenizer_contradicting_the_record(tmp_path: Path) -> None:
    write_shard(tmp_path / "a.bin", [1, 2])
    write_tokenizer_record(tmp_path, ByteTokenizer())
    with pytest.raises(BadInput, match="bytes tokens, but tokenizer 'gpt2'"):
        load_tokens(tmp_path, tokenizer="gpt2")


def test_load_tokens_rejects_missing_and_empty(tmp_path: Path) -> None:
    with pytest.raises(BadInput, match="does not exist"):
        load_tokens(tmp_path / "missing")
    write_shard(tmp_path / "a.bin", [])
    with pytest.raises(BadInput, match="holds no tokens"):
        load_tokens(tmp_path)


# ----------------------------------------------------------------------------- prepare
DOCS = {"b.txt": "Second doc: ça va?\n", "a.txt": "First document.\n", "c.txt": "Third, the last one."}


@pytest.fixture
def texts(tmp_path: Path) -> Path:
    src = tmp_path / "press"
    src.mkdir()
    for name, text in DOCS.items():
        (src / name).write_text(text, encoding="utf-8")
    (src / "empty.txt").write_text("")
    return src


def split_documents(tokens: np.ndarray, eot: int) -> list[list[int]]:
    """Documents of a stream in which an EOT precedes every document."""
    assert tokens[0] == eot
    cuts = np.flatnonzero(tokens == eot).tolist() + [len(tokens)]
    return [tokens[a + 1:b].tolist() for a, b in itertools.pairwise(cuts)]


def test_prepare_writes_shards_that_decode_back_to_the_texts(tmp_path: Path, texts: Path) -> None:
    tok = ByteTokenizer()
    out = tmp_path / "holder one"
    result = prepare([texts], out, tok, shard_tokens=16)
    n = sum(len(t.encode()) + 1 for t in DOCS.values())  # one EOT per document
    assert (result.files, result.tokens, result.tokenizer) == (3, n, "bytes")
    assert [p.name for p in result.skipped] == ["empty.txt"]
    assert len(result.shards) == -(-n // 16)  # full shards, the last one shorter
    assert [p.name for p in result.shards][:2] == ["holder_one_000000.bin", "holder_one_000001.bin"]
    assert all(read_shard(p).size == 16 for p in result.shards[:-1])
    assert read_tokenizer_record(out).name == "bytes"
    assert sorted(p.name for p in out.iterdir()) == sorted([p.name for p in result.shards] + ["tokenizer.json"])
    stream = np.concatenate([read_shard(p) for p in result.shards])
    docs = [tok.decode(d) for d in split_documents(stream, tok.eot)]
    assert docs == [DOCS[n] for n in sorted(DOCS)]  # files in sorted order


def test_text_and_its_shards_load_the_same_tokens(tmp_path: Path, texts: Path) -> None:
    prepared = prepare([texts], tmp_path / "out", ByteTokenizer(), shard_tokens=7)
    from_shards = load_tokens(prepared.out)
    from_text = load_tokens(texts, tokenizer="bytes")
    assert from_text.tokens.tolist() == from_shards.tokens.tolist()
    assert [Path(f).name for f in from_text.files] == ["a.txt", "b.txt", "c.txt"]
    one_file = load_tokens(texts / "b.txt", tokenizer=ByteTokenizer())
    assert ByteTokenizer().decode(one_file.tokens) == DOCS["b.txt"]


def test_prepare_keeps_the_order_of_inputs(tmp_path: Path, texts: Path) -> None:
    result = prepare([texts / "c.txt", texts / "a.txt"], tmp_path / "out", ByteTokenizer())
    stream = read_shard(result.shards[0])
    assert [ByteTokenizer().decode(d) for d in split_documents(stream, 256)] == [DOCS["c.txt"], DOCS["a.txt"]]


def test_prepare_errors(tmp_path: Path, texts: Path) -> None:
    tok = ByteTokenizer()
    with pytest.raises(BadInput, match=r"input .*missing\.txt does not exist"):
        prepare([tmp_path / "missing.txt"], tmp_path / "out", tok)
    (tmp_path / "blank").mkdir()
    (tmp_path / "blank" / "e.txt").write_text("")
    with pytest.raises(BadInput, match="no text found"):
        prepare([tmp_path / "blank"], tmp_path / "out", tok)
    (tmp_path / "notext").mkdir()
    (tmp_path / "notext" / "README.md").write_text("# not a .txt file")
    with pytest.raises(BadInput, match=r"no \.txt files in .*notext"):
        prepare([tmp_path / "notext"], tmp_path / "out", tok)
    (tmp_path / "afile").write_text("x")
    with pytest.raises(BadInput, match="afile exists and is a file"):
        prepare([texts], tmp_path / "afile", tok)
    with pytest.raises(BadInput, match="given twice"):
        prepare([texts, texts / "a.txt"], tmp_path / "out", tok)
    (tmp_path / "latin1.txt").write_bytes("café".encode("latin-1"))
    with pytest.raises(BadInput, match=r"latin1\.txt is not UTF-8 text \(at byte offset 3\)") as info:
        prepare([tmp_path / "latin1.txt"], tmp_path / "out", tok)
    assert "0xe9" not in str(info.value)  # where, never the byte: a holder's data
    assert not (tmp_path / "out").exists()  # failed runs publish nothing


def test_prepare_overwrite_replaces_old_shards_only_when_asked(tmp_path: Path, texts: Path) -> None:
    out = tmp_path / "out"
    first = prepare([texts], out, ByteTokenizer(), shard_tokens=8)
    with pytest.raises(BadInput, match=r"not empty.*--overwrite"):
        prepare([texts / "a.txt"], out, ByteTokenizer())
    second = prepare([texts / "a.txt"], out, ByteTokenizer(), overwrite=True)
    assert len(first.shards) > 1 and len(second.shards) == 1
    # No stale shard of the first run may survive to be concatenated into training data.
    assert sorted(p.name for p in out.iterdir()) == ["out_000000.bin", "tokenizer.json"]
    (texts / "a.txt").rename(tmp_path / "keep.txt")
    with pytest.raises(BadInput, match="files prepare did not write"):
        prepare([tmp_path / "keep.txt"], texts, ByteTokenizer(), overwrite=True)
    assert sorted(p.name for p in texts.iterdir()) == ["b.txt", "c.txt", "empty.txt"]


def test_prepare_with_a_progress_bar_over_many_files(tmp_path: Path) -> None:
    src = tmp_path / "many"
    src.mkdir()
    for i in range(12):
        (src / f"doc{i:02d}.txt").write_text(f"document {i}\n")
    result = prepare([src], tmp_path / "out", ByteTokenizer(), progress=True)
    stream = read_shard(result.shards[0])
    assert [ByteTokenizer().decode(d) for d in split_documents(stream, 256)] == [f"document {i}\n" for i in range(12)]


# ----------------------------------------------------------------------------- demo data
def test_the_shipped_shakespeare_holders_have_three_plays_each_without_license_boilerplate() -> None:
    holders = shakespeare_holders()
    assert list(holders) == ["tragedies", "comedies", "histories"]
    for directory in holders.values():
        plays = sorted(directory.glob("*.txt"))
        assert len(plays) == 3
        for play in plays:
            text = play.read_text(encoding="utf-8")
            assert len(text) > 50_000 and "by William Shakespeare" in text[:200]
            assert "gutenberg" not in text.lower(), f"{play} carries Project Gutenberg boilerplate"
    assert (holders["tragedies"].parent / "PROVENANCE.md").is_file()


# ----------------------------------------------------------------------------- CLI
def test_cli_prepare(tmp_path: Path, texts: Path) -> None:
    out = tmp_path / "shards"
    result = CliRunner().invoke(data_app, ["prepare", "--input", str(texts), "--out", str(out),
                                           "--tokenizer", "bytes", "--shard-tokens", "20"])
    assert result.exit_code == 0, result.output
    assert "3 files" in result.output and "shards" in result.output and "bytes" in result.output
    assert len(list_shards(out)) == 3


def test_cli_prepare_missing_input(tmp_path: Path) -> None:
    result = CliRunner().invoke(data_app, ["prepare", "--input", str(tmp_path / "nope"),
                                           "--out", str(tmp_path / "out"), "--tokenizer", "bytes"])
    assert result.exit_code == 1
    assert "error:" in result.output and "does not exist" in result.output
