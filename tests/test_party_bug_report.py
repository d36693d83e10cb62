"""A party's bug (an exception of no type of ours) is logged and reported without its message: the
party's log goes to the launcher, which the host runs, and its tail is quoted in the launcher's
errors; a library's message may quote a holder's record ("Target 12 is out of bounds") or a secret."""

from __future__ import annotations

import json
import socket
import struct
from pathlib import Path

import numpy as np

import pytest

from gputravel.cohort.entry import run_party
from gputravel.data.records import RecordSchema, load_records, write_records
from gputravel.errors import BadInput, PeerTimeout, bug_report
from gputravel.protocol.control import Failed
from gputravel.transport.stream import StreamTransport

CANARY = "holder-record-7f3a9c"


def _party(serve_role) -> tuple[int, Failed]:
    ours, theirs = socket.socketpair()
    code = run_party(["holder", json.dumps({}), str(theirs.detach())], serve_role)
    reply = StreamTransport(ours, "launcher").recv(timeout=5).message
    assert isinstance(reply, Failed)
    return code, reply


def test_a_partys_bug_is_logged_and_reported_by_type_and_place_never_by_its_message(capsys) -> None:
    def serve_role(role, payload, control, extra) -> None:
        try:
            raise KeyError(CANARY + "-cause")
        except KeyError as cause:
            raise ValueError(f"invalid literal for int(): {CANARY!r}") from cause

    code, reply = _party(serve_role)
    log = capsys.readouterr()
    assert code == 1
    assert CANARY not in log.err + log.out and CANARY not in reply.reason
    assert "ValueError at gputravel/" in log.err and "in serve_role" in log.err  # still a traceback to debug
    assert reply.kind == "RemoteError" and reply.reason.startswith("failed (a bug): ValueError at gputravel/")


def test_a_typed_error_keeps_its_words_they_are_ours() -> None:
    def serve_role(role, payload, control, extra) -> None:
        raise PeerTimeout("the holder did not answer in 5 s")

    code, reply = _party(serve_role)
    assert code == 1 and (reply.kind, reply.reason) == ("PeerTimeout", "the holder did not answer in 5 s")


def test_an_interrupt_is_not_a_bug() -> None:
    def serve_role(role, payload, control, extra) -> None:
        raise KeyboardInterrupt

    ours, theirs = socket.socketpair()
    with pytest.raises(KeyboardInterrupt):
        run_party(["holder", json.dumps({}), str(theirs.detach())], serve_role)
    ours.close()


def test_the_bug_report_names_an_exception_of_other_code_without_its_type() -> None:
    class Leaky(Exception):  # its name could be anything a library chose
        pass

    try:
        raise Leaky(CANARY)
    except Leaky as exc:
        report = bug_report(exc)
    assert CANARY not in report and "Leaky" not in report.splitlines()[-1]
    assert report.splitlines()[-1].startswith("an exception of other code")


def test_a_records_file_whose_header_runs_into_its_records_is_refused_without_quoting_them(tmp_path: Path) -> None:
    # numpy quotes the whole header it failed to parse; a wrong length runs it into the records.
    schema = RecordSchema.parse("text: uint8[32]; label: int64[]")
    records = np.zeros(4, dtype=schema.dtype)
    records["text"] = np.frombuffer(CANARY.encode().ljust(32, b" ") * 4, dtype=np.uint8).reshape(4, 32)
    write_records(tmp_path / "data", schema, records)
    npy = tmp_path / "data" / "records.npy"
    raw = bytearray(npy.read_bytes())
    struct.pack_into("<H", raw, 8, struct.unpack_from("<H", raw, 8)[0] + 100)
    npy.write_bytes(bytes(raw))
    with pytest.raises(BadInput, match=r"records\.npy is not a readable \.npy file \(ValueError\)") as info:
        load_records(tmp_path / "data")
    assert CANARY not in str(info.value)
