"""Cryptography for gputravel: the AES-256-GCM channel recipe (`channel`, the only AES-GCM user),
the per-epoch key labels (`labels`), the SPDM key exchange with the device (`spdm`), and the
cohort certificates and emulated device identity (`pki`, `certs`, `device_identity`)."""
