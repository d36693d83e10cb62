"""Pairwise keys between the GPU TEEs of a data-parallel job, from an ECDHE bound to both
ranks' attestation, to seal every ring hop:

1. each rank's TEE (the caller's `attest`) quotes `report_data` over its rank, the world size,
   the context and an ephemeral P-384 public key, and the ranks all-gather these `KeyShare`s;
2. each verifies every peer's evidence against the report data that peer must carry (the caller's
   `verify`): a swapped key, or evidence of another rank, group or job, fails;
3. every rank tells the others whom it refused (`KeyVerdict`), so that all stop together;
4. per pair, HKDF-SHA384 over the ECDH secret, both ranks, the world size, the context and both
   evidences' digests, then crypto/channel.derive_epoch_keys: one key per direction.
"""

from __future__ import annotations

import hashlib
import struct
import threading
from collections.abc import Callable, Mapping
from types import MappingProxyType

import torch
import torch.distributed as dist
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from gputravel.crypto.channel import KeyMaterial, Receiver, Sender, derive_epoch_keys
from gputravel.errors import BadInput, PeerAttestationError, ProtocolError
from gputravel.protocol.codec import decode, encode
from gputravel.protocol.ddp import KeyShare, KeyVerdict

__all__ = ["REPORT_DATA_BYTES", "Attest", "Exchange", "PairKeys", "Verify", "all_gather_bytes", "establish_pair_keys",
           "pair_label", "report_data"]

REPORT_DATA_BYTES = 48  # SHA-384; the caller fits it into its evidence (a quote has 64 bytes)
_REPORT_LABEL = b"gputravel ddp ring key v1\x00"
_PAIR_INFO = b"gputravel ddp pair secret v1\x00"
_CURVE = ec.SECP384R1()
_POINT = serialization.PublicFormat.UncompressedPoint
_X962 = serialization.Encoding.X962
_MAX_SHARE_BYTES = 1 << 20  # a key share is a point and a few KiB of evidence
_KEY_EPOCH = 0  # keys are fresh per establishment (ephemeral ECDH): one epoch is enough

Attest = Callable[[bytes], bytes]
"""`attest(report_data) -> evidence`: this rank's TEE quoting the 48-byte report data."""
Verify = Callable[[int, bytes, bytes], object]
"""`verify(peer_rank, evidence, report_data)`: raises, or answers False, to refuse the evidence."""
Exchange = Callable[[bytes], list[bytes]]
"""`exchange(mine) -> [rank 0's, rank 1's, ...]`: an all-gather of bytes (the test seam)."""


def report_data(rank: int, world_size: int, public_key: bytes, context: bytes = b"") -> bytes:
    """What the evidence of `rank` must carry for this public key, in this group and job."""
    _check_place(rank, world_size)
    if not isinstance(public_key, bytes) or not isinstance(context, bytes):
        raise BadInput("public key and context must be bytes")
    return hashlib.sha384(_REPORT_LABEL + struct.pack("<III", rank, world_size, len(context))
                          + context + public_key).digest()


def pair_label(sender: int, receiver: int) -> str:
    """The channel label of the direction sender -> receiver (an HKDF input: keep it stable)."""
    return f"Lddp_r{sender}_to_r{receiver}"


class PairKeys:
    """This rank's keys with every peer, one per direction. Secrets stay out of repr."""

    def __init__(self, rank: int, world_size: int, keys: Mapping[tuple[int, int], KeyMaterial],
                 evidence_digests: tuple[bytes, ...]) -> None:
        _check_place(rank, world_size)
        self.rank, self.world_size = rank, world_size
        self._keys = MappingProxyType(dict(keys))
        self.evidence_digests = evidence_digests  # SHA-384 of each rank's evidence, by rank
        self._claimed: set[tuple[int, int]] = set()
        self._claim_lock = threading.Lock()  # two threads must not both pass the check below

    def __repr__(self) -> str:
        return f"PairKeys(rank={self.rank}, world_size={self.world_size}, pairs={sorted(self._keys)})"

    @property
    def pairs(self) -> tuple[tuple[int, int], ...]:
        return tuple(sorted(self._keys))

    def material(self, sender: int, receiver: int) -> KeyMaterial:
        """The key of direction sender -> receiver; this rank must be one of the two."""
        try:
            return self._keys[(sender, receiver)]
        except KeyError:
            raise BadInput(f"rank {self.rank} holds no key for {sender} -> {receiver}") from None

    def sender(self, to: int) -> Sender:
        """The Sender of this rank -> `to`; handed out once (see `_claim`)."""
        return Sender(self._claim(self.rank, to))

    def receiver(self, source: int) -> Receiver:
        """The Receiver of `source` -> this rank, which tracks the IVs it expects; handed out once."""
        return Receiver(self._claim(source, self.rank))

    def _claim(self, sender: int, receiver: int) -> KeyMaterial:
        # Every Sender starts at the same IV: a second one on a key would reuse GCM nonces.
        keys = self.material(sender, receiver)
        with self._claim_lock:
            if (sender, receiver) in self._claimed:
                raise BadInput(f"the key {sender} -> {receiver} already serves a channel; establish new keys")
            self._claimed.add((sender, receiver))
        return keys


def establish_pair_keys(attest: Attest, verify: Verify, *, group: dist.ProcessGroup | None = None,
                        context: bytes, exchange: Exchange | None = None) -> PairKeys:
    """Run steps 1-4 above with every rank of `group` (collective). `context` names this job, group
    and establishment, so the wire cannot pair ranks of two jobs. A rank that refuses a peer raises
    PeerAttestationError; the verdicts are unauthenticated, so a hostile wire can only hide one (the
    others' ring then times out): liveness, never a key shared with a refused peer."""
    if not isinstance(context, bytes) or not context:
        raise BadInput("context must be non-empty bytes naming this job and group")
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    gather = exchange if exchange is not None else (lambda mine: all_gather_bytes(mine, group))
    private = ec.generate_private_key(_CURVE)
    public = private.public_key().public_bytes(_X962, _POINT)
    evidence = attest(report_data(rank, world_size, public, context))
    if not isinstance(evidence, bytes):
        raise BadInput("attest must return the evidence as bytes")
    shares = gather(encode(KeyShare(rank, world_size, public, evidence)))
    if len(shares) != world_size:
        raise BadInput(f"exchange returned {len(shares)} shares for a group of {world_size}")

    peers: dict[int, tuple[ec.EllipticCurvePublicKey, bytes]] = {}
    refused: dict[int, str] = {}
    for peer, data in enumerate(shares):
        if peer == rank:
            continue
        try:
            peers[peer] = _accept(peer, world_size, data, context, verify)
        except _Refused as why:
            refused[peer] = str(why)

    verdicts = gather(encode(KeyVerdict(rank, tuple(sorted(refused)))))
    _stop_if_refused(rank, refused, verdicts)

    digests = tuple(hashlib.sha384(evidence if peer == rank else peers[peer][1]).digest()
                    for peer in range(world_size))
    keys: dict[tuple[int, int], KeyMaterial] = {}
    for peer, (peer_key, _) in peers.items():
        secret = _pair_secret(private.exchange(ec.ECDH(), peer_key), rank, peer, world_size, context, digests)
        lo, hi = min(rank, peer), max(rank, peer)
        derived = derive_epoch_keys(secret, _KEY_EPOCH, [pair_label(lo, hi), pair_label(hi, lo)])
        keys[(lo, hi)] = derived[pair_label(lo, hi)]
        keys[(hi, lo)] = derived[pair_label(hi, lo)]
    return PairKeys(rank, world_size, keys, digests)


class _Refused(Exception):
    """Internal: why one peer's share was refused (a reason safe to print)."""


def _accept(peer: int, world_size: int, data: bytes, context: bytes,
            verify: Verify) -> tuple[ec.EllipticCurvePublicKey, bytes]:
    """The peer's public key and evidence, if its share verifies for its place; else _Refused."""
    try:
        share = decode(data, expect=KeyShare)
    except ProtocolError:
        raise _Refused("its key share could not be decoded") from None
    if share.rank != peer or share.world_size != world_size:
        raise _Refused(f"its key share claims rank {share.rank} of {share.world_size}")
    try:
        key = ec.EllipticCurvePublicKey.from_encoded_point(_CURVE, share.public_key)
    except ValueError:
        raise _Refused("its public key is not a P-384 point") from None
    expected = report_data(peer, world_size, share.public_key, context)
    try:
        if verify(peer, share.evidence, expected) is False:  # a verifier that answers instead of raising
            raise ValueError("the verifier answered False")
    except Exception as err:  # the verifier's refusal, whatever its type, refuses the peer
        claim = getattr(err, "claim", None)  # an AttestationError names the failed claim
        raise _Refused(f"its evidence was refused ({type(err).__name__}"
                       f"{f': {claim}' if claim else ''})") from None
    return key, share.evidence


def _stop_if_refused(rank: int, refused: dict[int, str], verdicts: list[bytes]) -> None:
    pairs: list[tuple[int, int]] = [(rank, peer) for peer in sorted(refused)]
    for who, data in enumerate(verdicts):
        if who == rank:
            continue
        try:
            verdict = decode(data, expect=KeyVerdict)
        except ProtocolError:
            verdict = KeyVerdict(who, (rank,))  # an undecodable verdict stops the job too
        pairs.extend((who, int(peer)) for peer in verdict.refused)
    if refused:
        reasons = "; ".join(f"rank {peer}: {why}" for peer, why in sorted(refused.items()))
        raise PeerAttestationError(f"rank {rank} refused {reasons}", refused=tuple(sorted(pairs)))
    if pairs:
        listed = ", ".join(f"rank {a} refused rank {b}" for a, b in sorted(pairs))
        raise PeerAttestationError(f"no keys: {listed}", refused=tuple(sorted(pairs)))


def _pair_secret(shared: bytes, rank: int, peer: int, world_size: int, context: bytes,
                 digests: tuple[bytes, ...]) -> bytes:
    # Both ends must build the same info, so the pair is ordered (low rank first).
    lo, hi = min(rank, peer), max(rank, peer)
    info = (_PAIR_INFO + struct.pack("<IIII", lo, hi, world_size, len(context)) + context
            + digests[lo] + digests[hi])
    return HKDF(algorithm=hashes.SHA384(), length=48, salt=None, info=info).derive(shared)


def _check_place(rank: object, world_size: object) -> None:
    if type(rank) is not int or type(world_size) is not int or not 0 <= rank < world_size < 2**32:
        raise BadInput("rank must be in 0..world_size-1")


def all_gather_bytes(mine: bytes, group: dist.ProcessGroup | None = None) -> list[bytes]:
    """Every rank's bytes, by rank: lengths first, then the padded payloads (no pickle)."""
    if len(mine) > _MAX_SHARE_BYTES:
        raise BadInput(f"a key-exchange message is limited to {_MAX_SHARE_BYTES} bytes")
    world_size = dist.get_world_size(group)
    sizes = [torch.empty(1, dtype=torch.int64) for _ in range(world_size)]
    dist.all_gather(sizes, torch.tensor([len(mine)], dtype=torch.int64), group=group)
    lengths = [int(s) for s in sizes]
    if not all(0 <= n <= _MAX_SHARE_BYTES for n in lengths):
        raise ProtocolError("a peer announced a key-exchange message of an impossible size")
    longest = max(lengths)
    padded = torch.zeros(longest, dtype=torch.uint8)
    if mine:
        padded[: len(mine)] = torch.frombuffer(bytearray(mine), dtype=torch.uint8)
    rows = [torch.empty(longest, dtype=torch.uint8) for _ in range(world_size)]
    dist.all_gather(rows, padded, group=group)
    return [row[:n].numpy().tobytes() for row, n in zip(rows, lengths, strict=True)]
