"""Where each party of one local cohort runs: its uid, its own directory (parties/KEY/, 0700,
its own), the descriptors and paths it is handed. Isolation off, every path is handed as is.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import warnings
from pathlib import Path

from gputravel.errors import BadInput, GputravelError
from gputravel.cohort import isolation
from gputravel.cohort.isolation import Isolation


class Placement:
    def __init__(self, directory: Path, isolate: bool | None) -> None:
        self.dir = directory
        on, reason = isolation.decide(isolate)
        self.reach: dict[str, tuple[str, ...]] = {}
        if on:
            try:
                self.reach = isolation.interpreter_reach()
            except BadInput as exc:
                if isolate:
                    raise
                on, reason = False, f"this Python cannot run under another uid: {exc}"
        if not on and isolate is None:
            warnings.warn(f"process isolation is off: {reason}. Parties can read each other's memory and "
                          "files; tests/test_isolation.py skips its checks.", RuntimeWarning, stacklevel=4)
        self.isolation = Isolation(on, reason)
        self._base = isolation.allocate_block() if on else 0
        self._uids: dict[str, int] = {}
        self._fds: dict[str, list[int]] = {}  # descriptors handed to one party (datasets, lent outputs)
        self._lent: list[tuple[Path, int, int, int]] = []  # (path, descriptor, former uid, former gid)
        self.root_fd = os.open(directory, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC) if on else -1
        if on:
            os.chmod(directory, 0o711)  # searchable, not listable: each party finds only its own
        for sub in ("parties", "sockets"):
            (directory / sub).mkdir(mode=0o711)

    @property
    def on(self) -> bool:
        return self.isolation.on

    # ------------------------------------------------------------------ ids and paths
    def uid(self, key: str) -> int:
        if key not in self._uids:
            self._uids[key] = self._base + 1 + len(self._uids)
            if len(self._uids) >= isolation.BLOCK:
                raise BadInput(f"a cohort has at most {isolation.BLOCK - 1} parties")
        return self._uids[key]

    def path(self, p: Path) -> str:
        """How a child names a path in the cohort directory: through the launcher's descriptor."""
        if not self.on:
            return str(p)
        return f"/proc/self/fd/{self.root_fd}/{Path(p).relative_to(self.dir)}"

    def own(self, path: Path, key: str, mode: int = 0o700) -> Path:
        if self.on:
            isolation.give(path, self.uid(key), mode)
        return path

    def party_dir(self, key: str) -> Path:
        d = self.dir / "parties" / key
        d.mkdir(mode=0o700, exist_ok=True)
        return self.own(d, key)

    @property
    def socket_dir(self) -> Path:
        return self.own(self.dir / "sockets", "host", 0o711)

    # ------------------------------------------------------------------ starting a child
    def popen_kwargs(self, key: str, netns: str | None) -> dict:
        home = self.party_dir(key)
        if not self.on:
            return {"preexec_fn": isolation.die_with_parent, "pass_fds": self._fds.get(key, [])}
        env = {**os.environ, **isolation.private_env(self.path(home)), "GPUTRAVEL_NONDUMPABLE": "1"}
        return {"preexec_fn": isolation.dropper(self.uid(key), netns=netns, reach=self.reach), "env": env,
                "cwd": str(home), "pass_fds": [self.root_fd, *self._fds.get(key, [])]}

    def check(self, key: str, pid: int) -> None:
        """A party not isolated as planned (read back from /proc) stops the cohort."""
        try:
            got = isolation.read_party(pid)
        except (OSError, KeyError, ValueError):
            return  # it already ended: the caller sees that on its control link
        self.isolation.parties[key] = got
        if self.on and (got.uid != self.uid(key) or got.groups or got.dumpable is not False):
            raise GputravelError(f"{key} is not isolated: uid {got.uid} (planned {self.uid(key)}), "
                                 f"groups {list(got.groups)}, dumpable {got.dumpable}")

    def _hand(self, key: str, path: Path) -> int:
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)  # what a child needs; never followed by the launcher
        self._fds.setdefault(key, []).append(fd)
        return fd

    # ------------------------------------------------------------------ inputs
    def dataset(self, key: str, path: str) -> str:
        """A holder's dataset (and a shard's tokenizer.json), handed as a descriptor behind a link: a
        directory (shards, or a record dataset's records.npy and schema.json) is read through it."""
        if not self.on:
            return path
        source = Path(path).resolve()
        if not source.exists():
            raise BadInput(f"dataset of holder {key!r} does not exist: {path}")
        closed = isolation.readable_by_others(source)
        if closed is not None:
            raise BadInput(f"dataset of holder {key!r}: {closed} is not readable by other users, so not by "
                           f"the holder's uid {self.uid(key)}: make it readable (chmod o+r, o+x for directories) "
                           "or run the cohort with isolate=False")
        links = self.party_dir(key) / "dataset"
        links.mkdir(exist_ok=True)
        extra = [source.parent / "tokenizer.json"] if source.is_file() else []
        for item in [source, *(p for p in extra if p.is_file())]:
            link = links / item.name
            link.unlink(missing_ok=True)
            link.symlink_to(f"/proc/self/fd/{self._hand(key, item)}")
        self.own(links, key)
        return self.path(links / source.name)

    # ------------------------------------------------------------------ outputs
    def lend_dir(self, key: str, path: str) -> None:
        """Lend `key` a directory it writes into until `close`."""
        if not self.on:
            return
        p = Path(path).resolve()
        p.mkdir(parents=True, exist_ok=True)
        self._lend(key, p)

    def lend_file(self, key: str, path: str) -> str:
        """Lend `key` a file it writes (the travel log), created empty if missing; named through /proc."""
        if not self.on:
            return path
        p = Path(path).resolve()
        inside = self._inside_lent(p)
        if inside is not None:
            return inside
        if not p.parent.is_dir():
            raise BadInput(f"{p.parent} does not exist")
        os.close(os.open(p, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o644))
        return f"/proc/self/fd/{self._lend(key, p)}"

    def _lend(self, key: str, p: Path) -> int:
        st = p.stat()
        fd = self._hand(key, p)
        self._lent.append((p, fd, st.st_uid, st.st_gid))
        isolation.give(p, self.uid(key))
        return fd

    def _inside_lent(self, p: Path) -> str | None:
        for lent, fd, _, _ in self._lent:
            if lent.is_dir() and (p == lent or lent in p.parents):
                rel = p.relative_to(lent)
                return f"/proc/self/fd/{fd}" + ("" if rel == Path(".") else f"/{rel}")
        return None

    def output(self, key: str, path: str) -> str:
        """How `key` names a path it writes or reads later (a run directory)."""
        if not self.on or not path:
            return path
        p = Path(path).resolve()
        inside = self._inside_lent(p)
        if inside is not None:
            return inside
        closed = isolation.unreachable(p)
        if closed is not None:
            raise BadInput(f"{key} (uid {self.uid(key)}) cannot reach {p}: {closed} is closed to other users. "
                           "Lend it with CohortConfig.output_dirs, pick a path other users can reach, or "
                           "run the cohort with isolate=False")
        return path

    def stage(self, key: str, path: str) -> str:
        """How `key` names a file it only reads (a checkpoint): through what it was lent, or a copy
        in its own directory. Root follows no link at either end: a link the party planted cannot
        make it read or overwrite another file."""
        if not self.on or not path:
            return path
        inside = self._inside_lent(Path(path).resolve())
        if inside is not None:
            return inside
        # Descriptors all the way: nothing the party swaps in (a link, a FIFO) redirects root.
        home = self.dir / "parties" / key
        name = Path(path).name
        try:
            src = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as exc:
            raise BadInput(f"cannot hand {path} to {key}: {exc.strerror}") from None
        dir_fd = -1
        try:
            if not stat.S_ISREG(os.fstat(src).st_mode):
                raise BadInput(f"cannot hand {path} to {key}: not a regular file")
            dir_fd = os.open(home, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name, dir_fd=dir_fd)  # a link there is removed, never written through
            dst = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                          dir_fd=dir_fd)
            os.fchown(dst, self.uid(key), self.uid(key))
            with os.fdopen(dst, "wb") as out, os.fdopen(os.dup(src), "rb") as inp:
                shutil.copyfileobj(inp, out)
        except OSError as exc:
            raise BadInput(f"cannot hand {path} to {key}: {exc.strerror}") from None
        finally:
            os.close(src)
            if dir_fd >= 0:
                os.close(dir_fd)
        return self.path(home / name)

    def close(self) -> None:
        """Give lent outputs back to their owners; close every descriptor; never raises."""
        for path, _, uid, gid in self._lent:
            try:
                for p in [path, *(path.rglob("*") if path.is_dir() else ())]:
                    os.chown(p, uid, gid, follow_symlinks=False)
            except OSError as exc:
                warnings.warn(f"could not give {path} back to uid {uid}: {exc}", RuntimeWarning, stacklevel=3)
        self._lent.clear()
        for fd in [self.root_fd, *(f for fds in self._fds.values() for f in fds)]:
            if fd >= 0:
                os.close(fd)
        self._fds.clear()
        self.root_fd = -1
