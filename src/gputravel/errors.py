"""Typed errors: local (our misuse or bad input) and remote (a peer misbehaved). Messages name what
failed and what to fix, never key material, plaintext or context blobs."""

from __future__ import annotations


class GputravelError(Exception):
    """Base of every error gputravel raises on purpose."""


# ----------------------------------------------------------------------------- local errors
class LocalError(GputravelError):
    """Something on this side is wrong: bad input, bad configuration, misuse of an API."""


class Terminated(LocalError):
    """This process was asked to stop (SIGTERM) while it ran a deployment of processes."""


class BadInput(LocalError):
    """An argument or configuration value is invalid; the message says what to fix."""


class TravelLogMismatch(BadInput):
    """A resumed job's travel log is not the one its checkpoint was taken in: refused, rather than
    start a log that leaves earlier travels out."""


class SealedError(BadInput):
    """A sealed file does not open with this key: sealed for another orchestrator measurement, job
    or purpose, corrupt, or not sealed at all. Says which where it can, never a byte of the key."""


def number_in(value: float, flag: str, low: float = 0.0, high: float = float("inf"), *,
              low_included: bool = False, unit: str = "") -> float:
    """`value` if a finite number above `low` (or equal, with `low_included`) and at most `high`;
    else BadInput naming `flag`. NaN is refused explicitly: it passes any range check."""
    above = value >= low if low_included else value > low
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value \
            or value in (float("inf"), float("-inf")) or not above or value > high:
        bound = f"at least {low:g}" if low_included else ("positive" if low == 0 else f"above {low:g}")
        top = f" and at most {high:g}{unit}" if high != float("inf") else ""
        raise BadInput(f"{flag} must be a finite number, {bound}{top}, got {value!r}")
    return value


class IllegalTransition(LocalError):
    """A protocol state machine was asked to do something its current state does not allow."""

    def __init__(self, role: str, state: str, action: str) -> None:
        super().__init__(f"{role}: cannot {action} in state {state}")
        self.role = role
        self.state = state
        self.action = action


class EpochSpent(LocalError):
    """An epoch's user keys already reached a party and may not reach another: rotate first."""


class CounterExhausted(LocalError):
    """An IV counter would wrap: the channel must be re-keyed before it is used again."""


# ----------------------------------------------------------------------------- remote errors
class RemoteError(GputravelError):
    """A peer (process, device, holder, host) sent something wrong or failed to answer."""


class IntegrityError(RemoteError):
    """Authenticated decryption failed. Deliberately opaque: which byte or key is never said."""

    def __init__(self, what: str = "authenticated decryption failed") -> None:
        super().__init__(what)


class PeerAttestationError(RemoteError):
    """A rank of a data-parallel job refused another's evidence before any gradient moved: the
    evidence did not verify, or did not carry the key the rank offered (ddp/keys.py)."""

    def __init__(self, what: str, *, refused: tuple[tuple[int, int], ...] = ()) -> None:
        super().__init__(what)
        self.refused = refused  # (refusing rank, refused rank) pairs, as far as this rank knows


class ProtocolError(RemoteError):
    """A message or blob could not be decoded or is not valid in this protocol state."""


class ContextBlobError(ProtocolError):
    """A context blob is corrupted, of an unknown version, or from another key epoch."""


class ChannelFaulted(RemoteError):
    """The device faulted a channel after an integrity failure; the orchestrator must reset it."""


class DeviceError(RemoteError):
    """The device rejected a command (bad address, out-of-range copy, unmapped DMA)."""


class PeerTimeout(RemoteError):
    """A peer did not answer in time (a dropped push, a holder that never returns the GPU)."""


class TravelHalted(RemoteError):
    """Fail closed: a rotation was not confirmed, so nothing travels until a new SPDM session
    re-keys and wipes the GPU (if that fails too, the cohort stops)."""


class TransportClosed(RemoteError):
    """The peer closed the connection."""


class HolderLost(RemoteError):
    """A holder died, hung or broke the protocol during a travel: the GPU is back, keys rotated,
    the partial chunk unused, and the holder offline until it joins again."""

    def __init__(self, holder: str, why: str, during: str = "a travel") -> None:
        super().__init__(f"holder {holder!r} lost during {during}: {why}")
        self.holder = holder


class ContextRefused(HolderLost, ContextBlobError):
    """A holder returned a context it could not have: dropped as a lost holder, and training goes
    on without it."""

    def __init__(self, holder: str, why: str) -> None:
        super().__init__(holder, f"it returned a context that was refused: {why}")


def one_line(exc: BaseException) -> str | None:
    """What a command prints for `exc`, in one line (then exits 1); None: a bug, which keeps its traceback.
    A typed error, an OSError on a path and a RecursionError (input nested too deeply)."""
    if isinstance(exc, GputravelError):
        return _shown(str(exc))
    if isinstance(exc, OSError) and exc.filename is not None:  # not about a path: ours to fix
        where = exc.filename if exc.filename2 is None else f"{exc.filename} -> {exc.filename2}"
        return _shown(f"{exc.strerror or exc}: {where}")
    if isinstance(exc, RecursionError):
        return "the input is nested too deeply to read (RecursionError); if it is not, this is a bug: please report it"
    return None


def _shown(text: str) -> str:
    """`text` with control characters but newlines and tabs escaped: a peer's words (a Failed reason, a
    log line, a path) must not move the cursor or rewrite the operator's terminal."""
    return "".join(c if c.isprintable() or c in "\n\t" else repr(c)[1:-1] for c in text)


# Builtins, and the libraries training runs (whose errors say what failed, as Python's do).
_NAMED = ("builtins", "torch", "numpy")
_CHAIN_LINKS = 32  # of a chain, the newest printed: a longer one (a loop re-raising) would fill the log


def safe_traceback(exc: BaseException) -> str:
    """`exc`'s traceback in words safe to log, its chain in Python's order: our typed errors with their
    words (ours, naming no value); any other by its type and gputravel line (`failed_where`), never its
    message, which may quote a record or a secret; each frame as file, line and function, with no
    source line (read from disk when printed); no note."""
    import traceback  # lazy: only a failure needs it

    out: list[str] = []
    for link, how in reversed(_chain(exc)):
        frames = traceback.StackSummary.extract(traceback.walk_tb(link.__traceback__), lookup_lines=False)
        if _ours_in_words(link):
            said = f"{type(link).__name__}: {_shown(link.args[0])}"
        elif isinstance(link, GputravelError):  # no words of ours to show
            said = f"{named_class(type(link), ('gputravel',)) or 'an error of ours'} (its arguments withheld)"
        else:
            said = f"{failed_where(link)} (its message withheld: it may quote a record or a secret)"
        out += ["Traceback (most recent call last):\n", *(f'  File "{f.filename}", line {f.lineno}, in {f.name}\n'
                                                          for f in frames), said + "\n", how]
    return "".join(out).rstrip("\n")


def _ours_in_words(exc: BaseException) -> bool:
    """A typed error of ours made of one string, our words; anything else is shown by its type."""
    return isinstance(exc, GputravelError) and len(exc.args) == 1 and type(exc.args[0]) is str


def words(exc: GputravelError) -> str:
    """A typed error's words, to send or log: its one string, ours; "" for other arguments."""
    return exc.args[0] if _ours_in_words(exc) else ""


def _chain(exc: BaseException) -> list[tuple[BaseException, str]]:
    """`exc`, then what it was raised from or while handling, as Python walks them; with the words
    Python puts between each and the one printed after it."""
    chain: list[tuple[BaseException, str]] = []
    seen: set[int] = set()
    link: BaseException | None = exc
    how = ""
    while link is not None and id(link) not in seen and len(chain) < _CHAIN_LINKS:
        seen.add(id(link))
        chain.append((link, how))
        if link.__cause__ is not None:
            link, how = link.__cause__, "\nThe above exception was the direct cause of the following exception:\n\n"
        elif not link.__suppress_context__:
            link, how = link.__context__, "\nDuring handling of the above exception, another exception occurred:\n\n"
        else:
            link = None
    return chain


def failed_where(exc: BaseException) -> str:
    """`exc` in words safe to log, for a failure of no type of ours: its type (when Python, torch or numpy
    define it) and the last line of this package it passed through; never its message, which may quote
    a record (torch's "Target 12 is out of bounds" names a holder's label)."""
    import traceback  # lazy: only a failure needs it

    try:
        package = "/" + __name__.partition(".")[0] + "/"
        paths = [(f.filename.replace("\\", "/"), f.lineno)
                 for f in traceback.StackSummary.extract(traceback.walk_tb(exc.__traceback__), lookup_lines=False)]
        ours = [(path[path.rindex(package) + 1:], line) for path, line in paths if package in path]
    except Exception:  # noqa: BLE001 (said as no place rather than fail inside a failure's report)
        ours = []
    kind = named_type(exc) or "an exception of other code"
    return f"{kind} at {ours[-1][0]}:{ours[-1][1]}" if ours else kind


def named_type(exc: BaseException) -> str | None:
    """`exc`'s type name if Python, torch or numpy defines that very class; None for any other, whose
    name (like its message) is its code's to choose, and for a class that only claims such a module."""
    return named_class(type(exc))


def named_class(cls: type, roots: tuple[str, ...] = _NAMED) -> str | None:
    """`cls.__name__` if a module of `roots` (Python, torch, numpy) defines that very class (an
    exception's, a warning's)."""
    import sys  # lazy: as above

    try:
        module = cls.__module__
        if not isinstance(module, str) or module.partition(".")[0] not in roots or module not in sys.modules:
            return None
        found: object = sys.modules[module]
        for part in cls.__qualname__.split("."):
            found = getattr(found, part)
    except Exception:  # noqa: BLE001 (a class that lies about its name is not named)
        return None
    return cls.__name__ if found is cls else None
