"""Cryptography for gputravel.

* `channel` - the AES-256-GCM channel recipe (the only AES-GCM user in the project).
* `spdm`    - SPDM-style key exchange between the orchestrator's driver and the device.
* `pki`     - cohort certificates for TLS 1.3 and the emulated device identity.

The channel API is re-exported here because nearly every layer needs it; `spdm` and `pki`
are imported as submodules by the few places that use them.
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
    build_iv,
    derive_epoch_keys,
    gcm_nonce,
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
    "build_iv",
    "derive_epoch_keys",
    "gcm_nonce",
]
