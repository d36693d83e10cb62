"""A data-parallel rank's check on its peers (attest/rank.py): a peer's quote must chain to a
root this CVM trusts, bind the report data its place in the group requires, and name this
CVM's own measurement, as its own TDX module quoted it."""

from __future__ import annotations

import os

import pytest

from gputravel.attest import AttestationError, Authority, EmulatedQuotingEnclave, TrustStore
from gputravel.attest.rank import QuotingRankTee
from gputravel.attest.roots import TEE_QUOTING_ROOT_CN
from gputravel.errors import BadInput

ROOT = Authority.self_signed(TEE_QUOTING_ROOT_CN)
OURS = bytes(range(48))


def module(root: Authority = ROOT, measurement: bytes = OURS):
    """A TDX module: report data in, a quote of `measurement` out."""
    enclave = EmulatedQuotingEnclave.provision(root)
    return lambda report_data: enclave.quote(measurement, report_data)


def rank_tee(quote=None) -> QuotingRankTee:
    return QuotingRankTee(quote or module(), TrustStore((), (ROOT.cert_der,)))


def test_a_peer_on_the_same_code_and_roots_is_accepted_for_its_own_report_data():
    me, peer = rank_tee(), rank_tee()
    me.attest(b"mine")
    data = os.urandom(48)
    me.verify(1, peer.attest(data), data)
    with pytest.raises(AttestationError):
        me.verify(1, peer.attest(data), os.urandom(48))  # evidence made for another place


def test_a_peer_with_another_measurement_or_an_untrusted_root_is_refused():
    me = rank_tee()
    me.attest(b"mine")
    data = b"place of rank 1"
    other_code = module(measurement=bytes(48))
    with pytest.raises(AttestationError, match="measurement"):
        me.verify(1, other_code(data + bytes(64 - len(data))), data)
    foreign = module(root=Authority.self_signed(TEE_QUOTING_ROOT_CN))  # same name, another key
    with pytest.raises(AttestationError):
        me.verify(1, foreign(data + bytes(64 - len(data))), data)


def test_a_rank_verifies_nothing_before_its_module_quoted_it_nor_trusts_a_module_outside_its_roots():
    with pytest.raises(BadInput, match="only after"):
        rank_tee().verify(1, b"anything", b"data")
    with pytest.raises(AttestationError):  # its own module's key chains to a root it does not trust
        rank_tee(module(root=Authority.self_signed(TEE_QUOTING_ROOT_CN))).attest(b"mine")
