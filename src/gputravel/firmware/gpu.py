"""The emulated GPU's attestation firmware as its own OS process, for `gputravel attest gpu`: its
firmware key stays in ``python -m gputravel.firmware.gpu STATE_DIR FD``, which answers GetEvidence.
"""

from __future__ import annotations

import socket
import sys
from pathlib import Path

from gputravel.processes import Children
from gputravel.errors import GputravelError, ProtocolError, TransportClosed
from gputravel.protocol.rpc import Evidence, GetEvidence
from gputravel.transport.stream import StreamTransport
from gputravel.protocol.codec import encode
from gputravel.attest.provision import GpuDevice


class FirmwareProcess:
    """A running firmware process; `evidence(nonce)` asks it for fresh evidence."""

    def __init__(self, state: Path, timeout: float = 30.0) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.timeout = timeout
        self._children = Children(5)
        self.proc = self._children.start("gpu-firmware", [sys.executable, "-P", "-m", __name__, str(state),
                                                          str(theirs.fileno())], pass_fds=[theirs.fileno()])
        theirs.close()
        self.link = StreamTransport(ours, "gpu-firmware")

    def evidence(self, nonce: bytes) -> bytes:
        self.link.send(GetEvidence(nonce=nonce))
        reply = self.link.recv(timeout=self.timeout, expect=Evidence).message
        assert isinstance(reply, Evidence)
        return reply.blob

    def close(self) -> None:
        self.link.close()
        self._children.close(asked=True)  # it ends with its link

    def __enter__(self) -> FirmwareProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def main(argv: list[str]) -> int:
    firmware = GpuDevice.load(Path(argv[0])).firmware()
    link = StreamTransport(socket.socket(fileno=int(argv[1])), "verifier")
    while True:
        try:
            request = link.recv(expect=GetEvidence).message
        except TransportClosed:
            return 0
        except ProtocolError:
            return 1  # a verifier that sends garbage gets nothing more
        assert isinstance(request, GetEvidence)
        try:
            link.send(Evidence(blob=encode(firmware.get_evidence(request.nonce))))
        except GputravelError:
            return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
