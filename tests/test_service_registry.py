"""Audit finding 1 (issue 30): a party's service acts only as the party `cohort init` made.

Each holder starts its own service as root from its own copy of its config, so the config is
an operator's input. These tests start a service from a config changed in one key that says who
the party is or where it acts, and check it is refused by that key before any file of the
cohort is touched (service/registry.py; security row 51)."""

from __future__ import annotations

import os
import tomllib
from pathlib import Path

import pytest
import tomli_w

from gputravel.errors import BadInput
from gputravel.service.config import load_service
from gputravel.service.init import init_cohort
from gputravel.service.registry import REGISTRY_FILE, bind
from gputravel.service.serve import serve
from gputravel.service.status import party_name

ROOT = os.geteuid() == 0


@pytest.fixture(autouse=True)
def _reachable(searchable_tmp, tmp_path):
    os.chmod(tmp_path, 0o711)  # init refuses, as root, a directory the parties could not reach


@pytest.fixture(scope="module")
def cohort(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("registry")
    os.chmod(base, 0o711)
    for name in ("a", "b"):
        (base / f"{name}.txt").write_text(f"holder {name}'s text\n" * 50)
    init_cohort(base / "D", [("a", str(base / "a.txt")), ("b", str(base / "b.txt"))])
    d = base / "D"
    (d / "state" / "holder-b" / "pki").mkdir()  # b's service made its key: a's must never reach it
    (d / "state" / "holder-b" / "pki" / "b.key").write_bytes(b"b's private key")
    return d


def _tree(d: Path) -> dict[str, tuple[int, int, int, int]]:
    """Every path under `d` with its mode, owner, size and mtime: "nothing touched" (not atime:
    reading the config is no touch)."""
    out = {}
    for top, dirs, files in os.walk(d):
        for name in [*dirs, *files, ""]:
            st = os.lstat(os.path.join(top, name))
            out[os.path.join(top, name)] = (st.st_mode, st.st_uid, st.st_size, st.st_mtime_ns)
    return out


def _changed(src: Path, dst: Path, change) -> Path:
    data = tomllib.loads(src.read_text())
    change(data)
    dst.write_text(tomli_w.dumps(data))
    return dst


def _registered(d: Path, party: str) -> dict:
    return tomllib.loads((d / REGISTRY_FILE).read_text())["parties"][party]


def _refused(cohort: Path, role: str, bad: Path, *expected: str) -> None:
    before = _tree(cohort)
    with pytest.raises(BadInput) as caught:
        serve(role, bad)
    for text in expected:
        assert text in str(caught.value)
    assert _tree(cohort) == before, "a refused service touched the cohort"


# ----------------------------------------------------------------------------- the audit's cases
@pytest.mark.parametrize("target", ["orchestrator", "holder-b"])
def test_a_holder_config_naming_another_partys_state_is_refused_before_any_file(cohort: Path, tmp_path: Path,
                                                                             target: str) -> None:
    """The audit chowned the orchestrator's state (the CPU-TEE root key in it) and b's (b.key)
    to a's account by pointing a's state_dir at them."""
    state = str(cohort / "state" / target)
    bad = _changed(cohort / "holder-a.toml", tmp_path / "a.toml", lambda c: c.update(state_dir=state))
    _refused(cohort, "holder", bad, f"{bad}: state_dir: expected '{cohort}/state/holder-a'", f"got '{state}'")


def test_a_holder_config_naming_another_holder_is_refused(cohort: Path, tmp_path: Path) -> None:
    """name = "b" with a's own state would have replaced public/holder-b.pem, which the
    orchestrator pins as b."""
    bad = _changed(cohort / "holder-a.toml", tmp_path / "a.toml", lambda c: c.update(name="b"))
    _refused(cohort, "holder", bad, f"{bad}: state_dir: expected '{cohort}/state/holder-b'")
    assert not (cohort / "public" / "holder-b.pem").exists()


@pytest.mark.skipif(not ROOT, reason="parties have accounts of their own only when init runs as root")
def test_a_holder_config_naming_another_partys_account_is_refused(cohort: Path, tmp_path: Path) -> None:
    b_uid = _registered(cohort, "holder-b")["uid"]
    bad = _changed(cohort / "holder-a.toml", tmp_path / "a.toml", lambda c: c.update(uid=b_uid))
    _refused(cohort, "holder", bad, f"{bad}: uid: expected {_registered(cohort, 'holder-a')['uid']}", f"got {b_uid}")


@pytest.mark.parametrize("config, key", [("holder-a.toml", "uid"), ("orchestrator.toml", "tdx_uid"),
                                         ("gpu-0.toml", "orchestrator_uid")])
def test_uid_0_is_refused_by_key(cohort: Path, tmp_path: Path, config: str, key: str) -> None:
    bad = _changed(cohort / config, tmp_path / config, lambda c: c.update({key: 0}))
    role = config.split("-")[0].removesuffix(".toml")
    _refused(cohort, role, bad, f"{bad}: {key}: expected an account other than root's (uid 0)")


@pytest.mark.parametrize("config, key, path", [
    ("holder-a.toml", "boot_lock", "{t}/made-by-root.lock"),  # opened O_CREAT as root
    ("holder-a.toml", "public_dir", "{d}/state/holder-b"),  # where it publishes its certificate
    ("holder-a.toml", "trust_dir", "{t}"),
    ("holder-a.toml", "host_socket", "{d}/run/gpu-0.sock"),
    ("orchestrator.toml", "state_dir", "{t}/var"),  # chmodded 0700 and chowned to its account
    ("host.toml", "socket", "{t}/host.sock"),
    ("gpu-0.toml", "link_socket", "{d}/run/other.sock"),
])
def test_a_path_other_than_the_one_init_gave_is_refused(cohort: Path, tmp_path: Path, config: str, key: str,
                                                        path: str) -> None:
    """Paths under tmp_path stand for any path on the machine (the audit's was any absolute one):
    a test that fails must not have chmodded a system directory."""
    (tmp_path / "var").mkdir()
    path = path.format(d=cohort, t=tmp_path)
    bad = _changed(cohort / config, tmp_path / config, lambda c: c.update({key: path}))
    role = config.split("-")[0].removesuffix(".toml")
    before = _tree(tmp_path)
    _refused(cohort, role, bad, f"{bad}: {key}: expected ", f"got '{path}'")
    assert _tree(tmp_path) == before


def test_the_orchestrators_run_directory_is_bound_too(cohort: Path, tmp_path: Path) -> None:
    """The orchestrator's service hands its run directory to its account, recursively."""
    target = str(cohort / "state" / "holder-b")
    bad = _changed(cohort / "orchestrator.toml", tmp_path / "o.toml", lambda c: c["job"].update(run_dir=target))
    _refused(cohort, "orchestrator", bad, f"{bad}: job.run_dir: expected '{cohort}/run-dir'")


def test_a_config_of_a_party_init_never_made_is_refused(cohort: Path, tmp_path: Path) -> None:
    bad = _changed(cohort / "holder-a.toml", tmp_path / "c.toml",
                   lambda c: c.update(name="c", state_dir=str(cohort / "state" / "holder-c")))
    _refused(cohort, "holder", bad, "no party 'holder-c' in the cohort's registry (it has broker, gpu-0, holder-a, holder-b")


def test_the_tunable_keys_stay_free_and_each_config_init_wrote_binds(cohort: Path, tmp_path: Path) -> None:
    for path in sorted(cohort.glob("*.toml")):
        if path.name != REGISTRY_FILE:
            cfg = load_service(path)
            bind(cfg, party_name(cfg))
    tuned = _changed(cohort / "holder-a.toml", tmp_path / "a.toml",
                     lambda c: c.update(device_timeout=5.0, data=str(tmp_path)))
    bind(load_service(tuned), "holder-a")
    job = _changed(cohort / "orchestrator.toml", tmp_path / "o.toml", lambda c: c["job"].update(steps=7))
    bind(load_service(job), "orchestrator")


# ----------------------------------------------------------------------------- the registry's own word
def _forged(tmp_path: Path, cohort: Path, *, uid: int | None = None, mode: int = 0o644) -> Path:
    """A cohort directory of someone else's, whose registry says a's party acts in b's state."""
    fake = tmp_path / "fake"
    fake.mkdir(mode=0o755)
    doc = tomllib.loads((cohort / REGISTRY_FILE).read_text())
    doc["directory"] = str(fake)
    doc["parties"]["holder-a"]["state_dir"] = str(cohort / "state" / "holder-b")
    (fake / REGISTRY_FILE).write_text(tomli_w.dumps(doc))
    os.chmod(fake / REGISTRY_FILE, mode)
    if uid is not None:
        os.chown(fake, uid, uid)
        os.chown(fake / REGISTRY_FILE, uid, uid)
    return fake


def _pointing_at(cohort: Path, tmp_path: Path, fake: Path) -> Path:
    return _changed(cohort / "holder-a.toml", tmp_path / "a.toml",
                    lambda c: c.update(cohort_dir=str(fake), state_dir=str(cohort / "state" / "holder-b")))


@pytest.mark.skipif(not ROOT, reason="needs root to make a directory another account owns")
def test_a_registry_another_account_could_write_is_not_believed(cohort: Path, tmp_path: Path) -> None:
    fake = _forged(tmp_path, cohort, uid=54321)
    _refused(cohort, "holder", _pointing_at(cohort, tmp_path, fake), "belongs to uid 54321")


def test_a_registry_writable_by_others_is_not_believed(cohort: Path, tmp_path: Path) -> None:
    fake = _forged(tmp_path, cohort, mode=0o666)
    os.chmod(fake / REGISTRY_FILE, 0o666)  # whatever the umask
    _refused(cohort, "holder", _pointing_at(cohort, tmp_path, fake), "is writable by others (mode 666)")


def test_a_registry_reached_through_a_link_or_missing_is_refused(cohort: Path, tmp_path: Path) -> None:
    link = tmp_path / "link"
    link.symlink_to(cohort)
    bad = _changed(cohort / "holder-a.toml", tmp_path / "a.toml", lambda c: c.update(cohort_dir=str(link)))
    _refused(cohort, "holder", bad, "goes through a link")
    bare = tmp_path / "bare"
    bare.mkdir(mode=0o755)
    os.chmod(bare, 0o755)
    bad = _changed(cohort / "holder-a.toml", tmp_path / "a.toml", lambda c: c.update(cohort_dir=str(bare)))
    _refused(cohort, "holder", bad, f"no registry at {bare}/{REGISTRY_FILE}")


def test_a_registry_of_another_cohort_copied_beside_a_config_is_refused(cohort: Path, tmp_path: Path) -> None:
    """The registry names its own directory: a copy elsewhere is not that cohort's word."""
    copy = tmp_path / "copy"
    copy.mkdir(mode=0o755)
    os.chmod(copy, 0o755)
    (copy / REGISTRY_FILE).write_bytes((cohort / REGISTRY_FILE).read_bytes())
    os.chmod(copy / REGISTRY_FILE, 0o644)
    bad = _changed(cohort / "holder-a.toml", tmp_path / "a.toml", lambda c: c.update(cohort_dir=str(copy)))
    _refused(cohort, "holder", bad, f"is not the registry of {copy}")


# ----------------------------------------------------------------------------- status, and root acting as the party
def test_status_refuses_a_config_of_another_partys_state(cohort: Path, tmp_path: Path) -> None:
    """The hostile review: `gputravel status` as root with a's config naming b (name and state)
    read b's travel-log key and checked guesses of b's data against b's logged chunks."""
    from gputravel.service.status import cohort_status

    bad = _changed(cohort / "holder-a.toml", tmp_path / "a.toml",
                   lambda c: c.update(name="b", state_dir=str(cohort / "state" / "holder-b")))
    before = _tree(cohort)
    with pytest.raises(BadInput, match="uid: expected" if ROOT else "no party|expected"):
        cohort_status(load_service(bad))
    assert _tree(cohort) == before


@pytest.mark.skipif(not ROOT, reason="acting as another account needs root")
def test_root_acting_as_a_party_reaches_only_what_the_party_may(tmp_path: Path) -> None:
    """service/party.as_party: what root does inside a party's tree (trust files, pinned
    certificates, what it publishes) it does as that party, so a link the party planted there
    reaches nothing of root's; and root is root again afterwards, whatever happened inside."""
    from gputravel.service.party import as_party

    secret = tmp_path / "root-only"
    secret.write_bytes(b"root's")
    secret.chmod(0o600)
    with as_party(54321):
        assert (os.geteuid(), os.getegid(), os.getgroups()) == (54321, 54321, [])
        with pytest.raises(PermissionError):
            secret.read_bytes()
    with pytest.raises(ValueError), as_party(54321):
        raise ValueError("a failure inside")
    assert os.geteuid() == 0 and os.getegid() == 0 and secret.read_bytes() == b"root's"
    # A change of effective ids clears the parent-death signal: as_party sets it again (a
    # holder's service once outlived its launcher, killed outright).
    import ctypes
    import signal

    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.prctl(1, signal.SIGUSR2, 0, 0, 0) == 0  # PR_SET_PDEATHSIG
    try:
        with as_party(54321):
            pass
        from gputravel.cohort.isolation import parent_death_signal

        assert parent_death_signal() == signal.SIGUSR2
    finally:
        libc.prctl(1, 0, 0, 0, 0)


def test_a_link_planted_as_the_boot_lock_is_refused_not_followed(tmp_path: Path) -> None:
    """The cohort's run directory is every party's (1777): a link another party put where the
    boot lock goes made root create a file wherever it named (the hostile review)."""
    from gputravel.service.members import _try_lock

    lock = tmp_path / "gpu-0.lock"
    lock.symlink_to(tmp_path / "made-by-root")
    with pytest.raises(BadInput, match=r"boot_lock: .* cannot be taken"):
        _try_lock(str(lock))
    assert not (tmp_path / "made-by-root").exists()


def test_the_vendors_material_lies_in_no_partys_tree_and_init_opens_the_way_whatever_the_umask(
        tmp_path: Path) -> None:
    """The second hostile review: a party renamed the vendor's directory inside its own state,
    and the next start handed it over with the rest (the CPU-TEE root and the GPU vendor's CA
    read by the party). Now that material is in D/vendor and D/platform, root's alone, and every
    party's state starts empty. A root umask of 077 had also left trust/ and public/ closed."""
    import stat

    data = tmp_path / "data.txt"
    data.write_text("text\n" * 10)
    old = os.umask(0o077)
    try:
        init_cohort(tmp_path / "D", [("a", str(data))])
    finally:
        os.umask(old)
    d = tmp_path / "D"
    for party in ("host", "gpu-0", "orchestrator", "holder-a"):
        assert not any((d / "state" / party).iterdir()), party
    for path in (d / "vendor", d / "vendor" / "gpu-0", d / "platform"):
        assert stat.S_IMODE(path.stat().st_mode) == 0o700 and path.stat().st_uid == os.geteuid()
    modes = {p: stat.S_IMODE(p.stat().st_mode) for p in (d / "state", d / "public", d / "trust", *(d / "trust").iterdir())}
    assert modes[d / "state"] == 0o711 and modes[d / "public"] == modes[d / "trust"] == 0o755
    assert all(m == 0o644 for p, m in modes.items() if p.parent == d / "trust"), modes


def test_a_published_certificate_is_one_of_its_member_alone(tmp_path: Path) -> None:
    """The second hostile review: holder a appended a self-signed 'b' certificate to its own
    pki/a.pem; publish copied it whole, the orchestrator pinned every certificate in it, and its
    TLS listener took a for b."""
    from gputravel.crypto.pki import self_signed_member
    from gputravel.service.party import one_certificate, publish_certificate

    for name in ("a", "b"):
        (tmp_path / name).mkdir()
    a, b = (self_signed_member(tmp_path / name, name) for name in ("a", "b"))
    assert one_certificate(a, "a", tmp_path) == a
    with pytest.raises(BadInput, match="expected one certificate, of 'a'; it holds 2"):
        one_certificate(a + b, "a", tmp_path)
    with pytest.raises(BadInput, match="expected one certificate, of 'a'; it holds 1"):
        one_certificate(b, "a", tmp_path)
    (tmp_path / "a.pem").write_bytes(a + b)
    with pytest.raises(BadInput):
        publish_certificate(tmp_path / "a.pem", tmp_path / "public-a.pem", "a")
    assert not (tmp_path / "public-a.pem").exists()


@pytest.mark.skipif(not ROOT, reason="a lock file of another account needs root to make")
def test_a_boot_lock_another_account_made_is_refused(tmp_path: Path) -> None:
    from gputravel.service.members import _try_lock

    lock = tmp_path / "gpu-0.lock"
    lock.write_bytes(b"")
    os.chown(lock, 54321, 54321)
    with pytest.raises(BadInput, match="belongs to uid 54321, not to the services"):
        _try_lock(str(lock))


def test_the_gpu_link_is_taken_only_from_the_gpus_account(tmp_path: Path) -> None:
    """A party that bound the GPU link socket's name first must not pass for the GPU."""
    import socket

    from gputravel.service.members import _gpu_link

    path = str(tmp_path / "gpu.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as squatter:
        squatter.bind(path)
        squatter.listen()
        with pytest.raises(BadInput, match=f"is served by uid {os.geteuid()}, not the GPU's \\(54321\\)"):
            _gpu_link(path, -1, 54321)
        _gpu_link(path, -1, os.geteuid()).close()
