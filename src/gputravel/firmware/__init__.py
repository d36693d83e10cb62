"""The emulated hardware's own processes: what stands for the TDX module and the GPU's
attestation firmware, each an OS process of its own that holds a key no CVM may hold.

- `tdx_module.py`: the TDX module and quoting enclave (`python -m gputravel.cohort.entry
  tdx-module ...`): it makes its quoting key, learns from the launcher which CVM it launched
  and that CVM's measurement, and quotes only for that process; `request_quote` is the CVM's
  side of its socket.
- `gpu.py`: the GPU's attestation firmware for `gputravel attest gpu` (in a cohort the device
  process hosts the same firmware, device/core.py).

They sign the formats `gputravel.attest` defines (quotes, GPU evidence); the checks of what
they sign stay there, pure.
"""
