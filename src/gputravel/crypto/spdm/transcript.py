"""The SPDM transcript: what both sides hash, sign and MAC, encoded unambiguously. Each message:
lp(type name) || u32 field count || per field lp(name) || b"B" lp(bytes) or b"T" u32 count lp(item)...,
lp(x) = u32 BE length || x. A partial encoding leaves out what cannot cover itself (signature,
verify data), and the field count says so.
"""

from __future__ import annotations

import struct

from cryptography.hazmat.primitives import hashes
from msgspec import Struct
from msgspec.structs import fields

from gputravel.errors import ProtocolError

# The partial encodings: what the signature, and each side's verify data, cover.
SIG_FIELDS = frozenset({"signature", "responder_verify"})
RSP_VERIFY = frozenset({"responder_verify"})
REQ_VERIFY = frozenset({"requester_verify"})


def _lp(data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + data


def _encode(msg: Struct, omit: frozenset[str] = frozenset()) -> bytes:
    kept = [f for f in fields(msg) if f.name not in omit]
    parts = [_lp(type(msg).__name__.encode("ascii")), struct.pack(">I", len(kept))]
    for f in kept:
        value = getattr(msg, f.name)
        parts.append(_lp(f.name.encode("ascii")))
        if isinstance(value, bytes):
            parts += [b"B", _lp(value)]
        elif isinstance(value, tuple) and all(isinstance(v, bytes) for v in value):
            parts += [b"T", struct.pack(">I", len(value))] + [_lp(v) for v in value]
        else:
            raise ProtocolError(f"{type(msg).__name__}.{f.name} has an unsupported type")
    return b"".join(parts)


class Transcript:
    def __init__(self) -> None:
        self._data = bytearray()

    def append(self, msg: Struct) -> None:
        self._data += _encode(msg)

    def digest_with(self, msg: Struct | None = None, omit: frozenset[str] = frozenset()) -> bytes:
        """SHA-384 of the transcript so far, plus a partial encoding of `msg` if given."""
        h = hashes.Hash(hashes.SHA384())
        h.update(bytes(self._data))
        if msg is not None:
            h.update(_encode(msg, omit))
        return h.finalize()

    def bytes(self) -> bytes:
        return bytes(self._data)
