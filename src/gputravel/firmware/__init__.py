"""The emulated hardware's own processes (the TDX module, the GPU's attestation firmware), each
holding a key no CVM may hold; the checks of what they sign stay in `gputravel.attest`, pure."""
