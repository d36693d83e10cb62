"""A party's bug (an exception of no type of ours) is logged and reported without its message: the
party's log goes to the launcher, which the host runs, and its tail is quoted in the launcher's
errors; a library's message may quote a holder's record ("Target 12 is out of bounds") or a secret."""

from __future__ import annotations

import gc
import json
import logging
import signal
import socket
import struct
import sys
import threading
import warnings
from pathlib import Path

import numpy as np

import pytest

from gputravel.cohort import entry
from gputravel.cohort.entry import log_failures_safely, run_party
from gputravel.data.holder_tokens import load_tokens
from gputravel.data.records import RecordSchema, load_records, write_records
from gputravel.data.shards import write_shard
from gputravel.data.tokenizer import read_tokenizer_record
from gputravel.errors import BadInput, PeerTimeout, failed_where, named_type, safe_traceback
from gputravel.protocol.control import Failed
from gputravel.transport.stream import StreamTransport

CANARY = "holder-record-7f3a9c"


@pytest.fixture(autouse=True)
def _hooks(monkeypatch):
    """run_party sets this process's hooks and SIGINT's handler: each test puts pytest's back."""
    for where, name in ((sys, "excepthook"), (threading, "excepthook"), (sys, "unraisablehook"),
                        (logging, "lastResort"), (logging, "raiseExceptions"), (warnings, "showwarning")):
        monkeypatch.setattr(where, name, getattr(where, name))
    ours = logging.getLogger("gputravel")
    monkeypatch.setattr(ours, "handlers", list(ours.handlers))
    monkeypatch.setattr(ours, "propagate", ours.propagate)
    interrupt = signal.getsignal(signal.SIGINT)
    yield
    signal.signal(signal.SIGINT, interrupt)


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


def test_a_typed_errors_chain_is_logged_with_ours_in_words_and_the_rest_by_type(capsys) -> None:
    def serve_role(role, payload, control, extra) -> None:
        try:
            int(CANARY)
        except ValueError as exc:
            exc.add_note(CANARY + " note")
            try:
                raise BadInput("the dataset is not records") from exc
            finally:
                raise PeerTimeout("the host did not switch the GPU back")  # raised while handling both

    code, reply = _party(serve_role)
    log = capsys.readouterr().err
    assert code == 1 and CANARY not in log and (reply.kind, reply.reason) == ("PeerTimeout",
                                                                           "the host did not switch the GPU back")
    assert "ValueError (its message withheld" in log and "BadInput: the dataset is not records" in log
    assert log.index("ValueError (") < log.index("direct cause") < log.index("BadInput:") < log.index(
        "During handling") < log.index("PeerTimeout:")


def test_an_interrupt_while_the_failure_is_said_does_not_carry_it(monkeypatch) -> None:
    def interrupted(self, message) -> None:
        raise KeyboardInterrupt  # the host signals the party while it reports

    def serve_role(role, payload, control, extra) -> None:
        raise ValueError(CANARY)

    monkeypatch.setattr(entry.StreamTransport, "send", interrupted)
    ours, theirs = socket.socketpair()
    with pytest.raises(KeyboardInterrupt) as info:
        run_party(["holder", json.dumps({}), str(theirs.detach())], serve_role)
    ours.close()
    assert info.value.__context__ is None  # Python's own printer would have printed the ValueError


def test_a_threads_and_a_finalizers_exceptions_are_printed_safely(capsys) -> None:
    class Leaky:
        def __del__(self) -> None:
            raise ValueError(CANARY)

    log_failures_safely()
    thread = threading.Thread(target=lambda: int(CANARY))
    thread.start()
    thread.join()
    leaky = Leaky()
    del leaky
    gc.collect()
    sys.excepthook(ValueError, ValueError(CANARY), None)
    log = capsys.readouterr().err
    assert CANARY not in log
    assert "in a thread: Traceback" in log and "an exception was ignored: Traceback" in log
    assert log.count("ValueError (its message withheld") == 3


def test_a_report_reads_no_source_and_names_only_a_type_that_is_what_it_claims() -> None:
    class Leaky(Exception):
        pass

    class Claims(Exception):  # a name and module of its code's choosing
        pass

    Claims.__module__, Claims.__qualname__, Claims.__name__ = "builtins", "ValueError", "ValueError"
    for cls in (Leaky, Claims):
        try:
            raise cls(CANARY)
        except cls as exc:
            report, named = safe_traceback(exc), named_type(exc)
        assert CANARY not in report and "raise cls" not in report  # no line of source: it is read when printed
        assert report.splitlines()[-1].startswith("an exception of other code (its message withheld")
        assert named is None
    Claims.__module__ = 5  # type: ignore[assignment]
    assert failed_where(Claims(CANARY)) == "an exception of other code"
    assert named_type(ValueError()) == "ValueError" and named_type(np.linalg.LinAlgError()) == "LinAlgError"


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


def test_a_typed_error_of_other_arguments_than_words_is_shown_by_its_type(capsys) -> None:
    def serve_role(role, payload, control, extra) -> None:
        raise BadInput(np.frombuffer(CANARY.encode(), dtype=np.uint8))  # str() would print the values

    code, reply = _party(serve_role)
    log = capsys.readouterr().err
    assert code == 1 and "BadInput (its arguments withheld)" in log and (reply.kind, reply.reason) == ("BadInput", "")
    assert CANARY not in log and not any(str(b) in log for b in CANARY.encode()[:3])


def test_a_string_exit_is_not_printed(capsys) -> None:
    def serve_role(role, payload, control, extra) -> None:
        sys.exit(f"cannot parse record {CANARY}")  # Python prints such a code past every hook

    code, reply = _party(serve_role)
    assert code == 1 and reply.reason == "exited with a message" and CANARY not in capsys.readouterr().err


def test_the_hooks_are_total_sigint_is_no_interrupt_and_logging_and_warnings_say_no_values(capsys,
                                                                                          monkeypatch) -> None:
    log_failures_safely()
    assert signal.getsignal(signal.SIGINT) is signal.SIG_DFL
    try:
        raise ValueError(CANARY)
    except ValueError as exc:  # a library's record where no handler is configured (pytest configures one)
        record = logging.getLogger("concurrent.futures").makeRecord(
            "concurrent.futures", logging.ERROR, __file__, 1, "exception calling callback for %r", (CANARY,),
            (ValueError, exc, exc.__traceback__))
        logging.lastResort.handle(record)
    assert logging.raiseExceptions is False  # a record that fails to format is dropped, its arguments unprinted
    # gputravel's own records keep their words, as the last resort printed them (the red team reads them).
    logging.getLogger("gputravel.orchestrator.cvm").warning("recovery rotation failed (%s: %s)", "PeerTimeout",
                                                            "the device did not answer")
    warnings.warn(CANARY, UserWarning, stacklevel=1)

    def broken(exc):
        raise RuntimeError("the printer failed")

    monkeypatch.setattr(entry, "safe_traceback", broken)
    sys.excepthook(ValueError, ValueError(CANARY), None)  # Python's fallback would print the original
    log = capsys.readouterr().err
    assert CANARY not in log
    assert "ERROR concurrent.futures: exception calling callback for %r" in log and "ValueError (its message" in log
    assert "UserWarning (its text withheld)" in log and "an exception (not printable safely)" in log
    assert "recovery rotation failed (PeerTimeout: the device did not answer)" in log


def test_a_holders_tokens_and_tokenizer_record_are_refused_without_quoting_them(tmp_path: Path) -> None:
    write_shard(tmp_path / "train_000.bin", np.array([1, 31337], dtype=np.uint16))
    (tmp_path / "tokenizer.json").write_text(json.dumps({"name": "bytes", "vocab_size": 257, "eot": 256}))
    with pytest.raises(BadInput, match="a token is outside the bytes vocabulary") as info:
        load_tokens(tmp_path)
    assert "31337" not in str(info.value)
    (tmp_path / "tokenizer.json").write_bytes(b'{"name": "caf\xe9"}')
    with pytest.raises(BadInput, match="is not UTF-8 \\(at byte offset 13\\)") as info:
        read_tokenizer_record(tmp_path)
    assert "0xe9" not in str(info.value)
