"""Training data: llm.c token shards, tokenizers, text preparation and the shipped Shakespeare."""

# What a user's own script imports (examples/port_nanogpt.py).
from gputravel.data.holder_tokens import load_tokens
from gputravel.data.shakespeare import shakespeare_holders

__all__ = ["load_tokens", "shakespeare_holders"]
