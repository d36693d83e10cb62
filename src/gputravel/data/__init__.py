"""Training data: llm.c token shards, tokenizers, text preparation and the shipped Shakespeare."""
