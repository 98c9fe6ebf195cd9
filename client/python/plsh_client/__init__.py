"""Python client of plsh-server (ALiBi attention: exact, positional LSH, window).

    pip install ./client/python        # in a venv made with --system-site-packages (Debian 12)

    from plsh_client import Client
    with Client("127.0.0.1:50051") as c:          # None: $PLSH_TARGET, else 127.0.0.1:50051
        r = c.attend(q, k, v, mode="lsh", samples=64, causal=True)
    r.out, r.estimated_rel_err, r.summary.probe, r.heads, r.timings, r.seed

q is [B, Nq, H, D] (or [Nq, H, D]), k and v [B, Nk, Hkv, D]: layout="bnhd",
plsh's own and FlashAttention's; layout="bhnd" takes (and returns)
scaled_dot_product_attention's [B, H, N, D]. Shapes that look transposed
are refused, naming the tensor (plsh_client._layout says the rules).
float32 or float16 numpy arrays, one dtype for all three. Small requests go
in one message each way (AttendUnary), others are streamed in chunks sized
to the server's payload limit, so any length goes through. Defaults and
limits are the server's: options left as None are not sent, and the server
applies the defaults that c.info().defaults lists. Errors raise PlshError,
which carries the gRPC status code; arguments the client can tell are
wrong raise ValueError before anything is sent.

Training (SPEC section 8): keep_context=True keeps the forward's context on
the server, and the backward sends only dout:

    r = c.attend(q, k, v, mode="lsh", keep_context=True)
    g = c.backward(dout, context_id=r.context_id)       # g.dq, g.dk, g.dv

(or statelessly: c.backward(dout, q=q, k=k, v=v, out=r.out, lse=r.lse,
mode="lsh", seed=r.seed)); c.release_context(id) drops a context no backward
will use. PyTorch: plsh_client.torch.attention, a differentiable op with
fresh lsh draws per training step, and plsh_client.torch.ALiBiAttention.

A server with TLS and bearer tokens:

    Client("plsh.example:50051", tls_ca="ca.crt", token_file="plsh.token")   # or $PLSH_TOKEN
    # client certificates: also tls_cert="client.crt", tls_key="client.key"

Several replicas of one service (a list of targets, or a dns: name whose
every address is a replica) can share one request, cut by heads or by
sequence, with the same output bit for bit (plsh_client.sharding):

    from plsh_client import ShardedClient
    with ShardedClient("a:50051,b:50051,c:50051") as c:
        r = c.attend(q, k, v, mode="lsh", causal=True)      # r.sharding: the cut, replicas, timings

Results still unpack as the unpackaged client's tuples did: `out, meta = c.attend(...)`
(meta: the nested dict, AttendResult.meta).
"""

from ._client import Client
from ._layout import LAYOUTS, LayoutWarning
from ._results import (AttendResult, BackwardResult, Estimates, HeadEstimate, Probe, TargetAttempt, TargetReport,
                       Timings)
from ._rpc import PlshError
from ._shm import SharedMemoryRegion
from ._version import __version__
from ._wire import Options
from .sharding import ShardedClient

__all__ = ["AttendResult", "BackwardResult", "Client", "Estimates", "HeadEstimate", "LAYOUTS", "LayoutWarning",
           "Options", "PlshError", "Probe", "ShardedClient", "SharedMemoryRegion", "TargetAttempt", "TargetReport",
           "Timings", "__version__"]
