"""The channel crypto recipe, the only AES-GCM user in gputravel: AES-256-GCM with H100-style
counter IVs (spec section 1). IV = a u32 message counter, incremented before use, then a u64
channel counter, little-endian; GCM nonce = IV XOR a per-key mask. The IV is never sent: the
receiver tracks it, so a replayed, dropped or reordered message fails authentication.
Where this differs from H100 (rotation, counter rollover) is said next to the code.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterable, Sized
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, Self, TypeVar

import msgspec
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDFExpand
from msgspec.structs import force_setattr

from gputravel.errors import BadInput, CounterExhausted, IntegrityError

if TYPE_CHECKING:
    from typing_extensions import Buffer  # collections.abc.Buffer from Python 3.12

    class SizedBuffer(Buffer, Sized, Protocol):
        """A buffer whose len() is its size: bytes, bytearray, a memoryview of bytes, a numpy array."""

    class _Aead(Protocol):
        """AESGCM as it behaves: any buffer in (cryptography types them bytes | bytearray |
        memoryview below Python 3.12; ddp/ring.py hands it numpy arrays)."""

        def encrypt(self, nonce: bytes, data: Buffer, associated_data: Buffer | None) -> bytes: ...
        def decrypt(self, nonce: bytes, data: Buffer, associated_data: Buffer | None) -> bytes: ...
        def encrypt_into(self, nonce: bytes, data: Buffer, associated_data: Buffer | None, buf: Buffer) -> int: ...
        def decrypt_into(self, nonce: bytes, data: Buffer, associated_data: Buffer | None, buf: Buffer) -> int: ...

KEY_BYTES = 32
IV_BYTES = 12
TAG_BYTES = 16
MAX_MESSAGE_COUNTER = 0xFFFFFFFF
MAX_CHANNEL_COUNTER = 2**64 - 1

MIN_SESSION_SECRET_BYTES = 32
_T = TypeVar("_T")

_IV_LAYOUT = struct.Struct("<IQ")  # u32 message counter, then the u64 channel counter
_EPOCH_INFO = b"gputravel/epoch/"
_IVMASK_INFO = b"gputravel/ivmask/"
# No label starts with this: one equal to an iv-mask info string would share its HKDF input.
_RESERVED_LABEL_PREFIX = "gputravel/"


# ----------------------------------------------------------------------------- IV layout
def build_iv(message_counter: int, channel_counter: int) -> bytes:
    """The 12-byte IV for one message: word 0 the message counter, words 1-2 the channel one."""
    if not 0 <= message_counter <= MAX_MESSAGE_COUNTER:
        raise CounterExhausted(f"message counter {message_counter} outside 0..{MAX_MESSAGE_COUNTER}")
    if not 0 <= channel_counter <= MAX_CHANNEL_COUNTER:
        raise CounterExhausted(f"channel counter {channel_counter} outside 0..2**64-1")
    return _IV_LAYOUT.pack(message_counter, channel_counter)


def gcm_nonce(iv: bytes, iv_mask: bytes) -> bytes:
    """The GCM nonce actually fed to AES-GCM: IV XOR the per-key mask."""
    if len(iv) != IV_BYTES or len(iv_mask) != IV_BYTES:
        raise BadInput(f"iv and iv_mask must both be {IV_BYTES} bytes")
    mixed = int.from_bytes(iv, "little") ^ int.from_bytes(iv_mask, "little")
    return mixed.to_bytes(IV_BYTES, "little")


# ----------------------------------------------------------------------------- keys
def _check_label(label: object) -> str:
    if not isinstance(label, str) or not label or not label.isascii() or not label.isprintable():
        raise BadInput("a channel label must be a non-empty printable ASCII string")
    return label


@dataclass(frozen=True)
class KeyMaterial:
    """Key and IV mask for one channel direction. Secrets are kept out of repr."""

    label: str
    key: bytes = field(repr=False)
    iv_mask: bytes = field(repr=False)

    def __post_init__(self) -> None:
        _check_label(self.label)
        object.__setattr__(self, "key", _exact_bytes(self.key, KEY_BYTES, "key"))
        object.__setattr__(self, "iv_mask", _exact_bytes(self.iv_mask, IV_BYTES, "iv_mask"))


def _exact_bytes(value: object, size: int, what: str) -> bytes:
    # The message names the field and the expected size, never the value.
    if not isinstance(value, (bytes, bytearray, memoryview)) or len(value) != size:
        raise BadInput(f"{what} must be {size} bytes")
    return bytes(value)


def _hkdf_expand(algorithm: hashes.HashAlgorithm, secret: bytes, info: bytes, length: int) -> bytes:
    """HKDF-Expand (RFC 5869 section 2.3); `secret` plays the role of the PRK."""
    return HKDFExpand(algorithm=algorithm, length=length, info=info).derive(secret)


def derive_epoch_keys(session_secret: bytes, epoch: int, labels: Iterable[str]) -> dict[str, KeyMaterial]:
    """Keys and IV masks for every label of one epoch. Not H100's ratchet, which anyone holding
    the old key can follow (every holder briefly does): each epoch comes from the SPDM session
    secret, which never leaves the orchestrator and the device."""
    if not isinstance(session_secret, (bytes, bytearray)) or len(session_secret) < MIN_SESSION_SECRET_BYTES:
        raise BadInput(f"session secret must be at least {MIN_SESSION_SECRET_BYTES} bytes")
    if not isinstance(epoch, int) or isinstance(epoch, bool) or not 0 <= epoch < 2**64:
        raise BadInput("epoch must be an integer in 0..2**64-1")
    sha256 = hashes.SHA256()
    epoch_secret = _hkdf_expand(sha256, bytes(session_secret), _EPOCH_INFO + epoch.to_bytes(8, "big"), 32)
    out: dict[str, KeyMaterial] = {}
    for label in labels:
        _check_label(label)
        if label.startswith(_RESERVED_LABEL_PREFIX):
            raise BadInput(f"channel labels may not start with {_RESERVED_LABEL_PREFIX!r}")
        raw = label.encode("ascii")
        out[label] = KeyMaterial(
            label=label,
            key=_hkdf_expand(sha256, epoch_secret, raw, KEY_BYTES),
            # H100 lets the GPU pick IV masks; we derive them so both ends agree without
            # another message, and bind them to the label so two labels never share one.
            iv_mask=_hkdf_expand(sha256, epoch_secret, _IVMASK_INFO + raw, IV_BYTES),
        )
    return out


# ----------------------------------------------------------------------------- state
class ChannelState(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag_field="t",
                   tag="crypto.channel_state"):
    """One direction of one channel as a context blob carries it (`message_counter`: the last
    used, 0 for none); configured as a codec Message, registered by driver/context.py."""

    label: str
    key: bytes  # secret: left out of repr
    iv_mask: bytes  # secret: left out of repr
    channel_counter: int
    message_counter: int

    def __post_init__(self) -> None:
        _check_label(self.label)
        force_setattr(self, "key", _exact_bytes(self.key, KEY_BYTES, "key"))
        force_setattr(self, "iv_mask", _exact_bytes(self.iv_mask, IV_BYTES, "iv_mask"))
        _check_counters(self.channel_counter, self.message_counter, MAX_MESSAGE_COUNTER)

    def __repr__(self) -> str:
        return (f"ChannelState(label={self.label!r}, channel_counter={self.channel_counter!r}, "
                f"message_counter={self.message_counter!r})")

    def __rich_repr__(self) -> list[tuple[str, object]]:  # a list, as msgspec.Struct's own
        return [("label", self.label), ("channel_counter", self.channel_counter),
                ("message_counter", self.message_counter)]


def _check_counters(channel_counter: int, message_counter: int, max_message_counter: int) -> None:
    for name, value in (("channel_counter", channel_counter), ("message_counter", message_counter)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise BadInput(f"{name} must be an int")
    if not 0 <= channel_counter <= MAX_CHANNEL_COUNTER:
        raise BadInput("channel_counter must be in 0..2**64-1")
    if not 0 <= message_counter <= max_message_counter:
        raise BadInput(f"message_counter must be in 0..{max_message_counter}")


def _check_max(max_message_counter: int) -> int:
    if not isinstance(max_message_counter, int) or not 1 <= max_message_counter <= MAX_MESSAGE_COUNTER:
        raise BadInput(f"max_message_counter must be in 1..{MAX_MESSAGE_COUNTER}")
    return max_message_counter


class _Endpoint:
    """Counter bookkeeping and the cached cipher shared by Sender and Receiver."""

    def __init__(self, keys: KeyMaterial, channel_counter: int = 1, message_counter: int = 0, *,
                 max_message_counter: int = MAX_MESSAGE_COUNTER) -> None:
        if not isinstance(keys, KeyMaterial):
            raise BadInput("keys must be a KeyMaterial")
        self._max = _check_max(max_message_counter)
        _check_counters(channel_counter, message_counter, self._max)
        self._keys = keys
        # Building AESGCM expands the key schedule; doing it per 1 MiB record is measurable.
        self._aead: _Aead = AESGCM(keys.key)  # type: ignore[assignment]  # its buffers' typing: see _Aead
        self._mask = int.from_bytes(keys.iv_mask, "little")
        self._channel = channel_counter
        self._message = message_counter

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(label={self._keys.label!r}, "
                f"channel_counter={self._channel}, message_counter={self._message})")

    @property
    def label(self) -> str:
        return self._keys.label

    @property
    def channel_counter(self) -> int:
        return self._channel

    @property
    def message_counter(self) -> int:
        return self._message

    def export_state(self) -> ChannelState:
        return ChannelState(label=self._keys.label, key=self._keys.key, iv_mask=self._keys.iv_mask,
                            channel_counter=self._channel, message_counter=self._message)

    @classmethod
    def from_state(cls, state: ChannelState, *, max_message_counter: int = MAX_MESSAGE_COUNTER) -> Self:
        if not isinstance(state, ChannelState):
            raise BadInput("state must be a ChannelState")
        keys = KeyMaterial(label=state.label, key=state.key, iv_mask=state.iv_mask)
        return cls(keys, state.channel_counter, state.message_counter, max_message_counter=max_message_counter)

    def _next_pair(self) -> tuple[int, int]:
        """(channel, message) counters of the next message, not committed. A spent message
        counter rolls the channel counter on (H100 errors instead): each key serves one channel
        and direction, so no IV can collide, and both ends apply the rule unsignalled."""
        if self._message < self._max:
            return self._channel, self._message + 1
        if self._channel >= MAX_CHANNEL_COUNTER:
            raise CounterExhausted(f"channel {self._keys.label!r}: IV space exhausted, re-key it")
        return self._channel + 1, 1

    def _nonce(self, channel_counter: int, message_counter: int) -> bytes:
        # gcm_nonce(build_iv(...), mask) without the intermediate objects.
        iv = message_counter | (channel_counter << 32)
        return (iv ^ self._mask).to_bytes(IV_BYTES, "little")


class Sender(_Endpoint):
    """Encrypts one direction of one channel, advancing the IV per message."""

    def encrypt_into(self, plaintext: Buffer, out: Buffer, aad: bytes | None = None) -> None:
        """Write ciphertext||tag into `out`, a writable buffer of len(plaintext) + 16 bytes."""
        self._seal("encrypt_into", lambda nonce: self._aead.encrypt_into(nonce, plaintext, aad, out))

    def encrypt(self, plaintext: Buffer, aad: bytes | None = None) -> bytes:
        return self._seal("encrypt", lambda nonce: self._aead.encrypt(nonce, plaintext, aad))

    def _seal(self, what: str, seal: Callable[[bytes], _T]) -> _T:
        channel, message = self._next_pair()
        try:
            sealed = seal(self._nonce(channel, message))
        except (ValueError, TypeError) as exc:
            raise BadInput(f"{what}: {exc}") from None
        self._channel, self._message = channel, message  # only once sealed
        return sealed


class Receiver(_Endpoint):
    """Decrypts one direction of one channel. The IV is tracked, never received, and advances only
    on success, so a replayed or reordered message keeps failing."""

    def decrypt(self, data: Buffer, aad: bytes | None = None) -> bytes:
        """Return the plaintext of ciphertext||tag `data`, or raise IntegrityError."""
        channel, message = self._next_pair()
        plaintext = self._open(channel, message, data, aad)
        self._channel, self._message = channel, message
        return plaintext

    def decrypt_into(self, data: Buffer, out: Buffer, aad: bytes | None = None) -> None:
        """Decrypt ciphertext||tag `data` into `out` (len(data) - 16 bytes). `out` must be private
        scratch: the backend writes plaintext before checking the tag, so on a forgery it briefly
        holds attacker-chosen bytes (zeroed before IntegrityError); copy onward only on success."""
        channel, message = self._next_pair()
        nonce = self._nonce(channel, message)
        try:
            self._aead.decrypt_into(nonce, data, aad, out)
        except InvalidTag:
            _zero(out)
            raise IntegrityError() from None
        except (ValueError, TypeError) as exc:
            raise BadInput(f"decrypt_into: {exc}") from None
        self._channel, self._message = channel, message

    def decrypt_once_into(self, data: SizedBuffer, out: SizedBuffer, piece: SizedBuffer,
                          aad: bytes | None = None) -> None:
        """:meth:`decrypt_into` for data others may rewrite meanwhile (a staging slot): each byte is
        read once, into the private ``piece`` buffer, and only those copies are checked and
        decrypted, so the bytes decrypted are the bytes the tag covers. ``out`` as decrypt_into."""
        nbytes = len(data) - TAG_BYTES
        src, dst, own = memoryview(data), memoryview(out), memoryview(piece)
        if nbytes < 0 or len(out) < nbytes or len(piece) == 0 or dst.readonly or own.readonly:
            raise BadInput("decrypt_once_into: data shorter than a tag, out too short or read-only, or no piece buffer")
        tag, (channel, message) = bytes(src[nbytes:]), self._next_pair()
        try:
            opener = Cipher(algorithms.AES(self._keys.key), modes.GCM(self._nonce(channel, message), tag)).decryptor()
            opener.authenticate_additional_data(aad or b"")
            for start in range(0, nbytes, len(own)):
                size = min(len(own), nbytes - start)
                own[:size] = src[start : start + size]
                opener.update_into(own[:size], dst[start : start + size])
            opener.finalize()
        except (InvalidTag, ValueError, TypeError) as exc:
            _zero(dst)  # whatever was decrypted into it is unverified
            if isinstance(exc, InvalidTag):
                raise IntegrityError() from None
            raise BadInput(f"decrypt_once_into: {exc}") from None
        except BaseException:
            _zero(dst)  # whatever else stopped it, no unverified plaintext stays behind
            raise
        self._channel, self._message = channel, message

    def accept_at(self, message_counter: int, channel_counter: int, data: Buffer, aad: bytes | None = None) -> bytes:
        """Decrypt a payload whose IV index is published beside it (semaphores, which the CPU may
        read at any time and miss updates of): only a strictly newer pair, so none replays."""
        pair = (channel_counter, message_counter)
        if not self._valid_published(channel_counter, message_counter) or pair <= (self._channel, self._message):
            raise IntegrityError()
        plaintext = self._open(channel_counter, message_counter, data, aad)
        self._channel, self._message = pair
        return plaintext

    def _valid_published(self, channel_counter: object, message_counter: object) -> bool:
        # A published index is remote input: out of range is an authentication failure, not misuse.
        return (
            type(channel_counter) is int
            and type(message_counter) is int
            and 0 <= channel_counter <= MAX_CHANNEL_COUNTER
            and 1 <= message_counter <= self._max
        )

    def _open(self, channel: int, message: int, data: Buffer, aad: bytes | None) -> bytes:
        try:
            return self._aead.decrypt(self._nonce(channel, message), data, aad)
        except InvalidTag:
            raise IntegrityError() from None
        except (ValueError, TypeError) as exc:
            raise BadInput(f"decrypt: {exc}") from None


def _zero(out: Buffer) -> None:
    """Best-effort wipe of a writable buffer (hygiene after a failed decrypt_into)."""
    view = memoryview(out).cast("B")
    view[:] = bytes(len(view))
