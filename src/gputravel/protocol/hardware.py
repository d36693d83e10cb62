"""Hardware profiles: what the steps of a travel cost on the hardware a run stands for.

``emulated`` injects nothing; ``paper-h100`` holds each step, where it really happens, to at
least the paper's measurement (section 7; each cost names its table, column and row), so no
real cost is hidden. Not a security input: it changes how long steps take, never what is
checked. The paper's Tables 1 and 2 are here as printed, the one source of every figure.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, fields

from gputravel.errors import BadInput
from gputravel.protocol.parties import ORCHESTRATOR

MIB = 1 << 20
EMULATED = "emulated"
PAPER_H100 = "paper-h100"

#: The paper's Table 1 ("Breakdown of the GPU Travelling mechanism"), ms, by buffer size (MiB).
TABLE_1_COLUMNS = ("O-Clean Up", "O-Export Key", "DH-PCIe Switching", "DH-Import Key", "DH-Read Dataset",
                   "DH-GPU Write", "DH-Export Key", "SSL Overheads", "O-PCIe Switching", "O-Import Key", "Total Time")
TABLE_1 = {
    4: (0.160, 0.232, 148.029, 0.340, 2.256, 2.976, 0.114, 32.809, 146.647, 0.270, 333.673),
    8: (0.163, 0.229, 147.011, 0.335, 4.369, 5.804, 0.117, 33.321, 147.198, 0.259, 338.642),
    16: (0.198, 0.220, 146.393, 0.338, 9.563, 12.176, 0.116, 32.778, 146.532, 0.242, 348.360),
    32: (0.191, 0.197, 147.867, 0.349, 19.195, 24.336, 0.131, 48.525, 146.794, 0.277, 387.671),
    64: (0.190, 0.165, 146.698, 0.337, 38.464, 47.557, 0.118, 32.466, 146.131, 0.269, 412.204),
    128: (0.224, 0.206, 145.773, 0.371, 76.353, 92.261, 0.122, 35.466, 146.757, 0.279, 497.589),
    256: (0.274, 0.427, 143.073, 0.345, 147.382, 178.816, 0.137, 35.686, 146.134, 0.282, 652.282),
    512: (0.533, 0.206, 147.968, 0.322, 288.922, 349.278, 0.131, 44.112, 147.727, 0.303, 978.969),
}
#: The paper's Table 2 (llm.c, one 512 MiB buffer), s and %, per link (Mbit/s; None: uncapped, ~1 Gbit/s).
TABLE_2_COLUMNS = ("Baseline Training", "Baseline Tx", "Baseline Tx Percentage", "Ours Training", "Ours Tx",
                   "Ours Tx Percentage")
TABLE_2 = {
    4.0: (1230.00, 1115.88, 47.568, 1230.26, 1.01, 0.082),
    20.0: (1231.39, 230.84, 15.787, 1229.39, 1.03, 0.084),
    100.0: (1231.17, 60.36, 4.674, 1230.57, 1.02, 0.083),
    500.0: (1230.73, 15.86, 1.272, 1229.67, 0.98, 0.080),
    None: (1229.36, 7.34, 0.594, 1231.46, 0.98, 0.079),
}
TABLE_2_BUFFER_MIB = 512


def table_1(size_mib: int, column: str) -> float:
    """One cell of Table 1 (BadInput off the table)."""
    if size_mib not in TABLE_1 or column not in TABLE_1_COLUMNS:
        raise BadInput(f"Table 1 has no cell ({size_mib} MiB, {column!r})")
    return TABLE_1[size_mib][TABLE_1_COLUMNS.index(column)]


@dataclass(frozen=True)
class Cost:
    """One injected cost: ``ms`` for a step, or ms per MiB for a rate (``per_mib``)."""

    ms: float
    per_mib: bool
    source: str  # the paper's table, column and row
    injected_at: str  # where the emulation waits for it

    def seconds(self, nbytes: int = 0) -> float:
        return (self.ms * nbytes / MIB if self.per_mib else self.ms) / 1e3

    def to_json(self) -> dict[str, object]:
        return {"ms_per_mib" if self.per_mib else "ms": self.ms, "source": self.source, "injected_at": self.injected_at}


def _t1(column: str, size: int = 512, *, per_mib: bool = False, at: str) -> Cost:
    value = table_1(size, column)
    return Cost(value / size if per_mib else value, per_mib,
                f"paper Table 1, column {column!r}, row {size} MiB" + (f" ({value} ms / {size} MiB)" if per_mib else ""), at)


@dataclass(frozen=True)
class HardwareProfile:
    """Floors on the steps of a travel and of the TLS baseline; None: nothing injected."""

    name: str
    switch_to_holder: Cost | None = None  # each MUX switch to a data holder's CVM
    switch_to_orchestrator: Cost | None = None  # each MUX switch back to the orchestrator
    dataset_read: Cost | None = None  # a holder reading its dataset (rate)
    gpu_write: Cost | None = None  # writing into the GPU's protected memory (rate)
    context_exchange: Cost | None = None  # the context blob's round trip over TLS, per travel

    def costs(self) -> dict[str, Cost]:
        return {f.name: getattr(self, f.name) for f in fields(self) if isinstance(getattr(self, f.name), Cost)}

    def switch_s(self, target: str) -> float:
        cost = self.switch_to_orchestrator if target == ORCHESTRATOR else self.switch_to_holder
        return cost.seconds() if cost else 0.0

    def read_s(self, nbytes: int) -> float:
        return self.dataset_read.seconds(nbytes) if self.dataset_read else 0.0

    def write_s(self, nbytes: int) -> float:
        return self.gpu_write.seconds(nbytes) if self.gpu_write else 0.0

    def copy_s(self, nbytes: int) -> float:
        """A travel's copy: read, then write (Table 1's two columns); no overlap is credited."""
        return self.read_s(nbytes) + self.write_s(nbytes)

    def exchange_s(self) -> float:
        return self.context_exchange.seconds() if self.context_exchange else 0.0

    def to_json(self) -> dict[str, object]:
        """What a benchmark's JSON says about the hardware it stood for."""
        return {"profile": self.name, "injected": {n: c.to_json() for n, c in self.costs().items()}}


PROFILES = {
    EMULATED: HardwareProfile(EMULATED),
    PAPER_H100: HardwareProfile(
        PAPER_H100,
        switch_to_holder=_t1("DH-PCIe Switching", at="host: each switch to a holder is held until this has elapsed"),
        switch_to_orchestrator=_t1("O-PCIe Switching", at="host: each switch to the orchestrator is held likewise"),
        dataset_read=_t1("DH-Read Dataset", per_mib=True, at="holder: the copy of a travel (with gpu_write); "
                                                             "the baseline's reads, as a rate over the chunk"),
        gpu_write=_t1("DH-GPU Write", per_mib=True, at="holder: the copy of a travel (with dataset_read); "
                                                       "orchestrator: the baseline's write into VRAM"),
        context_exchange=_t1("SSL Overheads", at="orchestrator: the travel's TLS step (request out, reply in, "
                                                 "less the holder's handling)"),
    ),
}


def hardware_profile(name: str) -> HardwareProfile:
    profile = PROFILES.get(name)
    if profile is None:
        raise BadInput(f"unknown hardware profile {name!r}: choose {' or '.join(PROFILES)}")
    return profile


# ----------------------------------------------------------------------------- waiting
def hold_until(started: float, floor_s: float, *, clock: Callable[[], float] = time.perf_counter,
               sleep: Callable[[float], None] = time.sleep) -> float:
    """Wait until ``floor_s`` has elapsed since ``started`` (a ``clock`` reading); the seconds added."""
    left = started + floor_s - clock()
    added = max(left, 0.0)
    while left > 0:
        sleep(left)
        left = started + floor_s - clock()
    return added


@contextmanager
def at_least(floor_s: float, *, clock: Callable[[], float] = time.perf_counter) -> Iterator[None]:
    """The block takes at least ``floor_s``: a block that fails is not held (its error goes up at once)."""
    started = clock()
    yield
    if floor_s > 0:
        hold_until(started, floor_s, clock=clock)


def hold_exchange(profile: HardwareProfile, sent: float, remote_s: float, *,
                  clock: Callable[[], float] = time.perf_counter, sleep: Callable[[float], None] = time.sleep) -> float:
    """Hold a round trip sent at ``sent`` to the profile's context exchange, less the peer's
    ``remote_s`` handling, clamped to what elapsed so a peer cannot stretch the wait."""
    remote = min(max(remote_s, 0.0), clock() - sent)
    return hold_until(sent + remote, profile.exchange_s(), clock=clock, sleep=sleep)
