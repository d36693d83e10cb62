"""Coverage-guided fuzzing of the message codec and the context-blob parser (atheris).

    .venv/bin/pip install atheris          # not a test dependency: pytest never needs it
    .venv/bin/python fuzz/fuzz_wire.py -atheris_runs=100000 [CORPUS_DIR]

Each input is either raw bytes for ``wire.decode`` / ``unpack_context``, or (first byte odd)
a byte-level edit of a valid encoding of one registered message, so the fuzzer starts deep
inside the field validation rather than rediscovering msgpack. The property is the one
tests/test_fuzz.py checks: only ProtocolError (ContextBlobError for blobs) may escape, and a
message that decodes re-encodes to the same bytes. Any other exception is a finding.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import importlib
import importlib.util
import pkgutil
import sys
import types
import typing
from pathlib import Path
from typing import Any

import atheris

with atheris.instrument_imports():
    import gputravel
    from gputravel import wire
    from gputravel.audit import AuditEvent, ChunkId, Entry
    from gputravel.context import (
        CONTEXT_VERSION,
        DriverContext,
        SealedContext,
        pack_context,
        unpack_context,
    )
    from gputravel.crypto.channel import IV_BYTES, KEY_BYTES, ChannelState
    from gputravel.errors import ContextBlobError, ProtocolError

    # Every module that registers messages (as tests/test_fuzz.py finds them), instrumented too.
    for _info in pkgutil.walk_packages(gputravel.__path__, "gputravel."):
        _spec = importlib.util.find_spec(_info.name)
        if _spec and _spec.origin and _spec.origin.endswith(".py") and \
                "message(" in Path(_spec.origin).read_text():
            importlib.import_module(_info.name)

LAYOUT = "fuzz-layout"


def sample(hint: Any) -> Any:
    """A small valid value of a field annotation (one per type: the fuzzer does the rest)."""
    if hint is type(None) or hint is None:
        return None
    if hint is ChannelState:
        return ChannelState("Lce00_h2d_user", b"k" * KEY_BYTES, b"i" * IV_BYTES, 1, 2)
    if hint is Entry:  # prev_hash must be a SHA-384
        return Entry(1, 2.5, AuditEvent.TRAVEL, ChunkId("alice", 0, 8), 1, 2, b"d" * 32, bytes(48))
    plain = {int: 7, float: 1.5, str: "ab", bytes: b"\x00\x01", bool: True}
    if hint in plain:
        return plain[hint]
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return next(iter(hint))
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        hints = typing.get_type_hints(hint)
        return hint(**{f.name: sample(hints[f.name]) for f in dataclasses.fields(hint)})
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return sample(next(a for a in args if a is not type(None)))
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        return (sample(args[0]), sample(args[0]))
    if origin is tuple:
        return tuple(sample(a) for a in args)
    if origin is dict:
        return {"k": sample(args[1])}
    raise TypeError(f"no sample for {hint!r}")


def seeds() -> list[bytes]:
    out = []
    for cls in wire._CLASS_BY_TAG.values():
        try:
            out.append(wire.encode(sample(cls)))
        except Exception as exc:  # an invariant the one-size sample misses: fuzz it from raw bytes
            print(f"no seed for {wire.tag_of(cls)}: {type(exc).__name__}", file=sys.stderr)
    ctx = DriverContext(CONTEXT_VERSION, LAYOUT, 3, (sample(ChannelState),), (sample(ChannelState),),
                        1, 2, 3, 4, 5)
    out.append(pack_context(ctx))
    body = wire.encode(ctx)  # also a body the parser will get past the checksum with
    out.append(wire.encode(SealedContext(body=body, sha256=hashlib.sha256(body).digest())))
    return out


SEEDS = seeds()


def edit(fdp: atheris.FuzzedDataProvider) -> bytes:
    """Apply a few fuzzer-chosen byte edits to one valid encoding."""
    data = bytearray(SEEDS[fdp.ConsumeIntInRange(0, len(SEEDS) - 1)])
    for _ in range(fdp.ConsumeIntInRange(1, 4)):
        op, pos = fdp.ConsumeIntInRange(0, 2), fdp.ConsumeIntInRange(0, len(data))
        if op == 0 and pos < len(data):
            data[pos] = fdp.ConsumeInt(1) & 0xFF
        elif op == 1:
            data[pos:pos] = fdp.ConsumeBytes(fdp.ConsumeIntInRange(1, 8))
        else:
            del data[pos : pos + fdp.ConsumeIntInRange(1, 8)]
    return bytes(data)


def check_decode(data: bytes) -> None:
    try:
        msg = wire.decode(data)
    except ProtocolError:
        return
    again = wire.encode(msg)
    if wire.encode(wire.decode(again)) != again:
        raise AssertionError("a decoded message does not re-encode stably")


def check_context(data: bytes) -> None:
    try:
        ctx = unpack_context(data, layout=LAYOUT)
    except ContextBlobError:
        return
    if type(ctx) is not DriverContext:
        raise AssertionError("unpack_context returned something else than a DriverContext")


def test_one_input(raw: bytes) -> None:
    if raw and raw[0] & 1:
        data = edit(atheris.FuzzedDataProvider(raw[1:]))
    else:
        data = raw[1:]
    check_decode(data)
    check_context(data)


def main() -> None:
    atheris.Setup(sys.argv, test_one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
