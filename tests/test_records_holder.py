"""Record datasets through the holder (issue 27): laid out once at boot in whole records to a
manifest piece, training records then held-out ones; announced in the hello and checked on
enrolment; a holder of another schema refused before anything travels; the configs that carry
the held-out share and the job's schema."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import numpy as np
import pytest

from gputravel.cohort.config import CohortConfig, HolderSpec
from gputravel.data.records import RecordSchema, Records, Units, lay_out_split, split_arrays, write_records
from gputravel.errors import BadInput, ProtocolError
from gputravel.holder.cvm import Dataset, HolderConfig, manifest_piece_bytes
from gputravel.orchestrator.machine import Buffer, OrchestratorTravel
from gputravel.protocol.manifest import chunk_digest, chunk_digest_from_manifest, piece_digests
from gputravel.protocol.travel import HolderHello
from gputravel.testing import TEST_LAYOUT
from gputravel.testing.cohort import InProcessCohort

PIECE = manifest_piece_bytes(TEST_LAYOUT)  # 64 KiB: 13 records of 4908 bytes, then 1732 bytes of padding
SCHEMA = RecordSchema.parse("image: uint8[1,70,70]; label: int64[]")
WIDER = RecordSchema.parse("image: uint8[1,72,70]; label: int64[]")


def records(schema: RecordSchema, count: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    out = np.zeros(count, dtype=schema.dtype)
    out["image"] = rng.integers(1, 256, size=out["image"].shape, dtype=np.uint8)  # no zero byte: padding shows
    out["label"] = np.arange(count)  # each record told apart by its label
    return out


def dataset_dir(tmp_path: Path, name: str, schema: RecordSchema = SCHEMA, count: int = 100) -> Path:
    path = tmp_path / name
    write_records(path, schema, records(schema, count, seed=len(name)))
    return path


def hello_of(name: str, ds: Dataset, **changed: object) -> HolderHello:
    fields = {"holder": name, "dataset_bytes": ds.size, "piece_bytes": PIECE,
              "manifest": piece_digests(ds.view, PIECE), "tokenizer": ds.tokenizer,
              "schema": ds.schema.canonical_json() if ds.schema else "", "train_records": ds.train_records,
              "eval_records": ds.eval_records, "probed": True, "log_key": bytes(32)}
    return HolderHello(**{**fields, **changed})  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- laid out at boot
def test_a_records_dataset_is_laid_out_whole_records_to_a_piece(tmp_path: Path) -> None:
    path = dataset_dir(tmp_path, "alice")
    ds = Dataset(str(path), "records", piece_bytes=PIECE, eval_share=0.2, eval_seed=7)
    assert ds.schema == SCHEMA and (ds.train_records, ds.eval_records) == (80, 20) and ds.tokenizer == ""
    units = Units(SCHEMA.record_bytes, PIECE)
    assert ds.size == units.split_bytes(80, 20) == units.eval_base(80) + units.span(20)
    train, held = split_arrays(Records(SCHEMA, np.load(path / "records.npy")), 0.2, seed=7)
    view = bytes(ds.view)
    # Each piece holds whole records only, zero-padded: the records come back from the pieces.
    assert units.read(view, 80, SCHEMA.dtype).tobytes() == train.tobytes()
    assert units.read(view[units.eval_base(80):], 20, SCHEMA.dtype).tobytes() == held.tobytes()
    for start in range(0, ds.size, PIECE):
        piece = view[start : start + PIECE]
        whole = units.per_piece * SCHEMA.record_bytes
        assert not any(piece[whole:]), f"the piece at {start} holds more than whole records"
    assert not set(train["label"]) & set(held["label"])  # the held-out records are never trained on
    # A chunk of the buffer's size is whole pieces, so whole records, and its digest is the manifest's.
    manifest = piece_digests(ds.view, PIECE)
    for offset in range(0, ds.size, 2 * PIECE):
        nbytes = min(2 * PIECE, ds.size - offset)
        assert chunk_digest(ds.view[offset : offset + nbytes], PIECE) == chunk_digest_from_manifest(
            manifest, offset, nbytes, PIECE)
    again = Dataset(str(path), "records", piece_bytes=PIECE, eval_share=0.2, eval_seed=7)
    assert bytes(again.view) == view  # the same split on every boot
    assert bytes(Dataset(str(path), "records", piece_bytes=PIECE, eval_share=0.2, eval_seed=8).view) != view


def test_a_dataset_that_cannot_be_laid_out_is_refused_at_boot(tmp_path: Path) -> None:
    path = dataset_dir(tmp_path, "alice", count=3)
    with pytest.raises(BadInput, match="a record of 4908 bytes does not fit the holder's 4096-byte manifest pieces"):
        Dataset(str(path), "records", piece_bytes=4096)
    with pytest.raises(BadInput, match=r"none of its 1 records is left to train on with eval_share 0\.9"):
        Dataset(str(dataset_dir(tmp_path, "bob", count=1)), "records", piece_bytes=PIECE, eval_share=0.9)
    with pytest.raises(BadInput, match="is not a record dataset"):
        Dataset(str(tmp_path), "records", piece_bytes=PIECE)
    ds = Dataset(str(path), "records", piece_bytes=PIECE, eval_share=0)
    assert (ds.train_records, ds.eval_records, ds.size) == (3, 0, 3 * SCHEMA.record_bytes)
    raw = Dataset(str(path / "records.npy"), "raw")  # raw and tokens keep what they were
    assert raw.schema is None and (raw.train_records, raw.eval_records) == (0, 0)


def test_eval_share_and_seed_are_checked_by_key(tmp_path: Path) -> None:
    from gputravel.service.config import validate_service

    for share in (1.0, -0.1, float("nan"), True):
        with pytest.raises(BadInput, match="holder 'alice': eval_share must be at least 0 and below 1"):
            HolderConfig(name="alice", dataset_path="", host_socket="", pki_dir="", layout=TEST_LAYOUT,
                         eval_share=share)
        with pytest.raises(BadInput, match="holder 'h': eval_share must be at least 0 and below 1"):
            CohortConfig(holders=(HolderSpec("h", __file__, eval_share=share),), buffer_bytes=1 << 20)
    with pytest.raises(BadInput, match="holder 'h': eval_seed must be a non-negative integer, got -1"):
        CohortConfig(holders=(HolderSpec("h", __file__, eval_seed=-1),), buffer_bytes=1 << 20)
    with pytest.raises(BadInput, match="schema: a schema's JSON is malformed"):
        CohortConfig(holders=(HolderSpec("h", __file__),), buffer_bytes=1 << 20, schema="{")
    assert HolderConfig(name="a", dataset_path="", host_socket="", pki_dir="", layout=TEST_LAYOUT).eval_share == 0.2
    raw = {"party": "holder", "cohort_dir": "/c", "state_dir": "/s", "name": "alice", "host_socket": "/r/host.sock",
           "boot_lock": "/r/gpu-0.lock", "trust_dir": "/t", "public_dir": "/p", "data": "/d", "format": "records",
           "orchestrator_port": 1, "layout": {}, "policy": {"orchestrator_measurements": ["0" * 96]}}
    cfg = validate_service(raw, "holder.toml")
    assert (cfg.format, cfg.eval_share, cfg.eval_seed) == ("records", 0.2, 0)  # type: ignore[union-attr]
    assert validate_service({**raw, "eval_share": 0, "eval_seed": 3}, "h.toml").eval_share == 0  # type: ignore[union-attr]
    with pytest.raises(BadInput, match=r"holder\.toml: eval_share: expected less than 1"):
        validate_service({**raw, "eval_share": 1.0}, "holder.toml")


# ----------------------------------------------------------------------------- enrolment
def test_enrol_refuses_counts_that_do_not_lay_out_as_the_dataset(tmp_path: Path) -> None:
    ds = Dataset(str(dataset_dir(tmp_path, "alice")), "records", piece_bytes=PIECE, eval_share=0.2)
    o = OrchestratorTravel(Buffer(0, 4 * PIECE))
    o.enrol(hello_of("alice", ds))
    assert o.holders["alice"].train_records == 80
    o.enrol(hello_of("bob", Dataset(str(dataset_dir(tmp_path, "bob", count=26)), "records", piece_bytes=PIECE,
                                    eval_share=0)))  # two full pieces, the last unpadded
    lay_out = ".* training and .* held-out records of 4908 bytes do not lay out as its"
    # (81 training records would lay out as 80 do, in 7 pieces: the held-out ones start where they did.)
    for changed in ({"train_records": 78}, {"eval_records": 21}, {"eval_records": 0},
                    {"train_records": 0, "eval_records": 100}, {"eval_records": -1}):
        with pytest.raises(ProtocolError, match=f"holder alice: {lay_out}"):
            o.enrol(hello_of("alice", ds, **changed))
    with pytest.raises(ProtocolError, match="holder alice: its schema is refused: a schema's JSON is malformed"):
        o.enrol(hello_of("alice", ds, schema="{not json"))
    with pytest.raises(ProtocolError, match="holder alice: its schema is refused: a record of 4908 bytes does not fit"):
        o.enrol(hello_of("alice", ds, piece_bytes=4096, manifest=piece_digests(ds.view, 4096)))
    with pytest.raises(ProtocolError, match="holder alice: record counts without a schema"):
        o.enrol(hello_of("alice", ds, schema=""))


# ----------------------------------------------------------------------------- joining a job
def test_a_records_cohort_travels_whole_records_checked_against_the_manifest(tmp_path: Path) -> None:
    paths = {"h1": dataset_dir(tmp_path, "h1"), "h2": dataset_dir(tmp_path, "h2", count=30)}
    with InProcessCohort(paths, buffer_bytes=2 * PIECE, workdir=tmp_path, formats=dict.fromkeys(paths, "records"),
                         schema=SCHEMA.canonical_json()) as cohort:
        sm = cohort.orchestrator.travel_sm
        assert sm is not None
        for name, path in paths.items():
            hello = sm.holders[name]
            laid, train, held = lay_out_split(Records(SCHEMA, np.load(path / "records.npy")), Units(
                SCHEMA.record_bytes, PIECE), 0.2)
            assert (hello.schema, hello.train_records, hello.eval_records) == (SCHEMA.canonical_json(), train, held)
            assert hello.dataset_bytes == len(laid) and hello.tokenizer == ""
            for offset in range(0, len(laid), 2 * PIECE):  # the training records' chunks, then the held-out ones
                report = cohort.orchestrator.travel(name, offset)
                assert report.refused is None and report.chunk is not None
                assert report.chunk.digest == chunk_digest(laid[offset : offset + report.chunk.nbytes], PIECE)


@pytest.mark.parametrize(("formats", "want", "reason"), [
    ({"h2": "records"}, SCHEMA, ("holder 'h2' holds records of another schema: field 'image' is image: "
                                 "uint8[1,72,70], expected image: uint8[1,70,70]")),
    ({"h2": "raw"}, SCHEMA, ("holder 'h2' holds raw bytes, this cohort trains on records (image: uint8[1,70,70]; "
                             "label: int64[]): pack its data with `gputravel data pack`")),
    ({"h2": "records"}, None, "holder 'h2' holds records (image: uint8[1,72,70]; label: int64[]), this cohort"),
])
def test_a_holder_of_other_data_is_refused_before_anything_travels(tmp_path: Path, formats, want, reason) -> None:
    h2 = dataset_dir(tmp_path, "h2", schema=WIDER)
    paths = {"h2": h2 if formats["h2"] == "records" else h2 / "records.npy"}
    cohort = InProcessCohort(paths, buffer_bytes=2 * PIECE, workdir=tmp_path, formats=formats,
                             schema=want.canonical_json() if want else "")
    with pytest.raises(BadInput, match=re.escape(reason)):
        cohort.start()  # refused at its join, so the cohort does not start
    sm = cohort.orchestrator.travel_sm
    assert sm is not None and "h2" not in sm.holders and "h2" not in cohort.orchestrator.holders
    assert cohort.holders["h2"].travels_served == 0 and sm._travel_id == 0  # nothing travelled
    assert cohort.left["h2"].startswith("could not join") and reason in cohort.left["h2"]  # told why


# ----------------------------------------------------------------------------- services
def test_init_gives_a_records_holder_its_format_and_the_job_its_schema(searchable_tmp, tmp_path: Path) -> None:
    from gputravel.service.config import load_service
    from gputravel.service.init import data_schema, init_cohort
    from gputravel.service.status import _holders_data

    os.chmod(tmp_path, 0o711)  # init refuses, as root, a directory the parties' accounts could not reach
    north, south = dataset_dir(tmp_path, "north"), dataset_dir(tmp_path, "south", count=40)
    for d in (north, south):
        d.chmod(0o755)  # the holder's account reads it (write_records leaves a directory 0700)
    text = tmp_path / "text.txt"
    text.write_text("Now is the winter of our discontent. " * 50)
    with pytest.raises(BadInput, match="holders disagree on their data"):
        data_schema([("north", str(north)), ("west", str(text))])
    with pytest.raises(BadInput, match="holder 'east' holds records of another schema than holder 'north': field 'image'"):
        data_schema([("north", str(north)), ("east", str(dataset_dir(tmp_path, "east", schema=WIDER)))])
    job = {"workload": "image"}
    init_cohort(tmp_path / "D", [("north", str(north)), ("south", str(south))], job=job)
    holder = load_service(tmp_path / "D" / "holder-north.toml", "holder")
    orchestrator = load_service(tmp_path / "D" / "orchestrator.toml", "orchestrator")
    assert holder.format == "records" and holder.eval_share == 0.2  # type: ignore[union-attr]
    assert orchestrator.job.record_schema == SCHEMA.canonical_json()  # type: ignore[union-attr]
    # `gputravel status` reads the holder's data as its CVM lays it out, so its chunk MACs check.
    data = _holders_data(holder)  # type: ignore[arg-type]
    assert (data.train_records, data.eval_records) == (80, 20) and data.schema == SCHEMA
    text_dir = tmp_path / "plain"
    with pytest.raises(BadInput, match=r"another schema than job\.record_schema: field 'image'"):
        init_cohort(text_dir, [("north", str(north))], job={**job, "record_schema": WIDER.canonical_json()})
    assert json.loads(SCHEMA.canonical_json())  # canonical JSON is what travels


# ----------------------------------------------------------------------------- a process cohort
def test_a_process_cohort_hands_records_holders_their_directory_and_split(processes, searchable_tmp,
                                                                          tmp_path: Path) -> None:
    """The launcher hands a record dataset's directory to its holder's CVM (as root, behind a
    descriptor, under the holder's own uid), with its held-out share; a holder of another schema
    is refused at its join, which stops the cohort's start."""
    from gputravel.cohort.local import Cohort

    os.chmod(tmp_path, 0o711)
    paths = {"h1": dataset_dir(tmp_path, "h1"), "h2": dataset_dir(tmp_path, "h2", count=30)}
    for d in paths.values():
        d.chmod(0o755)  # readable by the holder's account (write_records leaves a directory 0700)
    shares = {"h1": 0.25, "h2": 0.0}
    specs = tuple(HolderSpec(n, str(p), "records", eval_share=shares[n], eval_seed=3) for n, p in paths.items())
    buffer = 2 * PIECE
    units = Units(SCHEMA.record_bytes, PIECE)
    with Cohort(CohortConfig(holders=specs, buffer_bytes=buffer, layout=TEST_LAYOUT,
                             schema=SCHEMA.canonical_json())) as cohort:
        for name, path in paths.items():
            laid, train, held = lay_out_split(Records(SCHEMA, np.load(path / "records.npy")), units, shares[name], 3)
            assert cohort.dataset_bytes[name] == len(laid) == units.split_bytes(train, held)
            report = cohort.travel(name, units.eval_base(train) if held else 0)
            assert report.chunk is not None
            assert report.chunk.digest == chunk_digest(laid[report.chunk.dataset_offset :][: report.chunk.nbytes],
                                                       PIECE)
    wider = dataset_dir(tmp_path, "h3", schema=WIDER)
    wider.chmod(0o755)
    refused = CohortConfig(holders=(*specs, HolderSpec("h3", str(wider), "records")), buffer_bytes=buffer,
                           layout=TEST_LAYOUT, schema=SCHEMA.canonical_json())
    # Whichever side the launcher hears first: the orchestrator's refusal, or the holder told it.
    with pytest.raises((BadInput, ProtocolError), match=re.escape("holder 'h3' holds records of another schema: "
                                                                  "field 'image'")):
        with Cohort(refused):
            pass
