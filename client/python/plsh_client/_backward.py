"""Client.backward: AttendBackward (SPEC section 8) from Python.

Two forms, as in the proto:

    # by context: the forward kept it (keep_context=True); only dout goes up
    out, meta = c.attend(q, k, v, mode="lsh", keep_context=True)
    dq, dk, dv, bmeta = c.backward(dout, context_id=meta["context_id"])

    # stateless: everything goes up (or q, k, v and dout with recompute_forward)
    dq, dk, dv, bmeta = c.backward(dout, q=q, k=k, v=v, out=out, lse=meta["lse"], mode="lsh")

dout has out's shape and dtype ([B, Nq, H, D] or [Nq, H, D]). dq has q's
shape, dk and dv k's ([B, Nk, Hkv, D]): by context the client learns Nk and
Hkv from the stream unless kv_shape says them. Gradients come back in the
forward's dtype (grad_dtype="f32" asks for float32; bfloat16 comes back as
float32 arrays, as in attend)."""

import grpc
import numpy as np

from ._client import (_ALGORITHMS, _DTYPES, _MODES, _SAMPLINGS, PlshError, _decode, _encode, _input_chunks,
                      _wire_dtype_of, pb)
from ._rpc import _Stream


def _forward_header(q, k, v, wire, out_wire, *, mode=None, samples=None, seed=0, causal=False, scale=None,
                    slopes=None, q_pos0=None, k_pos0=0, lsh_algorithm="auto", window_eps=None, window_width=0,
                    check_finite=None, backend=None, sampling=None):
    """The forward's AttendHeader, as Client.attend builds it."""
    if mode is not None and mode not in _MODES:
        raise ValueError(f"mode = {mode!r}, expected one of {sorted(_MODES)}")
    if lsh_algorithm not in _ALGORITHMS:
        raise ValueError(f"lsh_algorithm = {lsh_algorithm!r}, expected one of {sorted(_ALGORITHMS)}")
    B, Nq, H, D = q.shape
    Nk, Hkv = k.shape[1], k.shape[2]
    header = pb.AttendHeader(
        batch=B, q_len=Nq, kv_len=Nk, heads=H, kv_heads=Hkv, head_dim=D, dtype=_DTYPES[wire],
        out_dtype=_DTYPES[out_wire], causal=causal, slopes=list(slopes or []), k_pos0=k_pos0, seed=seed,
        lsh_algorithm=_ALGORITHMS[lsh_algorithm], window_width=window_width, backend=backend or "")
    if mode is not None:
        header.mode = _MODES[mode]
    if sampling is not None:  # the forward's sampler: a recomputed forward must draw what it drew
        if sampling not in _SAMPLINGS:
            raise ValueError(f"sampling = {sampling!r}, expected one of {sorted(_SAMPLINGS)}")
        header.sampling = _SAMPLINGS[sampling]
    for field, value in (("scale", scale), ("q_pos0", q_pos0), ("samples", samples), ("window_eps", window_eps),
                         ("check_finite", check_finite)):
        if value is not None:
            setattr(header, field, value)
    return header


def _batched(a, name):
    a = np.asarray(a)
    if a.ndim == 3:
        return a[None], False
    if a.ndim != 4:
        raise ValueError(f"{name} has rank {a.ndim}, expected 4 ([B, N, H, D]) or 3")
    return a, True


def backward(client, dout, *, context_id=None, keep_context=False, kv_shape=None, q=None, k=None, v=None, out=None,
             lse=None, recompute_forward=False, grad_dtype=None, wire_dtype=None, out_dtype=None, chunk_bytes=0,
             deadline=None, request_id="", **forward_options):
    """Returns (dq, dk, dv, meta); meta has the server's "timings",
    "flops", "dense_flops", "forward_flops", "context_id", "context_kept",
    "sent_bytes" and "received_bytes". forward_options (stateless only) are
    Client.attend's: mode, samples, seed, causal, scale, slopes, q_pos0,
    k_pos0, lsh_algorithm, window_eps, window_width, check_finite, backend.
    Raises PlshError (FAILED_PRECONDITION for a context that is gone)."""
    dout, batched = _batched(dout, "dout")
    B, Nq, H, D = dout.shape
    stateless = context_id is None
    out_wire = _wire_dtype_of(dout, out_dtype)
    header = pb.BackwardHeader(request_id=request_id, keep_context=keep_context,
                               out_chunk_bytes=max(0, chunk_bytes))
    inputs = []
    if stateless:
        if q is None or k is None or v is None:
            raise ValueError("a stateless backward (no context_id) needs q, k and v")
        q, _ = _batched(q, "q")
        k, _ = _batched(k, "k")
        v, _ = _batched(v, "v")
        wire = _wire_dtype_of(q, wire_dtype)
        header.forward.CopyFrom(_forward_header(q, k, v, wire, out_wire, **forward_options))
        header.recompute_forward = recompute_forward
        inputs += [(pb.TENSOR_Q, _encode(q, wire).reshape(B * Nq, -1)),
                   (pb.TENSOR_K, _encode(k, wire).reshape(k.shape[0] * k.shape[1], -1)),
                   (pb.TENSOR_V, _encode(v, wire).reshape(v.shape[0] * v.shape[1], -1))]
        if not recompute_forward:
            if out is None or lse is None:
                raise ValueError("a stateless backward needs out and lse, or recompute_forward=True")
            out, _ = _batched(out, "out")
            lse = np.asarray(lse, dtype="<f4").reshape(B * Nq, H)
            inputs += [(pb.TENSOR_OUT, _encode(out, out_wire).reshape(B * Nq, -1)), (pb.TENSOR_LSE, lse)]
        kv_shape = k.shape
    else:
        if forward_options or any(a is not None for a in (q, k, v, out, lse)) or recompute_forward:
            raise ValueError("by context_id the server holds the forward: give only dout (and kv_shape)")
        header.context_id = context_id
    if grad_dtype is not None:
        if grad_dtype not in _DTYPES:
            raise ValueError(f"grad_dtype = {grad_dtype!r}, expected one of {sorted(_DTYPES)}")
        header.grad_dtype = _DTYPES[grad_dtype]
    inputs.append((pb.TENSOR_DOUT, _encode(dout, out_wire).reshape(B * Nq, -1)))

    stream = _Stream()

    def requests():
        yield pb.BackwardRequest(header=header)
        ack = stream.wait_ack()
        if ack is None:
            return
        for tensor, start, part in _input_chunks(ack, chunk_bytes, inputs):
            yield pb.BackwardRequest(chunk=pb.TensorChunk(
                tensor=tensor, row_start=start, row_count=part.shape[0], data=part.tobytes()))
        yield pb.BackwardRequest(end=pb.EndOfInput())

    parts = {pb.TENSOR_DQ: [], pb.TENSOR_DK: [], pb.TENSOR_DV: []}
    rows = {pb.TENSOR_DQ: 0, pb.TENSOR_DK: 0, pb.TENSOR_DV: 0}
    call = client._stub.AttendBackward(requests(), timeout=deadline, metadata=client._metadata)
    with stream.receiving():
        for response in call:
            if stream.take(response) == "grad_chunk":
                c = response.grad_chunk
                if c.tensor not in parts:
                    raise PlshError(grpc.StatusCode.INTERNAL, f"gradient chunk of tensor {c.tensor}")
                parts[c.tensor].append((c.row_start, c.data))
                rows[c.tensor] += c.row_count
    summary = stream.summary

    def joined(tensor):
        return b"".join(d for _, d in sorted(parts[tensor], key=lambda p: p[0]))

    # The summary says the dtype (by context: the context's, unless asked).
    grad_wire = {v: name for name, v in _DTYPES.items()}.get(summary.grad_dtype)
    if grad_wire is None:
        raise PlshError(grpc.StatusCode.INTERNAL, f"summary: grad_dtype {summary.grad_dtype}")
    elem = 4 if grad_wire == "f32" else 2
    dq = _decode(joined(pb.TENSOR_DQ), grad_wire, (B, Nq, H, D))
    dk_bytes, dv_bytes = joined(pb.TENSOR_DK), joined(pb.TENSOR_DV)
    if kv_shape is None:
        # By context: [B * Nk rows] of Hkv * D elements, from the stream.
        kv_rows = rows[pb.TENSOR_DK]
        kv_shape = (B, kv_rows // B, len(dk_bytes) // (kv_rows * D * elem), D)
    kv_shape = tuple(kv_shape)
    dk = _decode(dk_bytes, grad_wire, kv_shape)
    dv = _decode(dv_bytes, grad_wire, kv_shape)
    t = summary.timings
    meta = {
        "request_id": summary.request_id, "context_id": summary.context_id, "context_kept": summary.context_kept,
        "backend": summary.backend, "device": summary.device, "flops": summary.flops,
        "dense_flops": summary.dense_flops, "forward_flops": summary.forward_flops,
        "timings": {"queued": t.queued_seconds, "receiving": t.receiving_seconds, "computing": t.computing_seconds,
                    "sending": t.sending_seconds, "total": t.total_seconds, "backend": dict(t.backend)},
        "received_bytes": summary.received_bytes, "sent_bytes": summary.sent_bytes,
    }
    if not batched:
        dq, dk, dv = dq[0], dk[0], dv[0]
    return dq, dk, dv, meta
