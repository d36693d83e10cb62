"""Process isolation of a live cohort (cohort/isolation.py): each party under its own uid,
non-dumpable, its key files its own. Every probe runs as a real process under the uid of a
live party (red team: holder-reads-peer-memory, host-reads-cvm-memory), next to a control
showing the same probe does read what isolation does not protect."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gputravel.errors import BadInput
from gputravel.cohort import isolation
from gputravel.cohort.config import CohortConfig, HolderSpec
from gputravel.cohort.local import Cohort
from gputravel.transport.stream import StreamTransport

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(bool(isolation.unavailable()), reason=f"process isolation is off here: "
                       f"{isolation.unavailable()}"),
]
MIB = 1 << 20
HOLDERS = ("h1", "h2")

# Tries each (label, path, how) and prints what it got: "denied" or "read".
PROBE = r"""
import json, os, sys
out = {}
for label, path, how in json.loads(sys.argv[1]):
    try:
        if how == "list":
            os.listdir(path)
        else:
            with open(path, "rb") as f:
                f.read(1)
        out[label] = "read"
    except OSError:
        out[label] = "denied"
print(json.dumps(out))
"""


def probe(uid: int, targets: list[tuple[str, str, str]], pass_fds: tuple[int, ...] = ()) -> dict[str, str]:
    """Run PROBE as `uid` (no groups), the way the launcher starts a party."""
    run = subprocess.run([sys.executable, "-c", PROBE, json.dumps(targets)], capture_output=True, text=True,
                         timeout=60, cwd="/", pass_fds=pass_fds,
                         preexec_fn=isolation.dropper(uid, netns=None, reach=isolation.interpreter_reach()))
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout)


def memory_of(pid: int) -> list[tuple[str, str, str]]:
    return [(f"{pid}/mem", f"/proc/{pid}/mem", "open"), (f"{pid}/maps", f"/proc/{pid}/maps", "open"),
            (f"{pid}/fd", f"/proc/{pid}/fd", "list"), (f"{pid}/environ", f"/proc/{pid}/environ", "open"),
            (f"{pid}/map_files", f"/proc/{pid}/map_files", "list")]


def vram_of(pid: int) -> list[tuple[str, str, str]]:
    """The device's VRAM memfd, by the descriptor number root sees it under."""
    for fd in os.listdir(f"/proc/{pid}/fd"):
        if "gputravel-vram" in os.readlink(f"/proc/{pid}/fd/{fd}"):
            return [("vram", f"/proc/{pid}/fd/{fd}", "open")]
    raise AssertionError("the device holds no VRAM memfd")


class Spy:
    """Every message the launcher sends to or receives from its children."""

    def __init__(self) -> None:
        self.seen: list[object] = []

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        send, recv = StreamTransport.send, StreamTransport.recv

        def spy_send(t, msg, *a, **kw):
            self.seen.append(msg)
            return send(t, msg, *a, **kw)

        def spy_recv(t, *a, **kw):
            got = recv(t, *a, **kw)
            self.seen.append(got.message)
            return got

        monkeypatch.setattr(StreamTransport, "send", spy_send)
        monkeypatch.setattr(StreamTransport, "recv", spy_recv)


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory):
    """One isolated cohort (pytest's 0700 tmp_path is the workdir on purpose), after a travel."""
    tmp = tmp_path_factory.mktemp("iso")
    specs = []
    for name in HOLDERS:
        (tmp / f"{name}.bin").write_bytes(os.urandom(2 * MIB))
        specs.append(HolderSpec(name, str(tmp / f"{name}.bin")))
    spy = Spy()
    with pytest.MonkeyPatch.context() as mp:
        spy.install(mp)
        with Cohort(CohortConfig(holders=tuple(specs), buffer_bytes=MIB, workdir=str(tmp),
                                 audit_log=str(tmp / "audit.log"))) as cohort:
            cohort.travel("h1", 0)
            yield cohort, spy


def test_every_party_runs_under_its_own_uid_and_is_not_dumpable(processes, live) -> None:
    cohort, _ = live
    iso = cohort.isolation
    assert iso.on and iso.reason == ""
    assert set(iso.parties) == {"host", "tdx-module", "device", "orchestrator", *HOLDERS}
    uids = iso.uids
    assert len(set(uids.values())) == len(uids) and 0 not in uids.values()
    for key, pid in cohort.pids().items():  # read again from /proc, live
        now = isolation.read_party(pid)
        assert now == iso.parties[key]
        assert now.gid == now.uid and now.groups == () and now.dumpable is False


def test_control_the_probe_reads_a_dumpable_process_of_its_own_uid(processes, live) -> None:
    """Without isolation (same uid, dumpable) the very same probe reads everything, so the
    denials below come from isolation, not from a broken probe."""
    cohort, _ = live
    uid = cohort.isolation.uids["h1"]
    plain = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], cwd="/",
                             preexec_fn=isolation.dropper(uid, netns=None, reach=isolation.interpreter_reach()))
    try:
        time.sleep(0.5)
        got = probe(uid, memory_of(plain.pid))
    finally:
        plain.kill()
        plain.wait()
    # /proc/PID/mem needs ptrace *attach*, which this kernel may refuse a non-descendant on
    # other grounds too (as Yama does); the read-mode entries show the probe works.
    assert {k: v for k, v in got.items() if not k.endswith("/mem")} == {k: "read" for k in got if not k.endswith("/mem")}


def test_holder_reads_peer_memory_is_refused(processes, live) -> None:
    """Red team holder-reads-peer-memory: h1's uid tries h2's, the orchestrator's, the
    device's and the host's memory and descriptors, and the device's VRAM."""
    cohort, _ = live
    pids = cohort.pids()
    targets = [t for key in ("h2", "orchestrator", "device", "host") for t in memory_of(pids[key])]
    got = probe(cohort.isolation.uids["h1"], targets + vram_of(pids["device"]))
    assert set(got.values()) == {"denied"}, got


def test_host_reads_cvm_memory_is_refused(processes, live) -> None:
    """Red team host-reads-cvm-memory: the host's uid tries every CVM and the VRAM."""
    cohort, _ = live
    pids = cohort.pids()
    targets = [t for key in ("orchestrator", *HOLDERS) for t in memory_of(pids[key])]
    got = probe(cohort.isolation.uids["host"], targets + vram_of(pids["device"]))
    assert set(got.values()) == {"denied"}, got


def _key_files(cohort: Cohort) -> dict[str, Path]:
    keys = {m: cohort.dir / "pki" / m / f"{m}.key" for m in ("orchestrator", *HOLDERS)}
    keys["device"] = cohort.trust.device_dir / "device-firmware.key"
    return keys


def test_key_files_are_0600_owned_by_their_party_and_unreadable_by_others(processes, live) -> None:
    cohort, _ = live
    uids = cohort.isolation.uids
    # Every probe names the file the way the parties do, through the launcher's descriptor of
    # the cohort directory: what stops the others is the key's owner and mode, and its
    # party's 0700 directory, not pytest's closed tmp_path above it.
    fds = (cohort.placement.root_fd,)
    for owner, path in _key_files(cohort).items():
        st = path.stat()
        assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == uids[owner], path
        target = [("key", cohort.placement.path(path), "open")]
        for other in (k for k in uids if k != owner):
            assert probe(uids[other], target, fds) == {"key": "denied"}, (other, path)
        assert probe(uids[owner], target, fds) == {"key": "read"}  # control: its party reads it


def test_members_make_their_own_keys_and_the_launcher_sees_only_public_material(processes, live) -> None:
    """The launcher never holds a member's private key: the member's uid created the file
    (the directory it made it in held nothing before), and no control message carried it."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    from gputravel.protocol.control import Certified, Enroll

    cohort, spy = live
    enrolled = {m.name for m in spy.seen if isinstance(m, Enroll) and m.name != "device"}  # the GPU: below
    assert enrolled == {"orchestrator", *HOLDERS}
    assert sum(isinstance(m, Certified) for m in spy.seen) == len(enrolled) + 1
    wire = repr(spy.seen).encode()
    assert b"PRIVATE KEY" not in wire
    for member in enrolled:
        path = cohort.dir / "pki" / member / f"{member}.key"
        key = serialization.load_pem_private_key(path.read_bytes(), password=None)
        secret = key.private_numbers().private_value.to_bytes(48, "big")
        assert secret not in wire and path.read_bytes() not in wire
        cert = x509.load_pem_x509_certificate((path.parent / f"{member}.pem").read_bytes())
        assert cert.public_key().public_numbers() == key.public_key().public_numbers()
    # Only the members' own keys lie under pki/: no cohort CA key was ever written.
    keys = {p.relative_to(cohort.dir / "pki").as_posix() for p in (cohort.dir / "pki").rglob("*")
            if p.is_file() and b"PRIVATE KEY" in p.read_bytes()}
    assert keys == {f"{m}/{m}.key" for m in enrolled}


def test_the_device_makes_its_firmware_key_under_its_own_uid_and_the_launcher_sees_only_public_material(processes,
        live) -> None:
    """The GPU's firmware key (the leaf of its 5-certificate chain) is created by the device's
    uid in the device's directory; the launcher, standing for the vendor, got a request and
    sent the chain back, and no launcher message or file carries that key."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    from gputravel.protocol.control import Certified, Enroll

    cohort, spy = live
    path = cohort.trust.device_dir / "device-firmware.key"
    st = path.stat()
    assert st.st_uid == cohort.isolation.uids["device"] and stat.S_IMODE(st.st_mode) == 0o600
    # The launcher wrote only the public firmware state; the key and chain are the device's.
    assert (cohort.trust.device_dir / "device.json").stat().st_uid == cohort.isolation.uids["device"]
    assert (cohort.trust.device_dir / "device-chain.pem").stat().st_uid == cohort.isolation.uids["device"]
    assert cohort.trust.gpu_vendor is None  # the vendor's CA is dropped once the device is certified
    requests = [m for m in spy.seen if isinstance(m, Enroll) and m.name == "device"]
    assert len(requests) == 1
    key = serialization.load_pem_private_key(path.read_bytes(), password=None)
    csr = x509.load_pem_x509_csr(requests[0].csr_pem)
    assert csr.public_key().public_numbers() == key.public_key().public_numbers()
    chain = x509.load_pem_x509_certificates((cohort.trust.device_dir / "device-chain.pem").read_bytes())
    assert len(chain) == 5 and chain[0].public_key().public_numbers() == key.public_key().public_numbers()
    assert any(isinstance(m, Certified) and chain[0].public_bytes(serialization.Encoding.PEM) in m.cert_pem
               for m in spy.seen)
    wire = repr(spy.seen).encode()
    secret = key.private_numbers().private_value.to_bytes(48, "big")
    assert b"PRIVATE KEY" not in wire and secret not in wire and path.read_bytes() not in wire
    # No other file of the cohort holds a GPU private key: its roots' keys are deleted.
    holders = {p.relative_to(cohort.trust.root).as_posix() for p in cohort.trust.root.rglob("*")
               if p.is_file() and b"PRIVATE KEY" in p.read_bytes()}
    assert holders == {"device/device-firmware.key"}


def test_a_lent_output_is_the_orchestrators_while_it_runs_and_given_back(processes, live) -> None:
    cohort, _ = live
    log = Path(cohort.config.audit_log)
    assert log.stat().st_uid == cohort.isolation.uids["orchestrator"] and log.stat().st_size > 0


def test_isolation_off_on_request_runs_as_the_launcher(processes, tmp_path: Path) -> None:
    (tmp_path / "d.bin").write_bytes(os.urandom(MIB))
    with Cohort(CohortConfig(holders=(HolderSpec("h1", str(tmp_path / "d.bin")),), buffer_bytes=MIB,
                             isolate=False, audit_log=str(tmp_path / "audit.log"))) as cohort:
        iso = cohort.isolation
        cohort.travel("h1", 0)
    assert not iso.on and "isolate=False" in iso.reason
    assert {p.uid for p in iso.parties.values()} == {0}


def test_the_lent_travel_log_goes_back_to_its_owner(processes, tmp_path: Path) -> None:
    from gputravel.orchestrator.audit import verify_log

    (tmp_path / "d.bin").write_bytes(os.urandom(MIB))
    log = tmp_path / "audit.log"
    with Cohort(CohortConfig(holders=(HolderSpec("h1", str(tmp_path / "d.bin")),), buffer_bytes=MIB,
                             audit_log=str(log))) as cohort:
        cohort.travel("h1", 0)
        cert = cohort.orchestrator_certificate()
    assert log.stat().st_uid == os.geteuid()
    assert verify_log(log, cert).head_seq == 1  # h1's approval of the job, then its travel


def test_a_checkout_in_a_closed_directory_is_covered_not_refused(monkeypatch) -> None:
    """A checkout in a 0700 directory (`mktemp -d`) is itself on sys.path: the children's
    mount namespace shows all of it, and isolation stays on. Before, it turned isolation off."""
    import shutil
    import tempfile

    base = Path(tempfile.mkdtemp(dir="/tmp"))  # pytest's tmp_path sits under a 0700 directory of its own
    monkeypatch.setattr(isolation, "_needed_paths", lambda: needed)
    closed = base / "checkout"
    (closed / ".venv" / "bin").mkdir(parents=True)
    (closed / "src").mkdir()
    closed.chmod(0o700)
    base.chmod(0o755)
    needed = [str(closed), str(closed / "src"), str(closed / ".venv" / "bin")]
    try:
        assert isolation.interpreter_reach()[str(closed)] == (".venv", "src")
        (closed / "src").chmod(0o700)  # a second closed directory below: a tmpfs cannot help
        with pytest.raises(BadInput, match="cannot reach"):
            isolation.interpreter_reach()
    finally:
        shutil.rmtree(base)


def test_staging_a_checkpoint_follows_no_link_at_either_end(tmp_path: Path) -> None:
    """Placement.stage runs as root: a checkpoint that is a link (to a root-only file, say) is
    refused, and a link the party left where the copy goes is replaced, never written through."""
    from gputravel.cohort.placement import Placement

    cohort = tmp_path / "cohort"
    cohort.mkdir()
    place = Placement(cohort, isolate=True)
    secret = tmp_path / "root-only"
    secret.write_bytes(b"ROOT ONLY")
    secret.chmod(0o600)
    link = tmp_path / "checkpoint.pt"
    link.symlink_to(secret)
    with pytest.raises(BadInput, match="cannot hand"):
        place.stage("orchestrator", str(link))
    link.unlink()
    link.write_bytes(b"CHECKPOINT")
    victim = tmp_path / "victim"
    victim.write_bytes(b"VICTIM")
    planted = place.party_dir("orchestrator") / "checkpoint.pt"
    planted.symlink_to(victim)
    named = place.stage("orchestrator", str(link))
    assert victim.read_bytes() == b"VICTIM" and not planted.is_symlink()
    assert planted.read_bytes() == b"CHECKPOINT" and named.endswith("/parties/orchestrator/checkpoint.pt")
    assert planted.stat().st_uid == place.uid("orchestrator") and stat.S_IMODE(planted.stat().st_mode) == 0o600
    place.close()


def test_handing_a_tree_over_follows_no_link(tmp_path: Path) -> None:
    """isolation.give runs as root on trees a party may write: a link at the top is refused,
    a link inside is handed over itself, and what either names keeps its owner and mode."""
    victim = tmp_path / "victim"
    (victim / "deep").mkdir(parents=True)
    (victim / "deep" / "f").write_bytes(b"x")
    victim.chmod(0o755)
    tree = tmp_path / "tree"
    tree.mkdir()
    (tree / "into").symlink_to(victim)
    with pytest.raises(OSError):
        isolation.give(tmp_path / "tree" / "into", 12345, 0o600)
    isolation.give(tree, 12345, 0o700)
    assert tree.stat().st_uid == 12345 and (tree / "into").lstat().st_uid == 12345
    assert victim.stat().st_uid == (victim / "deep" / "f").stat().st_uid == os.geteuid()
    assert stat.S_IMODE(victim.stat().st_mode) == 0o755


def test_handing_a_tree_over_follows_no_link_swapped_in_while_it_walks(tmp_path: Path, monkeypatch) -> None:
    """The hostile review of issue 30: a party whose state directory is already its own swaps
    one of its directories for a link to another party's while root's walk is inside it. The
    swap is made here at the worst moment, once root has handed over the first file in it: a
    walk by path then handed over the rest of the names through the link."""
    victim = tmp_path / "victim"
    victim.mkdir()
    tree = tmp_path / "tree"
    (tree / "sub").mkdir(parents=True)
    for i in range(5):
        (victim / f"f{i}").write_bytes(b"another party's")
        (tree / "sub" / f"f{i}").write_bytes(b"the party's")
    victims = {os.lstat(p).st_ino for p in victim.iterdir()}
    chowned: set[int] = set()
    real_chown = os.chown

    def chown(path, uid, gid, *, dir_fd=None, follow_symlinks=True):
        chowned.add(os.stat(path, dir_fd=dir_fd, follow_symlinks=False).st_ino)
        real_chown(path, uid, gid, dir_fd=dir_fd, follow_symlinks=follow_symlinks)
        if os.path.basename(path).startswith("f") and not (tree / "sub").is_symlink():
            (tree / "sub").rename(tree / "was-sub")  # the party's swap, mid-walk
            (tree / "sub").symlink_to(victim)

    monkeypatch.setattr(os, "chown", chown)
    isolation.give(tree, os.geteuid(), 0o700)
    assert len(chowned) >= 2 and not chowned & victims, "root's walk went through the link swapped in"


def test_only_the_device_starts_with_the_copy_engine_tunables(processes, live) -> None:
    """The device's VRAM writes stream past the cache as a copy engine's DMA does
    (device/memory.COPY_ENGINE_TUNABLES); no other party's environment changes."""
    from gputravel.device.memory import COPY_ENGINE_TUNABLES

    cohort, _ = live
    for key, pid in cohort.pids().items():
        env = dict(v.split(b"=", 1) for v in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") if b"=" in v)
        tunables = env.get(b"GLIBC_TUNABLES", b"").decode()
        assert (COPY_ENGINE_TUNABLES in tunables.split(":")) == (key == "device"), (key, tunables)


def test_the_device_keeps_tunables_it_was_given() -> None:
    env = isolation.party_env("device", {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2", "X": "1"})
    assert env["GLIBC_TUNABLES"].split(":")[0] == "glibc.malloc.arena_max=2" and env["X"] == "1"
    assert "GLIBC_TUNABLES" not in isolation.party_env("holder", {"X": "1"})
