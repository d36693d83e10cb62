"""gputravel.data.tokenizer: byte tokenizer, gpt2 availability and fallback, the tokenizer record."""

from __future__ import annotations

import json
import sys
import types

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from profiles import examples  # tests/profiles.py: counts for the thorough profile

from gputravel.data import tokenizer as tk
from gputravel.data.tokenizer import (
    ByteTokenizer,
    Gpt2Tokenizer,
    TokenizerRecord,
    default_tokenizer,
    get_tokenizer,
    read_tokenizer_record,
    resolve_record,
    write_tokenizer_record,
)
from gputravel.errors import BadInput


# ----------------------------------------------------------------------------- bytes
@settings(max_examples=examples(200), deadline=None)
@given(st.text(alphabet=st.characters(codec="utf-8")))
def test_byte_tokenizer_round_trips_any_text(text: str) -> None:
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert ids.dtype == np.uint16
    assert len(ids) == len(text.encode("utf-8"))
    assert int(ids.max(initial=0)) < 256  # the eot never comes out of encode
    assert tok.decode(ids) == text
    assert tok.decode(ids.tolist()) == text


def test_byte_tokenizer_constants_and_known_ids() -> None:
    tok = ByteTokenizer()
    assert (tok.name, tok.vocab_size, tok.eot) == ("bytes", 257, 256)
    assert tok.encode("Aé").tolist() == [65, 0xC3, 0xA9]


def test_byte_decode_drops_eot_and_replaces_broken_utf8() -> None:
    tok = ByteTokenizer()
    assert tok.decode([256, 104, 105, 256, 33]) == "hi!"
    # The first byte of "é" alone, as when a training window cuts a character in two.
    assert tok.decode([0xC3, 65]) == "\ufffdA"


def test_byte_decode_rejects_ids_outside_the_vocabulary() -> None:
    with pytest.raises(BadInput, match=r"257.*outside the bytes vocabulary"):
        ByteTokenizer().decode([65, 257])
    with pytest.raises(BadInput, match="-1"):
        ByteTokenizer().decode([-1])


def test_byte_encode_rejects_lone_surrogates() -> None:
    with pytest.raises(BadInput, match="UTF-8"):
        ByteTokenizer().encode("a\ud800b")


# ----------------------------------------------------------------------------- gpt2 via tiktoken
class FakeEncoding:
    """Stands in for tiktoken's gpt2 encoding: ids are code points, enough to see the calls."""

    n_vocab = 50257
    eot_token = 50256

    def encode_ordinary(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: list[int], errors: str = "strict") -> str:
        return "".join(chr(i) for i in ids)


@pytest.fixture
def fresh_gpt2_cache():
    tk._gpt2_encoding.cache_clear()
    yield
    tk._gpt2_encoding.cache_clear()  # later tests must see the real environment again


def _fake_tiktoken(monkeypatch: pytest.MonkeyPatch, get_encoding) -> None:
    module = types.ModuleType("tiktoken")
    module.get_encoding = get_encoding
    monkeypatch.setitem(sys.modules, "tiktoken", module)


def test_gpt2_used_when_its_encoding_loads(monkeypatch, fresh_gpt2_cache) -> None:
    asked = []
    _fake_tiktoken(monkeypatch, lambda name: asked.append(name) or FakeEncoding())
    tok = default_tokenizer()
    assert isinstance(tok, Gpt2Tokenizer) and asked == ["gpt2"]
    assert (tok.name, tok.vocab_size, tok.eot) == ("gpt2", 50257, 50256)
    assert tok.encode("hi").tolist() == [104, 105]
    assert tok.decode([104, 50256, 105]) == "hi"  # eot dropped, as for bytes
    assert isinstance(get_tokenizer("gpt2"), Gpt2Tokenizer)


def test_falls_back_to_bytes_when_the_bpe_file_cannot_be_fetched(monkeypatch, fresh_gpt2_cache) -> None:
    def offline(name):
        raise ConnectionError("no route to openaipublic.blob.core.windows.net")

    _fake_tiktoken(monkeypatch, offline)
    assert isinstance(default_tokenizer(), ByteTokenizer)
    assert isinstance(get_tokenizer("auto"), ByteTokenizer)
    with pytest.raises(BadInput, match=r"gpt2 tokenizer is not available.*TIKTOKEN_CACHE_DIR"):
        get_tokenizer("gpt2")


def test_falls_back_to_bytes_without_tiktoken(monkeypatch, fresh_gpt2_cache) -> None:
    monkeypatch.setitem(sys.modules, "tiktoken", None)  # makes `import tiktoken` fail
    assert isinstance(default_tokenizer(), ByteTokenizer)
    with pytest.raises(BadInput, match="tiktoken is not installed"):
        Gpt2Tokenizer()


def test_unknown_tokenizer_name() -> None:
    with pytest.raises(BadInput, match=r"unknown tokenizer 'llama'.*auto, bytes, gpt2"):
        get_tokenizer("llama")


# ----------------------------------------------------------------------------- the record
def test_record_round_trip(tmp_path) -> None:
    path = write_tokenizer_record(tmp_path, ByteTokenizer())
    assert path == tmp_path / "tokenizer.json"
    assert json.loads(path.read_text()) == {"name": "bytes", "vocab_size": 257, "eot": 256}
    assert read_tokenizer_record(tmp_path) == TokenizerRecord("bytes", 257, 256)
    write_tokenizer_record(tmp_path, TokenizerRecord("gpt2", 50257, 50256))
    assert read_tokenizer_record(tmp_path) == TokenizerRecord("gpt2", 50257, 50256)
    assert [p.name for p in tmp_path.iterdir()] == ["tokenizer.json"]  # no temporary left behind


def test_missing_record_names_the_directory(tmp_path) -> None:
    with pytest.raises(BadInput, match=f"no tokenizer.json in {tmp_path}"):
        read_tokenizer_record(tmp_path)


@pytest.mark.parametrize(("content", "message"), [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "JSON object"),
    ('{"name": "bytes", "vocab_size": 257}', "lacks eot"),
    ('{"name": "x", "vocab_size": true, "eot": 0}', "integers"),
    ('{"name": "x", "vocab_size": 70000, "eot": 0}', "do not fit uint16"),
    ('{"name": "x", "vocab_size": 10, "eot": 10}', "do not fit uint16"),
    ('{"name": "gpt2", "vocab_size": 257, "eot": 256}', "gpt2 has vocab_size 50257"),
])
def test_malformed_record_is_rejected_with_its_path(tmp_path, content, message) -> None:
    (tmp_path / "tokenizer.json").write_text(content)
    with pytest.raises(BadInput, match=message) as info:
        read_tokenizer_record(tmp_path)
    assert str(tmp_path / "tokenizer.json") in str(info.value)


def test_custom_record_is_accepted(tmp_path) -> None:
    (tmp_path / "tokenizer.json").write_text('{"name": "mine", "vocab_size": 1000, "eot": 999}')
    assert read_tokenizer_record(tmp_path) == TokenizerRecord("mine", 1000, 999)


def test_resolve_record_prefers_the_record_then_the_caller_then_gpt2(tmp_path) -> None:
    assert resolve_record(tmp_path, None) == TokenizerRecord("gpt2", 50257, 50256)  # llm.c's shards
    assert resolve_record(tmp_path, "bytes") == TokenizerRecord("bytes", 257, 256)
    assert resolve_record(tmp_path, ByteTokenizer()) == TokenizerRecord("bytes", 257, 256)
    write_tokenizer_record(tmp_path, ByteTokenizer())
    assert resolve_record(tmp_path, None).name == "bytes"
    assert resolve_record(tmp_path, "auto").name == "bytes"
    with pytest.raises(BadInput, match="says the shards are bytes tokens, but tokenizer 'gpt2'"):
        resolve_record(tmp_path, "gpt2")


def test_a_job_and_a_manifest_name_exactly_the_known_tokenizers() -> None:
    # Written out in both (importing this module costs every service numpy); they must not drift.
    from typing import get_args

    from gputravel.manifest.sections import Data
    from gputravel.train.job import TrainConfig

    for model in (TrainConfig, Data):
        assert set(get_args(model.model_fields["tokenizer"].annotation)) == set(tk.KNOWN)
