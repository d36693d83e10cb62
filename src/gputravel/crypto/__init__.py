"""Cryptography for gputravel.

* `channel` - the AES-256-GCM channel recipe (the only AES-GCM user in the project).
* `labels`  - the per-channel key labels of an epoch, each with its direction and privilege.
* `spdm`    - SPDM-style key exchange between the orchestrator's driver and the device.
* `pki`, `certs`, `device_identity` - cohort certificates for TLS 1.3 and the emulated device identity.

The public channel API is re-exported here because nearly every layer needs it; the IV and
nonce helpers behind it (build_iv, gcm_nonce) stay in `channel`, where its tests reach them.
The other submodules are imported by the few places that use them.
"""

from gputravel.crypto.channel import (
    IV_BYTES,
    KEY_BYTES,
    MAX_CHANNEL_COUNTER,
    MAX_MESSAGE_COUNTER,
    TAG_BYTES,
    ChannelState,
    KeyMaterial,
    Receiver,
    Sender,
    derive_epoch_keys,
)

__all__ = [
    "IV_BYTES",
    "KEY_BYTES",
    "MAX_CHANNEL_COUNTER",
    "MAX_MESSAGE_COUNTER",
    "TAG_BYTES",
    "ChannelState",
    "KeyMaterial",
    "Receiver",
    "Sender",
    "derive_epoch_keys",
]
