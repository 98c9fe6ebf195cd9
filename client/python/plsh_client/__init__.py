"""Python client of plsh-server (ALiBi attention: exact, positional LSH, window).

    from plsh_client import Client
    with Client("127.0.0.1:50051") as c:
        out, meta = c.attend(q, k, v, mode="lsh", samples=64, causal=True)

q is [B, Nq, H, D] (or [Nq, H, D]), k and v [B, Nk, Hkv, D]; float32 or
float16 numpy arrays. The request is streamed in chunks of rows sized to the
payload limit the server states in its ack, so any length goes through.
Defaults and limits are the server's: options left as None are not sent, and
the server applies the defaults that c.info().defaults lists. Errors raise
PlshError, which carries the gRPC status code.

Training (SPEC section 8): keep_context=True keeps the forward's context on
the server, and the backward sends only dout:

    out, meta = c.attend(q, k, v, mode="lsh", keep_context=True)
    dq, dk, dv, bmeta = c.backward(dout, context_id=meta["context_id"])

(or statelessly: c.backward(dout, q=q, k=k, v=v, out=out, lse=lse, ...));
c.release_context(id) drops a context no backward will use. PyTorch:
plsh_client.torch.attention, an autograd op over these calls.

A server with TLS and bearer tokens:

    Client("plsh.example:50051", tls_ca="ca.crt", token_file="plsh.token")
    # client certificates: also tls_cert="client.crt", tls_key="client.key"

Several replicas of one service (a list of targets, or a dns: name whose
every address is a replica) can share one request, cut by heads or by
sequence, with the same output bit for bit (plsh_client.sharding):

    from plsh_client import ShardedClient
    with ShardedClient("a:50051,b:50051,c:50051") as c:
        out, meta = c.attend(q, k, v, mode="lsh", causal=True)   # meta["sharding"]: the cut, replicas, timings

The generated stubs (plsh/v1/plsh_pb2.py, ...) are built by CMake into
<build>/python; that directory must be on sys.path (PYTHONPATH), or set
PLSH_PYTHON_STUBS to it.
"""

from ._client import Client, PlshError
from ._shm import SharedMemoryRegion
from .sharding import ShardedClient

__all__ = ["Client", "PlshError", "ShardedClient", "SharedMemoryRegion"]
