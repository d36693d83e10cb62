"""Pairwise keys between the ranks of a data-parallel job (ddp/keys.py), bound to real emulated
TDX quotes (attest/quote.py): each rank's quote must carry its own ECDH public key, rank,
world size and job, or every rank refuses to start.
"""

from __future__ import annotations

import hashlib

import pytest
import torch
import torch.distributed as dist
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from gputravel.attest import Authority
from gputravel.attest.quote import EmulatedRankTee
from gputravel.attest.roots import TEE_QUOTING_ROOT_CN
from gputravel.crypto.certs import key_pem
from gputravel.ddp import PairKeys, Ring, establish_pair_keys, pair_label, report_data
from gputravel.ddp.keys import REPORT_DATA_BYTES, _accept, _Refused, all_gather_bytes
from gputravel.errors import BadInput, PeerAttestationError
from gputravel.protocol.codec import decode, encode
from gputravel.protocol.ddp import KeyShare

MEASURED = b"\x07" * 48  # the rank CVMs' measurement, as the verifier accepts it
CONTEXT = b"job 42"


# ----------------------------------------------------------------------------- in one process
def test_the_report_data_names_the_rank_the_group_the_job_and_the_key() -> None:
    key = b"\x04" + b"\x01" * 96
    base = report_data(0, 3, key, CONTEXT)
    assert len(base) == REPORT_DATA_BYTES and base == report_data(0, 3, key, CONTEXT)
    others = [report_data(1, 3, key, CONTEXT), report_data(0, 4, key, CONTEXT),
              report_data(0, 3, key[:-1] + b"\x02", CONTEXT), report_data(0, 3, key, b"job 43")]
    assert len({base, *others}) == 5
    with pytest.raises(BadInput):
        report_data(3, 3, key)
    assert pair_label(0, 1) != pair_label(1, 0)


# ----------------------------------------------------------------------------- ranks
def Tee(root_cert: bytes, root_key: bytes, foreign: bool = False) -> EmulatedRankTee:
    """A rank's CVM; a foreign one's quoting key chains to a root nobody trusts."""
    root = Authority(root_cert, serialization.load_pem_private_key(root_key, password=None))
    return EmulatedRankTee(Authority.self_signed(TEE_QUOTING_ROOT_CN) if foreign else root, root_cert, MEASURED)


def _rewrite(share: bytes, **changes) -> bytes:
    old = decode(share, expect=KeyShare)
    fields = {f: getattr(old, f) for f in KeyShare.__struct_fields__} | changes
    return encode(KeyShare(**fields))


def _attacker_key() -> bytes:
    key = ec.generate_private_key(ec.SECP384R1()).public_key()
    return key.public_bytes(serialization.Encoding.X962, serialization.PublicFormat.UncompressedPoint)


def _on_the_wire(rank: int, victim: int, attack):
    """An exchange in which whoever sits on the wire rewrites what `victim` receives in the
    first round (the key shares)."""
    rounds = []

    def exchange(mine: bytes) -> list[bytes]:
        shares = all_gather_bytes(mine)
        rounds.append(1)
        if rank == victim and len(rounds) == 1:
            shares = attack(shares)
        return shares
    return exchange


def key_exchanges(rank: int, world: int, root_cert: bytes, root_key: bytes) -> dict:
    tee = Tee(root_cert, root_key)
    out: dict = {}

    keys = establish_pair_keys(tee.attest, tee.verify, context=CONTEXT)
    out["fingerprints"] = {f"{a}->{b}": hashlib.sha256(keys.material(a, b).key + keys.material(a, b).iv_mask).hexdigest()
                           for a, b in keys.pairs}
    out["secrets"] = [keys.material(a, b).key.hex() for a, b in keys.pairs] + \
                     [keys.material(a, b).iv_mask.hex() for a, b in keys.pairs]
    out["digests"] = keys.evidence_digests
    ring = Ring("pipelined", keys=keys, record_bytes=4096)
    with pytest.raises(BadInput, match="already serves a channel"):
        keys.sender((rank + 1) % world)  # a second Sender on one key would reuse its IVs
    x = torch.randn(10_000, generator=torch.Generator().manual_seed(rank))
    expected = x.clone()
    dist.all_reduce(expected)
    assert torch.allclose(ring.all_reduce(x), expected, rtol=1e-5, atol=1e-5)
    out["reprs"] = [repr(keys), repr(ring), repr(keys.material(*keys.pairs[0])), repr(ring._sender),
                    repr(ring._receiver), repr(ring._sender.export_state())]

    attacks = {
        # Swap rank 0's public key for the attacker's; keep rank 0's genuine quote.
        "mitm": (1, lambda s: [_rewrite(s[0], public_key=_attacker_key()), *s[1:]]),
        # Rank 2's genuine share, relabelled as rank 0's: a quote made for another place.
        "another rank's quote": (1, lambda s: [_rewrite(s[2], rank=0), *s[1:]]),
        "garbage": (2, lambda s: [b"\x00garbage", *s[1:]]),
    }
    out["refusals"] = {}
    for name, (victim, attack) in attacks.items():
        with pytest.raises(PeerAttestationError) as err:
            establish_pair_keys(tee.attest, tee.verify, context=CONTEXT, exchange=_on_the_wire(rank, victim, attack))
        out["refusals"][name] = (str(err.value), err.value.refused)

    # Rank 2 runs in a TEE whose quoting key does not chain to the trusted root.
    rogue = Tee(root_cert, root_key, foreign=rank == 2)
    with pytest.raises(PeerAttestationError) as err:
        establish_pair_keys(rogue.attest, rogue.verify, context=CONTEXT)
    out["refusals"]["untrusted TEE"] = (str(err.value), err.value.refused)

    # Rank 2 was launched for another job: its quote binds another context.
    with pytest.raises(PeerAttestationError) as err:
        establish_pair_keys(tee.attest, tee.verify, context=b"job 43" if rank == 2 else CONTEXT)
    out["refusals"]["another job"] = (str(err.value), err.value.refused)
    return out


@pytest.fixture(scope="module")
def tee_root() -> tuple[bytes, bytes]:
    root = Authority.self_signed(TEE_QUOTING_ROOT_CN)
    return root.cert_der, key_pem(root.key)


def test_attested_pair_keys_refuse_a_swapped_key_and_every_evidence_out_of_place(run_ranks, tee_root) -> None:
    results = run_ranks(key_exchanges, 3, *tee_root, timeout=60)

    # Each end of each direction holds the same key; all six directions differ.
    by_pair: dict[str, set[str]] = {}
    for r in results:
        for pair, fingerprint in r["fingerprints"].items():
            by_pair.setdefault(pair, set()).add(fingerprint)
    assert sorted(by_pair) == ["0->1", "0->2", "1->0", "1->2", "2->0", "2->1"]
    assert all(len(f) == 1 for f in by_pair.values())
    assert len({f for fs in by_pair.values() for f in fs}) == 6
    assert results[0]["digests"] == results[1]["digests"] == results[2]["digests"]

    # MITM: rank 1 refuses rank 0's key (its quote does not carry it); the others learn of it.
    mitm = [r["refusals"]["mitm"] for r in results]
    assert "rank 1 refused rank 0" in mitm[1][0] and "binding" in mitm[1][0]
    assert all(refused == ((1, 0),) for _, refused in mitm)
    assert all("no keys" in message for message, _ in (mitm[0], mitm[2]))
    assert all(r["refusals"]["another rank's quote"][1] == ((1, 0),) for r in results)
    assert "binding" in results[1]["refusals"]["another rank's quote"][0]
    assert all(r["refusals"]["garbage"][1] == ((2, 0),) for r in results)
    assert "could not be decoded" in results[2]["refusals"]["garbage"][0]
    untrusted = [r["refusals"]["untrusted TEE"] for r in results]
    assert all(refused == ((0, 2), (1, 2)) for _, refused in untrusted)
    assert "chain" in untrusted[0][0]
    assert all({(0, 2), (1, 2)} <= set(r["refusals"]["another job"][1]) for r in results)

    # No key or IV mask in any repr or error message.
    said = " ".join([*(s for r in results for s in r["reprs"]),
                     *(m for r in results for m, _ in r["refusals"].values())])
    assert "PairKeys(rank=0, world_size=3" in said
    for secret in (s for r in results for s in r["secrets"]):
        assert secret not in said and secret[:16] not in said


def test_pair_keys_keep_secrets_out_of_repr_and_hand_each_direction_out_once() -> None:
    from gputravel.crypto.channel import KeyMaterial

    material = KeyMaterial(pair_label(0, 1), b"\x11" * 32, b"\x22" * 12)
    keys = PairKeys(0, 2, {(0, 1): material, (1, 0): material}, (b"a", b"b"))
    assert "11" * 4 not in repr(keys) and "22" * 4 not in repr(keys)
    keys.sender(1)
    with pytest.raises(BadInput):
        keys.sender(1)
    with pytest.raises(BadInput, match="no key"):
        keys.material(1, 1)


def test_a_job_must_name_itself_and_a_verifier_that_answers_false_refuses() -> None:
    """Without a context, evidence made for one job would pass in every job of the same size
    (the wire could pair ranks of two jobs); a verifier returning False must not mean yes."""
    with pytest.raises(BadInput, match="non-empty"):
        establish_pair_keys(lambda d: d, lambda *a: None, context=b"")
    key = _attacker_key()
    share = encode(KeyShare(rank=1, world_size=2, public_key=key, evidence=b"junk"))
    with pytest.raises(_Refused, match="refused"):
        _accept(1, 2, share, CONTEXT, lambda *a: False)
    _accept(1, 2, share, CONTEXT, lambda *a: None)  # control: a verifier that does not raise accepts
