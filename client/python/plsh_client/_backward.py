"""Client.backward: AttendBackward (SPEC section 8) from Python.

Two forms, as in the proto:

    # by context: the forward kept it (keep_context=True); only dout goes up
    r = c.attend(q, k, v, mode="lsh", keep_context=True)
    g = c.backward(dout, context_id=r.context_id)          # g.dq, g.dk, g.dv

    # stateless: everything goes up (or q, k, v and dout with recompute_forward)
    g = c.backward(dout, q=q, k=k, v=v, out=r.out, lse=r.lse, mode="lsh", seed=r.seed)

dout has out's shape and dtype, in the layout the forward used (layout=,
as attend's). dq has q's shape, dk and dv k's: by context the client learns
Nk and Hkv from the stream unless kv_shape says them. Gradients come back in
the forward's dtype (grad_dtype="f32" asks for float32; bfloat16 comes back
as float32 arrays, as in attend)."""

from typing import Any, Dict, List, Optional, Sequence, Tuple

import grpc
import numpy as np

from . import _layout
from ._proto import pb
from ._results import BackwardResult, backward_result
from ._rpc import PlshError, Stream, ack_payload, payload_cap
from ._wire import DTYPE_NAMES, DTYPES, ELEMENT_BYTES, Options, attend_header, choice, decode, encode, \
    input_chunks, wire_dtype_of


def _bnhd(a: Any, name: str, layout: str, rank: int) -> np.ndarray:
    """An array in `layout` as 4-D bnhd (lse: [B, N, H] from bnhd's or bhnd's [B, H, N])."""
    a = np.asarray(a)
    if a.ndim != rank and a.ndim != rank - 1:
        raise ValueError(f"{name} has rank {a.ndim}, expected {rank} (or {rank - 1} without the batch axis)")
    if a.ndim == rank - 1:
        a = a[None]
    if layout == "bhnd":
        a = np.swapaxes(a, 1, 2)
    return a


def backward(client: Any, dout: Any, *, context_id: Optional[str], keep_context: bool,
             kv_shape: Optional[Sequence[int]], q: Any, k: Any, v: Any, out: Any, lse: Any, recompute_forward: bool,
             layout: str, options: Optional[Options], grad_dtype: Optional[str], wire_dtype: Optional[str],
             out_dtype: Optional[str], chunk_bytes: int, deadline: Optional[float], request_id: str,
             bf16_bits: bool) -> BackwardResult:
    """Client.backward's work: a BackwardResult (dq, dk, dv and the
    server's summary); options are the forward's (stateless only)."""
    _layout.check_layout(layout)
    batched = np.ndim(dout) == 4
    dout4 = _bnhd(dout, "dout", layout, 4)
    B, Nq, H, D = dout4.shape
    stateless = context_id is None
    out_wire = wire_dtype_of("dout", dout4, out_dtype)
    header = pb.BackwardHeader(request_id=request_id, keep_context=keep_context, out_chunk_bytes=max(0, chunk_bytes))
    inputs: List[Tuple[int, np.ndarray]] = []
    if stateless:
        if q is None or k is None or v is None:
            raise ValueError("a stateless backward (no context_id) needs q, k and v")
        o = options if options is not None else Options()
        shape, _ = _layout.resolve_shapes(np.shape(q), np.shape(k), np.shape(v), layout, slopes=o.slopes)
        q4, k4, v4 = (_bnhd(a, name, layout, 4) for a, name in ((q, "q"), (k, "k"), (v, "v")))
        if dout4.shape != q4.shape:
            raise ValueError(f"dout: shape {np.shape(dout)}, expected out's shape {np.shape(q)[:-1]} + (D,) like q")
        wire = wire_dtype_of("q", q4, wire_dtype)
        header.forward.CopyFrom(attend_header(shape, wire, out_wire, o))
        header.recompute_forward = recompute_forward
        inputs += [(pb.TENSOR_Q, encode(q4, wire).reshape(B * Nq, -1)),
                   (pb.TENSOR_K, encode(k4, wire).reshape(shape.batch * shape.kv_len, -1)),
                   (pb.TENSOR_V, encode(v4, wire).reshape(shape.batch * shape.kv_len, -1))]
        if not recompute_forward:
            if out is None or lse is None:
                raise ValueError("a stateless backward needs out and lse, or recompute_forward=True")
            out4 = _bnhd(out, "out", layout, 4)
            lse3 = np.ascontiguousarray(_bnhd(lse, "lse", layout, 3), dtype="<f4").reshape(B * Nq, H)
            inputs += [(pb.TENSOR_OUT, encode(out4, out_wire).reshape(B * Nq, -1)), (pb.TENSOR_LSE, lse3)]
        kv4: Optional[Tuple[int, ...]] = tuple(k4.shape)
    else:
        if options is not None or any(a is not None for a in (q, k, v, out, lse)) or recompute_forward:
            raise ValueError("by context_id the server holds the forward: give only dout (and kv_shape)")
        header.context_id = context_id
        kv4 = None
        if kv_shape is not None:
            given = tuple(int(n) for n in kv_shape)
            kv4 = tuple(given[a] for a in _layout.to_bnhd_axes(layout, len(given)))
            kv4 = kv4 if len(kv4) == 4 else (1,) + kv4
    if grad_dtype is not None:
        choice("grad_dtype", grad_dtype, DTYPES)
        header.grad_dtype = DTYPES[grad_dtype]
    inputs.append((pb.TENSOR_DOUT, encode(dout4, out_wire).reshape(B * Nq, -1)))

    stream = Stream()

    def requests() -> Any:
        yield pb.BackwardRequest(header=header)
        ack = stream.wait_ack()
        if ack is None:
            return
        for tensor, start, part in input_chunks(payload_cap(ack_payload(ack), chunk_bytes), inputs):
            yield pb.BackwardRequest(chunk=pb.TensorChunk(
                tensor=tensor, row_start=start, row_count=part.shape[0], data=part.tobytes()))
        yield pb.BackwardRequest(end=pb.EndOfInput())

    parts: Dict[int, List[Tuple[int, bytes]]] = {pb.TENSOR_DQ: [], pb.TENSOR_DK: [], pb.TENSOR_DV: []}
    rows = {pb.TENSOR_DQ: 0, pb.TENSOR_DK: 0, pb.TENSOR_DV: 0}
    call = client._backward_stream(requests(), timeout=deadline, metadata=client._metadata)
    with stream.receiving():
        for response in call:
            if stream.take(response) == "grad_chunk":
                c = response.grad_chunk
                if c.tensor not in parts:
                    raise PlshError(grpc.StatusCode.INTERNAL, f"gradient chunk of tensor {c.tensor}")
                parts[c.tensor].append((c.row_start, c.data))
                rows[c.tensor] += c.row_count
    summary = stream.summary

    def joined(tensor: int) -> np.ndarray:
        return np.frombuffer(bytearray(b"".join(d for _, d in sorted(parts[tensor], key=lambda p: p[0]))), np.uint8)

    # The summary says the dtype (by context: the context's, unless asked).
    grad_wire = DTYPE_NAMES.get(summary.grad_dtype)
    if grad_wire is None:
        raise PlshError(grpc.StatusCode.INTERNAL, f"summary: grad_dtype {summary.grad_dtype}")
    dq_raw, dk_raw, dv_raw = joined(pb.TENSOR_DQ), joined(pb.TENSOR_DK), joined(pb.TENSOR_DV)
    if kv4 is None:
        # By context: [B * Nk rows] of Hkv * D elements, from the stream.
        kv_rows = max(1, rows[pb.TENSOR_DK])
        kv4 = (B, kv_rows // B, len(dk_raw) // (kv_rows * D * ELEMENT_BYTES[grad_wire]), D)
    expected = {"dq": B * Nq * H * D, "dk": int(np.prod(kv4)), "dv": int(np.prod(kv4))}
    for name, raw in (("dq", dq_raw), ("dk", dk_raw), ("dv", dv_raw)):
        if len(raw) != expected[name] * ELEMENT_BYTES[grad_wire]:
            raise PlshError(grpc.StatusCode.INTERNAL, f"the server sent {len(raw)} bytes of {name}, expected "
                            f"{expected[name] * ELEMENT_BYTES[grad_wire]}")
    grads = [decode(dq_raw, grad_wire, (B, Nq, H, D), bf16_bits), decode(dk_raw, grad_wire, kv4, bf16_bits),
             decode(dv_raw, grad_wire, kv4, bf16_bits)]
    for i, g in enumerate(grads):
        g = np.swapaxes(g, 1, 2) if layout == "bhnd" else g
        grads[i] = g if batched else g[0]
    return backward_result(summary, grads[0], grads[1], grads[2])
