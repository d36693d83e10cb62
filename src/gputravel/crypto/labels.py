"""Labels of the keys derived each epoch, one per CE keyspace and direction as on H100; each
record holds its direction, never parsed from the string. Labels are HKDF inputs: never edit one."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Direction(enum.Enum):
    """Which way a channel's data flows; the CPU side encrypts h2d and decrypts d2h."""

    H2D = "h2d"  # host (CVM) to device
    D2H = "d2h"  # device to host (CVM)


class Privilege(enum.Enum):
    """Whose channel: a data holder's (exported in the context blob) or the orchestrator's."""

    USER = "user"
    KERNEL = "kernel"


@dataclass(frozen=True)
class KeyLabel:
    """One channel direction's key: its HKDF label and what the label stands for."""

    label: str  # the HKDF input, e.g. "Lce00_h2d_user"
    keyspace: str  # the engine it keys: wlc (work launch), lcic (semaphores), ce00 (copy), gsp (RPC)
    direction: Direction
    privilege: Privilege


_H2D, _D2H, _USER, _KERNEL = Direction.H2D, Direction.D2H, Privilege.USER, Privilege.KERNEL

#: Every key of an epoch, by label. The user ones are what a data holder receives in a context
#: blob; the kernel ones (the orchestrator's privileged channel: scrub, rotate, reset) are never
#: exported, so a holder (even colluding with the host) cannot forge a rotation or its completion.
KEYS: dict[str, KeyLabel] = {k.label: k for k in (
    KeyLabel("Lwlc_h2d_user", "wlc", _H2D, _USER),  # pushes on the user work-launch channel
    KeyLabel("Llcic_d2h_user", "lcic", _D2H, _USER),  # its tracking-semaphore payloads
    KeyLabel("Lce00_h2d_user", "ce00", _H2D, _USER),  # bulk copy records into VRAM
    KeyLabel("Lce00_d2h_user", "ce00", _D2H, _USER),  # bulk copy records out of VRAM
    KeyLabel("Lgsp_h2d_user", "gsp", _H2D, _USER),  # RPC requests
    KeyLabel("Lgsp_d2h_user", "gsp", _D2H, _USER),  # RPC responses
    KeyLabel("Lwlc_h2d_kernel", "wlc", _H2D, _KERNEL),  # pushes on the kernel work-launch channel
    KeyLabel("Llcic_d2h_kernel", "lcic", _D2H, _KERNEL),  # its tracking-semaphore payloads
)}

USER_LABELS = tuple(k.label for k in KEYS.values() if k.privilege is Privilege.USER)
KERNEL_LABELS = tuple(k.label for k in KEYS.values() if k.privilege is Privilege.KERNEL)
ALL_LABELS = USER_LABELS + KERNEL_LABELS
#: Push key and tracking-semaphore key of each work-launch channel (index: layout.PushChannel).
PUSH_LABEL = ("Lwlc_h2d_user", "Lwlc_h2d_kernel")
SEM_LABEL = ("Llcic_d2h_user", "Llcic_d2h_kernel")


def direction_of(label: str) -> Direction | None:
    """The direction of a known label; None for a label this build does not derive."""
    key = KEYS.get(label)
    return key.direction if key is not None else None


def is_h2d(label: str) -> bool:
    """Whether a known label runs host to device; KeyError for another: no key on a guessed side."""
    return KEYS[label].direction is Direction.H2D
