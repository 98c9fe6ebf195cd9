"""The Python client against a scripted plsh.v1 server (grpcio, in this
process): what it puts on the wire, not what a real server computes. It
leaves unset the optional header fields the caller did not give (the server
applies its defaults), and cuts input chunks by the ack's
max_chunk_payload_bytes, not by max_message_bytes."""

from concurrent import futures

import grpc
import numpy as np
import pytest

from plsh.v1 import plsh_pb2 as pb
from plsh.v1 import plsh_pb2_grpc as pb_grpc
from plsh_client import Client

# Far below max_message_bytes, so that a client using the message size (less
# any headroom of its own) instead would send larger chunks.
PAYLOAD = 1000
MAX_MESSAGE = 1 << 22


class Scripted(pb_grpc.AttentionServicer):
    """Acks, records the header and every chunk, answers zeros and a summary."""

    def __init__(self):
        self.header = None
        self.chunks = []  # (tensor, row_start, row_count, len(data))

    def Attend(self, requests, context):
        first = next(requests)
        self.header = h = first.header
        yield pb.AttendResponse(ack=pb.Ack(request_id="scripted", backend="cpu", out_chunk_bytes=PAYLOAD,
                                           max_message_bytes=MAX_MESSAGE, max_chunk_payload_bytes=PAYLOAD))
        for r in requests:
            if r.WhichOneof("kind") == "chunk":
                c = r.chunk
                self.chunks.append((c.tensor, c.row_start, c.row_count, len(c.data)))
            elif r.WhichOneof("kind") == "end":
                break
        rows, row_bytes = h.batch * h.q_len, h.heads * h.head_dim * 4
        yield pb.AttendResponse(out_chunk=pb.OutputChunk(tensor=pb.TENSOR_OUT, row_start=0, row_count=rows,
                                                         data=bytes(rows * row_bytes)))
        yield pb.AttendResponse(summary=pb.Summary(request_id="scripted", backend="cpu", mode=pb.MODE_LSH,
                                                   samples=16, out_dtype=pb.DTYPE_F32, scale=0.25, q_pos0=7,
                                                   k_pos0=3))


@pytest.fixture
def scripted():
    servicer = Scripted()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    pb_grpc.add_AttentionServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield servicer, f"127.0.0.1:{port}"
    server.stop(None)


def inputs():
    r = np.random.default_rng(0)
    q = r.standard_normal((1, 40, 2, 16)).astype(np.float32)  # 128-byte rows
    kv = r.standard_normal((1, 50, 2, 16)).astype(np.float32)
    return q, kv, kv.copy()


def test_unset_options_stay_unset_and_chunks_follow_the_ack(scripted):
    servicer, address = scripted
    q, k, v = inputs()
    with Client(address) as c:
        out, meta = c.attend(q, k, v)
    h = servicer.header
    for field in ("samples", "window_eps", "probe_rows", "mask_row_budget", "estimates", "check_finite",
                  "scale", "q_pos0"):
        assert not h.HasField(field), field
    assert h.mode == pb.MODE_UNSPECIFIED and h.backend == ""
    # Every chunk within the stated payload, and as full as whole rows allow.
    per_chunk = PAYLOAD // 128
    assert servicer.chunks and all(n <= PAYLOAD for *_, n in servicer.chunks)
    assert max(count for _, _, count, _ in servicer.chunks) == per_chunk
    for tensor, rows in ((pb.TENSOR_Q, 40), (pb.TENSOR_K, 50), (pb.TENSOR_V, 50)):
        got = sorted((start, count) for t, start, count, _ in servicer.chunks if t == tensor)
        assert got == [(s, min(per_chunk, rows - s)) for s in range(0, rows, per_chunk)]
    assert out.shape == q.shape
    # What the server resolved, read from its summary.
    assert (meta["samples"], meta["scale"], meta["q_pos0"], meta["k_pos0"]) == (16, 0.25, 7, 3)


def test_given_options_are_sent(scripted):
    servicer, address = scripted
    q, k, v = inputs()
    with Client(address) as c:
        c.attend(q, k, v, mode="window", samples=3, window_eps=0.5, probe_rows=0, mask_row_budget=9,
                 estimates=False, check_finite=False, scale=1.5, q_pos0=60, backend="cpu", chunk_bytes=300)
    h = servicer.header
    assert (h.mode, h.samples, h.window_eps, h.probe_rows, h.mask_row_budget) == (pb.MODE_WINDOW, 3, 0.5, 0, 9)
    assert h.HasField("estimates") and not h.estimates and h.HasField("check_finite") and not h.check_finite
    assert (h.scale, h.q_pos0, h.backend) == (1.5, 60, "cpu")
    # chunk_bytes below the server's payload: two 128-byte rows per chunk.
    assert max(n for *_, n in servicer.chunks) == 256
