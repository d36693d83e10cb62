"""Integration (real processes): the published travel log does not confirm a guessed chunk.

An outside audit recomputed every chunk digest of a demo's log from the shipped plays,
tokenised with the project's own loader: all matched, naming holder and offset. Now each entry
holds the digest keyed with its holder's travel-log key, which the holder made in its own pki
directory and sent only in its hello; the same guess matches nothing, and the holder, with
its key and its data, still checks every entry of its own.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from gputravel.cohort.config import CohortConfig, HolderSpec
from gputravel.cohort.local import Cohort
from gputravel.data.holder_tokens import load_tokens
from gputravel.data.shakespeare import shakespeare_holders
from gputravel.holder.log_key import LOG_KEY_FILE, own_log_key, read_log_key
from gputravel.jobs.training import layout_for
from gputravel.orchestrator.audit import AuditEvent, mismatched_chunks, verify_log
from gputravel.protocol.manifest import PIECE_BYTES, chunk_digest

pytestmark = pytest.mark.integration
BUFFER = 64 << 10  # the demo's dataset buffer


def test_a_guessed_chunk_matches_no_published_entry_but_its_holder_checks_its_own(processes, tmp_path: Path) -> None:
    plays = shakespeare_holders()["comedies"]
    layout = layout_for(BUFFER)
    piece = min(PIECE_BYTES, layout.record_bytes)
    cfg = CohortConfig(holders=(HolderSpec("comedies", str(plays), "tokens"),), buffer_bytes=BUFFER, layout=layout,
                       audit_log=str(tmp_path / "audit.log"))
    with Cohort(cfg) as cohort:
        size = cohort.dataset_bytes["comedies"]
        offsets = list(range(0, size, BUFFER))
        reports = [cohort.travel("comedies", offset) for offset in offsets]
        pki = cohort.dir / "pki" / "comedies"
        key = read_log_key(pki)
        assert stat.S_IMODE(os.stat(pki / LOG_KEY_FILE).st_mode) == 0o600
        # Never in a file of the cohort but its own (the parties' logs included), nor in the log.
        for path in cohort.dir.rglob("*"):
            if path.is_file() and path.name != LOG_KEY_FILE:
                body = path.read_bytes()
                assert key not in body and key.hex().encode() not in body, path
        cert = cohort.orchestrator_certificate()
    # The auditor's guess: the public plays, tokenised as the holder does, chunked as travels go.
    tokens = load_tokens(plays).tokens.astype("<u2").tobytes()
    assert len(tokens) == size and len(offsets) >= 2
    guessed = [chunk_digest(tokens[o:o + BUFFER], piece) for o in offsets]
    assert [r.chunk.digest for r in reports] == guessed  # the guess is right: the orchestrator saw these
    published = (tmp_path / "audit.log").read_bytes()
    entries = verify_log(tmp_path / "audit.log", cert, "comedies").entries
    assert [e.event for e in entries] == [AuditEvent.TRAVEL] * len(offsets)
    assert not any(e.chunk_mac == d for e in entries for d in guessed)
    assert not any(d in published for d in guessed) and key not in published
    # What the log still says to anyone: holder, offset, size and time.
    assert [(e.holder, e.chunk.dataset_offset, e.chunk.nbytes) for e in entries] == \
        [("comedies", o, min(BUFFER, size - o)) for o in offsets]
    # The holder checks its own entries with its key and its data; another key checks nothing.
    digest_of = lambda o, n: chunk_digest(tokens[o:o + n], piece)  # noqa: E731
    assert mismatched_chunks(entries, key, digest_of) == ()
    assert mismatched_chunks(entries, os.urandom(32), digest_of) == tuple(e.seq for e in entries)


def test_a_holder_keeps_its_travel_log_key_across_restarts(tmp_path: Path) -> None:
    """Made once, whole (0600), and the same key after a restart or a rejoin: the holder's
    earlier entries stay checkable, and every hello carries it again (a restarted orchestrator
    has it back as soon as the holder rejoins)."""
    first = own_log_key(tmp_path)
    assert len(first) == 32 and own_log_key(tmp_path) == first == read_log_key(tmp_path)
    assert stat.S_IMODE(os.stat(tmp_path / LOG_KEY_FILE).st_mode) == 0o600
    assert [p.name for p in tmp_path.iterdir()] == [LOG_KEY_FILE]  # no temporary file left behind
    (tmp_path / "other").mkdir()
    assert own_log_key(tmp_path / "other") != first  # each holder its own
    (tmp_path / LOG_KEY_FILE).write_bytes(first[:7])
    from gputravel.errors import BadInput

    with pytest.raises(BadInput, match="is not a travel-log key") as err:
        own_log_key(tmp_path)  # a damaged key is never silently replaced
    assert first[:7].hex() not in str(err.value)
