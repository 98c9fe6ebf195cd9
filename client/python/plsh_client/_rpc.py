"""Where plsh_client meets grpc: PlshError, what every failed call raises,
and the handshake of the two streamed calls (Client.attend's Attend and
Client.backward's AttendBackward). Apart from _client.py so that both
calls' modules share one copy of it."""

import contextlib
import threading
from typing import Any, Iterator, Optional

import grpc


class PlshError(Exception):
    """A failed call: `code` is the grpc.StatusCode, `code_name` its name
    ("INVALID_ARGUMENT"), `details` the server's message."""

    def __init__(self, code: Optional[grpc.StatusCode], details: Optional[str]) -> None:
        self.code = code
        self.code_name = code.name if code is not None else "UNKNOWN"
        self.details = details or ""
        super().__init__(f"{self.code_name}: {self.details}")


@contextlib.contextmanager
def rpc_errors() -> Iterator[None]:
    """A grpc.RpcError as a PlshError, without grpc's traceback."""
    try:
        yield
    except grpc.RpcError as e:
        raise PlshError(e.code(), e.details()) from None


class Stream:
    """One streamed call's handshake: its request generator (run by grpc on
    another thread) sends the header, then, when it does not know the
    server's chunk limit already, waits for the ack that states it; the
    caller's response loop hands the ack over, and the summary that ends
    the stream."""

    def __init__(self) -> None:
        self.ack: Any = None
        self.summary: Any = None
        self._acked = threading.Event()

    def wait_ack(self) -> Any:
        """The server's ack; None when the call ended without one (send nothing more)."""
        self._acked.wait()
        return self.ack

    def take(self, message: Any) -> Optional[str]:
        """Keeps a response's ack or summary; returns its kind, for the caller's chunks."""
        kind: Optional[str] = message.WhichOneof("kind")
        if kind == "ack":
            self.ack = message.ack
            self._acked.set()
        elif kind == "summary":
            self.summary = message.summary
        return kind

    @contextlib.contextmanager
    def receiving(self) -> Iterator[None]:
        """Around the response loop: errors as PlshError, a request generator
        still waiting for the ack released however the loop ends, and a
        stream that closed without its summary an error."""
        try:
            with rpc_errors():
                yield
        finally:
            self._acked.set()
        if self.summary is None:
            raise PlshError(grpc.StatusCode.INTERNAL, "the server closed the stream without a summary")


def ack_payload(ack: Any) -> int:
    """The input chunk payload an ack allows: max_chunk_payload_bytes
    (servers older than that field said it only as out_chunk_bytes)."""
    return int(ack.max_chunk_payload_bytes or ack.out_chunk_bytes)


def payload_cap(server_cap: int, chunk_bytes: int) -> int:
    """Input chunk payload: the server's cap, or chunk_bytes when smaller and > 0."""
    return min(chunk_bytes, server_cap) if chunk_bytes > 0 else server_cap
