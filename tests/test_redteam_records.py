"""The red team, its canary scan and the isolation checks with an image workload (issue 27).

`gputravel redteam --data records` runs every row unchanged against holders whose datasets are image
record datasets; here, to keep the suite's time, the rows in which what an attacker reads could hold
records (DATA_ROWS; tests/test_redteam.py runs every row over raw data, and security row 54 records
a run of all 26 over records). The holders' datasets are (the `image` demo's digits, packed as its holders' are), one image in every 4 KiB
replaced by the holder's canary image (64 random bytes). The scan searches what each attacker read for
the canary images and for whole digit images only that holder holds; the controls find them in the
plain datasets and in the bytes a holder lays out to travel, so the search works on these encodings.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from gputravel.cli.app import app
from gputravel.cohort import isolation
from gputravel.errors import BadInput
from gputravel.cohort.config import CohortConfig, HolderSpec
from gputravel.cohort.local import Cohort
from gputravel.data.records import RECORDS_FILE, Units, common_schema, lay_out_split, load_records
from gputravel.files import EVAL_SHARE, RECORDS
from gputravel.holder.cvm import manifest_piece_bytes
from gputravel.protocol.layout import Layout
from gputravel.redteam import run as redteam_run
from gputravel.redteam.canary import IMAGE_BYTES, SPACING, make_image_datasets, search
from gputravel.redteam.evidence import Control, Searched, load
from gputravel.redteam.rows import ATTACKS
from test_isolation import memory_of, probe, vram_of  # tests/test_isolation.py: the probe, run as a party's uid
from test_redteam import check_defeated, run_redteam_cli  # tests/test_redteam.py: each row's evidence

MIB = 1 << 20
HOLDERS = ("alice", "bob", "mallory")
#: The rows whose attacker reads memory, buffers or traffic that could hold a holder's records; the
#: others stop protocol faults (a dropped rotation, a forged quote, a GPU that never returns).
DATA_ROWS = ("replay-push", "flip-ciphertext", "wrong-cvm-during-travel", "kept-keys", "dump-vram",
             "work-after-return", "drop-rotation-then-read", "decrypt-snooped", "collusion-after-failed-rotation",
             "baseline-then-travel", "holder-reads-peer-memory", "host-reads-cvm-memory", "snoop-everything")


# ----------------------------------------------------------------------------- the datasets (no processes)
@pytest.fixture(scope="module")
def image_sets(tmp_path_factory) -> tuple[Path, dict]:
    root = tmp_path_factory.mktemp("image-canaries")
    return root, make_image_datasets(root, HOLDERS, 4 * MIB)


def test_each_holder_holds_image_records_with_its_own_canary_images(image_sets) -> None:
    root, needles = image_sets
    schema = common_schema([(h, str(root / h)) for h in HOLDERS])
    assert schema.text() == "image: uint8[1,8,8]; label: int64[]"
    for h, n in needles.items():
        records = load_records(root / h)
        assert len(n.marker) == IMAGE_BYTES and len(n.samples) == 8 and all(len(s) == IMAGE_BYTES for s in n.samples)
        every = SPACING // schema.record_bytes
        canaries = records.array["image"][::every].reshape(-1, IMAGE_BYTES)
        assert {bytes(c) for c in canaries} == {n.marker}  # one canary image in every 4 KiB
        own = search([root / h / RECORDS_FILE], [n])
        assert own.markers == len(canaries) and own.sample_bytes > 0  # control: the search finds them
        others = search([root / o / RECORDS_FILE for o in HOLDERS if o != h], [n])
        assert others.total == 0  # nothing of one holder's is found by chance in another's


def test_the_canary_images_survive_the_layout_a_travel_carries(image_sets) -> None:
    """A holder lays its records out whole in manifest pieces (training, then held-out): what a leaked
    chunk would hold. The search finds the canary images there as often as in the dataset."""
    root, needles = image_sets
    piece = manifest_piece_bytes(Layout())
    for h, n in needles.items():
        records = load_records(root / h)
        data, train, held = lay_out_split(records, Units(records.schema.record_bytes, piece), EVAL_SHARE)
        assert train and held
        laid = root / f"{h}.laid-out"
        laid.write_bytes(data)
        assert search([laid], [n]).markers == search([root / h / RECORDS_FILE], [n]).markers > 0


# ----------------------------------------------------------------------------- the live red team
@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[int, str, dict]:
    only = [arg for row in DATA_ROWS for arg in ("--only", row)]
    return run_redteam_cli(tmp_path_factory.mktemp("redteam-records") / "redteam.json", "--data", "records", *only)


@pytest.mark.integration
@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", DATA_ROWS)
def test_attack_is_defeated_with_image_records(processes, run, name: str) -> None:
    """Each row as tests/test_redteam.py checks it, the holders holding image records."""
    _, output, report = run
    got = {r["name"]: r for r in report["attacks"]}
    assert name in got, f"attack {name} did not run:\n{output}"
    check_defeated(got[name], name)


@pytest.mark.integration
@pytest.mark.timeout(600)
def test_the_host_read_everything_and_no_image_byte_the_control_finds_them(processes, run) -> None:
    """snoop-everything: every bounce buffer, push and TLS byte the host read (tens of MiB) holds no
    canary image and no digit image; the same search finds the canary images in the plain datasets."""
    code, output, report = run
    assert code == 0 and "every attack defeated, 0 bytes of plaintext obtained" in output, output
    row = {r["name"]: r for r in report["attacks"]}["snoop-everything"]
    records = load(row["records"])
    searched = next(r for r in records if isinstance(r, Searched))
    control = next(r for r in records if isinstance(r, Control))
    assert searched.nbytes > 16 * MIB and searched.snoop_bytes > MIB and searched.tap_bytes > 1024
    assert control.nbytes >= 3 * (4 * MIB // SPACING) * IMAGE_BYTES  # every holder's canary images, found
    assert row["marker_bytes"] == row["sample_bytes"] == row["plaintext_bytes_obtained"] == 0


# ----------------------------------------------------------------------------- isolation with record holders
@pytest.mark.integration
@pytest.mark.skipif(bool(isolation.unavailable()), reason=f"process isolation is off here: {isolation.unavailable()}")
def test_record_holders_are_isolated_and_the_host_reads_none_of_their_memory(processes, image_sets,
                                                                            tmp_path: Path) -> None:
    """A records cohort: each party its own uid, non-dumpable; the host's uid is denied every holder's
    memory (where its laid-out images live), the orchestrator's and the VRAM. Control: root reads the
    canary images in each holder's private memory, so they were there to be found."""
    root, needles = image_sets
    root.chmod(0o755)  # a holder's uid reads its dataset (pytest's 0700 directory would shut it out)
    specs = tuple(HolderSpec(h, str(root / h), RECORDS) for h in HOLDERS)
    schema = common_schema([(h, str(root / h)) for h in HOLDERS]).canonical_json()
    with Cohort(CohortConfig(holders=specs, buffer_bytes=2 * MIB, schema=schema, workdir=str(tmp_path),
                             audit_log=str(tmp_path / "audit.log"))) as cohort:
        for h in HOLDERS:
            assert cohort.travel(h, 0).chunk is not None
        iso, pids = cohort.isolation, cohort.pids()
        assert iso.on and set(iso.parties) == {"host", "tdx-module", "device", "orchestrator", *HOLDERS}
        assert len(set(iso.uids.values())) == len(iso.uids) and 0 not in iso.uids.values()
        for key, pid in pids.items():
            now = isolation.read_party(pid)
            assert now.uid == iso.uids[key] and now.groups == () and now.dumpable is False
        targets = [t for key in ("orchestrator", *HOLDERS) for t in memory_of(pids[key])]
        got = probe(iso.uids["host"], targets + vram_of(pids["device"]))
        assert set(got.values()) == {"denied"}, got
        for h in HOLDERS:
            assert _private_memory_has(pids[h], needles[h].marker), f"control: {h}'s canary not in its memory"


def _private_memory_has(pid: int, needle: bytes) -> bool:
    """Root reads `pid`'s memory (its mappings up to 64 MiB: the laid-out records among them) for `needle`."""
    with open(f"/proc/{pid}/maps") as maps, open(f"/proc/{pid}/mem", "rb", buffering=0) as mem:
        for line in maps:
            parts = line.split()
            start, end = (int(x, 16) for x in parts[0].split("-"))
            special = len(parts) > 5 and parts[5] in ("[vvar]", "[vsyscall]", "[vdso]")
            if parts[1].startswith("r") and not special and end - start <= 64 * MIB:
                mem.seek(start)
                try:
                    if needle in mem.read(end - start):
                        return True
                except OSError:
                    continue
    return False


def test_an_unknown_red_team_data_kind_is_refused() -> None:
    result = CliRunner().invoke(app, ["redteam", "--data", "pixels"])
    assert result.exit_code == 2 and "pixels" in result.output
    with pytest.raises(BadInput, match="red-team data is one of raw, records"):
        redteam_run.run_redteam(data="pixels")


def test_the_data_rows_are_rows_of_the_red_team() -> None:
    assert set(DATA_ROWS) <= {a.name for a in ATTACKS} and "snoop-everything" in DATA_ROWS
