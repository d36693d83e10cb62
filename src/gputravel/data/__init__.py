"""Training data: llm.c token shards, tokenizers, text preparation and the shipped Shakespeare."""

from gputravel.data.shakespeare import shakespeare_holders
from gputravel.data.prepare import PrepareResult, prepare
from gputravel.data.holder_tokens import HolderTokens, load_tokens
from gputravel.data.shards import list_shards, read_shard, write_shard
from gputravel.data.tokenizer import (
    ByteTokenizer,
    Gpt2Tokenizer,
    Tokenizer,
    TokenizerRecord,
    default_tokenizer,
    get_tokenizer,
    read_tokenizer_record,
    write_tokenizer_record,
)

__all__ = [
    "ByteTokenizer", "Gpt2Tokenizer", "HolderTokens", "PrepareResult", "Tokenizer", "TokenizerRecord",
    "default_tokenizer", "get_tokenizer", "list_shards", "load_tokens", "prepare", "read_shard",
    "read_tokenizer_record", "shakespeare_holders", "write_shard", "write_tokenizer_record",
]
