"""Labels of the per-channel keys derived in each epoch (one key per CE keyspace and direction, as
H100 does). The direction is part of each label's record, never parsed out of the string."""

from __future__ import annotations



#: Labels of the keys a data holder receives in a context blob (one key per CE keyspace and
#: direction, as H100 does: e.g. ``Lce00_h2d_user``).
USER_LABELS = (
    "Lwlc_h2d_user",  # pushes on the user work-launch channel
    "Llcic_d2h_user",  # its tracking-semaphore payloads
    "Lce00_h2d_user",  # bulk copy records into VRAM
    "Lce00_d2h_user",  # bulk copy records out of VRAM
    "Lgsp_h2d_user",  # RPC requests
    "Lgsp_d2h_user",  # RPC responses
)
#: Labels of the orchestrator's privileged channel: scrub, rotate, reset. Never exported, so a
#: holder (even colluding with the host) cannot forge a rotation or its completion.
KERNEL_LABELS = ("Lwlc_h2d_kernel", "Llcic_d2h_kernel")
ALL_LABELS = USER_LABELS + KERNEL_LABELS
#: Push key and tracking-semaphore key of each work-launch channel (index: layout.PushChannel).
PUSH_LABEL = ("Lwlc_h2d_user", "Lwlc_h2d_kernel")
SEM_LABEL = ("Llcic_d2h_user", "Llcic_d2h_kernel")
