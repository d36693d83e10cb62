"""Training data: llm.c token shards, tokenizers, text preparation and the demo holders."""

from gputravel.data.shakespeare import demo_holders
from gputravel.data.prepare import PrepareResult, prepare
from gputravel.data.shards import HolderTokens, list_shards, load_tokens, read_shard, write_shard
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
    "default_tokenizer", "demo_holders", "get_tokenizer", "list_shards", "load_tokens", "prepare",
    "read_shard", "read_tokenizer_record", "write_shard", "write_tokenizer_record",
]
