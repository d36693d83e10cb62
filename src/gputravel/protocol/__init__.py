"""Shared floor: the codec, the messages split by the link they cross, the memory layout, the chunk manifest."""
