"""Porting a nanoGPT-style training loop to GPU Travelling: one line changes.

nanoGPT reads its batches with ``get_batch('train')`` from a local ``train.bin``. With GPU
Travelling the data stays with its holders; the orchestrator reads each batch from the dataset
buffer in the GPU's protected memory, and the loader makes the GPU travel when the buffer is
used up. The loop itself does not change:

    -    X, Y = get_batch("train")
    +    X, Y = next(batches)  # batches = iter(TravellingLoader(source, B, T, buffer_bytes))

`source` is where chunks come from. Inside the orchestrator CVM it is
``TravelSource(orchestrator, dataset_bytes)`` (what `gputravel demo` uses); here, to run the
example on its own, it is ``LocalSource`` over the shipped demo holders' tokens, read from
disk in the same order: the two give the same batches, so the same losses.

    python examples/port_nanogpt.py --steps 50
"""

from __future__ import annotations

import argparse

import torch

from gputravel.data import load_tokens, shakespeare_holders
from gputravel.train.loader import LocalSource, TravellingLoader
from gputravel.train.model import GPT, GPTConfig


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--buffer-bytes", type=int, default=64 << 10)
    args = ap.parse_args()
    B, T = args.batch, args.seq_len

    # --- the data: holders' token streams (in a cohort: TravelSource over the travelling GPU)
    holders = {name: load_tokens(path) for name, path in shakespeare_holders().items()}
    source = LocalSource({name: h.tokens for name, h in holders.items()})
    vocab = next(iter(holders.values())).vocab_size

    # --- a nanoGPT-style model and optimizer, unchanged
    torch.manual_seed(1337)
    model = GPT(GPTConfig(block_size=T, vocab_size=vocab, n_layer=4, n_head=4, n_embd=128))
    optimizer = model.configure_optimizer(lr=1e-3, weight_decay=0.1, betas=(0.9, 0.95))

    batches = iter(TravellingLoader(source, B, T, args.buffer_bytes))  # the one new line
    for it in range(args.steps):
        X, Y = next(batches)  # was: X, Y = get_batch("train")
        _, loss = model(X, Y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if it % 10 == 0 or it == args.steps - 1:
            print(f"iter {it}: loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
