"""The implementation behind plsh_client.Client (see the package docstring)."""

import os
import sys

import grpc
import numpy as np

from ._rpc import PlshError, _rpc_errors, _Stream
from ._shm import SharedMemoryRegion

_stubs = os.environ.get("PLSH_PYTHON_STUBS")
if _stubs and _stubs not in sys.path:
    sys.path.insert(0, _stubs)
try:
    from plsh.v1 import plsh_pb2 as pb
    from plsh.v1 import plsh_pb2_grpc as pb_grpc
except ImportError as e:  # pragma: no cover - a setup problem, not a code path
    raise ImportError(
        "plsh_client needs the generated stubs: build the project (CMake target plsh_proto_python) "
        "and put <build>/python on PYTHONPATH or in PLSH_PYTHON_STUBS") from e

_DTYPES = {"f32": pb.DTYPE_F32, "f16": pb.DTYPE_F16, "bf16": pb.DTYPE_BF16}
# fixed_blocks: the paper's biased baseline (SPEC section 4), not an approximation.
_MODES = {"exact": pb.MODE_EXACT, "lsh": pb.MODE_LSH, "window": pb.MODE_WINDOW, "fixed_blocks": pb.MODE_FIXED_BLOCKS}
_ALGORITHMS = {"auto": pb.LSH_ALGORITHM_AUTO, "per_sample": pb.LSH_ALGORITHM_PER_SAMPLE,
               "banded": pb.LSH_ALGORITHM_BANDED}
_SAMPLINGS = {"iid": pb.SAMPLING_IID, "stratified": pb.SAMPLING_STRATIFIED, "ash": pb.SAMPLING_ASH}


def _wire_dtype_of(array, wire_dtype):
    if wire_dtype is not None:
        if wire_dtype not in _DTYPES:
            raise ValueError(f"wire_dtype = {wire_dtype!r}, expected one of {sorted(_DTYPES)}")
        return wire_dtype
    if array.dtype == np.float32:
        return "f32"
    if array.dtype == np.float16:
        return "f16"
    raise ValueError(f"dtype {array.dtype} is not sent as is; pass float32 or float16, or wire_dtype=")


def _to_bf16_bits(x):
    """float32 -> bfloat16 bit patterns (uint16), round to nearest even."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    nan = (bits & 0x7FFFFFFF) > 0x7F800000
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(nan, ((bits >> 16) | 0x40).astype(np.uint16), rounded)


def _from_bf16_bits(bits):
    return (bits.astype(np.uint32) << 16).view(np.float32)


def _encode(array, wire):
    """The array's bytes on the wire, little-endian, C order."""
    if wire == "f32":
        return np.ascontiguousarray(array, dtype="<f4")
    if wire == "f16":
        return np.ascontiguousarray(array, dtype="<f2")
    return _to_bf16_bits(array).astype("<u2")


def _decode(data, wire, shape):
    if wire == "f32":
        return np.frombuffer(data, dtype="<f4").reshape(shape).copy()
    if wire == "f16":
        return np.frombuffer(data, dtype="<f2").reshape(shape).copy()
    return _from_bf16_bits(np.frombuffer(data, dtype="<u2")).reshape(shape)


def _decode_into(raw, wire, shape):
    """The output from its wire bytes (a uint8 array filled in place): a view
    for float32 and float16, a conversion for bfloat16."""
    if wire == "f32":
        return raw.view("<f4").reshape(shape)
    if wire == "f16":
        return raw.view("<f2").reshape(shape)
    return _from_bf16_bits(raw.view("<u2")).reshape(shape)


def _read_varint(buf, at, end):
    """(value, next position) of a base-128 varint in buf[at:end]; None when malformed."""
    value, shift = 0, 0
    while at < end and shift < 70:
        b = buf[at]
        at += 1
        value |= (b & 0x7F) << shift
        if not b & 0x80:
            return value, at
        shift += 7
    return None


def _parse_chunk(buf):
    """An AttendResponse holding only an out_chunk, read without copying its
    data: (tensor, row_start, row_count, data offset, data length), or None
    for any other message (parse that with protobuf). Mirrors
    proto/chunk_codec.cpp: the last of a repeated field wins, unknown fields
    are skipped, anything unusual goes to protobuf."""
    end = len(buf)
    if end < 2 or buf[0] != 0x12:  # field 2 (out_chunk), length-delimited
        return None
    r = _read_varint(buf, 1, end)
    if r is None or r[0] != end - r[1]:
        return None
    at = r[1]
    fields = [0, 0, 0]
    data = (at, 0)
    while at < end:
        r = _read_varint(buf, at, end)
        if r is None:
            return None
        key, at = r
        field, wire_type = key >> 3, key & 7
        if 1 <= field <= 3:
            if wire_type != 0 or (r := _read_varint(buf, at, end)) is None:
                return None
            value, at = r
            fields[field - 1] = value - (1 << 64) if value >= 1 << 63 else value
        elif field == 4:
            if wire_type != 2 or (r := _read_varint(buf, at, end)) is None or r[0] > end - r[1]:
                return None
            data = (r[1], r[0])
            at = r[1] + r[0]
        elif field == 0:
            return None
        elif wire_type == 0:
            if (r := _read_varint(buf, at, end)) is None:
                return None
            at = r[1]
        elif wire_type in (1, 5):
            at += 8 if wire_type == 1 else 4
        elif wire_type == 2:
            if (r := _read_varint(buf, at, end)) is None:
                return None
            at = r[1] + r[0]
        else:
            return None
        if at > end:
            return None
    tensor = ((fields[0] + (1 << 31)) % (1 << 32)) - (1 << 31)  # an enum: int32, as protobuf truncates it
    return tensor, fields[1], fields[2], data[0], data[1]


def _input_chunks(ack, chunk_bytes, tensors):
    """(tensor, row_start, rows) of every chunk of the [rows, row bytes] slabs
    in tensors [(tensor, slab)], sized to the payload the server's ack allows
    (and to chunk_bytes when > 0)."""
    # Servers older than max_chunk_payload_bytes (0) said it only as
    # out_chunk_bytes: the payload cut from this call's chunk_bytes.
    cap = ack.max_chunk_payload_bytes or ack.out_chunk_bytes
    payload = min(chunk_bytes, cap) if chunk_bytes > 0 else cap
    for tensor, rows in tensors:
        per_chunk = max(1, payload // max(1, rows.strides[0]))
        for start in range(0, rows.shape[0], per_chunk):
            yield tensor, start, rows[start:start + per_chunk]


def _chunk_prefix(tensor, row_start, row_count, nbytes):
    """Everything of an AttendRequest{chunk} but its data's bytes."""
    fields = (b"\x08" + _varint(tensor) + b"\x10" + _varint(row_start) + b"\x18" + _varint(row_count) +
              b"\x22" + _varint(nbytes))
    return b"\x12" + _varint(len(fields) + nbytes) + fields


def _varint(n):
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _probe(p):
    return {"rows": p.rows, "rel_err": p.rel_err, "rel_err_stderr": p.rel_err_stderr,
            "max_abs_err": p.max_abs_err, "bound_max": p.bound_max, "rel_err_upper": p.rel_err_upper}


def _target(summary):
    """The attempts of an error-targeted request, or None for other requests."""
    if not summary.HasField("target") or summary.target.target_rel_err <= 0:
        return None
    names = {v: k for k, v in _MODES.items()}
    t = summary.target
    attempts = []
    for a in t.attempts:
        entry = {"mode": names.get(a.mode, "lsh")}
        if a.mode == pb.MODE_LSH:
            entry["samples"] = a.samples
        if a.mode == pb.MODE_WINDOW:
            entry.update(window_scale=a.window_scale, window_max=a.window_max)
        entry.update(flops=a.flops, rel_err=a.rel_err, rel_err_upper=a.rel_err_upper, met=a.met, seconds=a.seconds)
        attempts.append(entry)
    return {"target_rel_err": t.target_rel_err, "met": t.met, "chosen": t.chosen, "attempts": attempts}


def _meta(summary):
    names = {v: k for k, v in _MODES.items()}
    algorithms = {v: k for k, v in _ALGORITHMS.items()}
    samplings = {v: k for k, v in _SAMPLINGS.items()}
    t = summary.timings
    meta = {
        "request_id": summary.request_id,
        "backend": summary.backend,
        "device": summary.device,
        "mode": names.get(summary.mode, "lsh"),
        "lsh_algorithm": algorithms.get(summary.lsh_algorithm, "auto"),
        "sampling": samplings.get(summary.sampling, "iid"),
        "samples": summary.samples,
        "seed": summary.seed,
        # The defaults as the server resolved them (0 from servers before these fields).
        "scale": summary.scale,
        "q_pos0": summary.q_pos0,
        "k_pos0": summary.k_pos0,
        "flops": summary.flops,
        "dense_flops": summary.dense_flops,
        "summary": {"mask_max_err": summary.mask_max_err, "mask_spectral_err": summary.mask_spectral_err,
                    "probe": _probe(summary.probe)},
        "heads": [{
            "head": h.head, "slope": h.slope, "sigma": h.sigma, "window": h.window, "max_block": h.max_block,
            "mask_max_err": h.mask_max_err, "mask_rows_checked": h.mask_rows_checked,
            "mask_rows_sampled": h.mask_rows_sampled, "mask_spectral_err": h.mask_spectral_err,
            "spectral_iterations": h.spectral_iterations, "probe": _probe(h.probe),
            **({"draws": [[d.pitch, d.shift] for d in h.draws]} if len(h.draws) else {}),
        } for h in summary.heads],
        "timings": {"queued": t.queued_seconds, "receiving": t.receiving_seconds,
                    "computing": t.computing_seconds, "sending": t.sending_seconds,
                    "total": t.total_seconds, "backend": dict(t.backend)},
        "received_bytes": summary.received_bytes,
        "sent_bytes": summary.sent_bytes,
        # keep_context: the kept context (empty otherwise).
        "context_id": summary.context_id,
        "context_ttl_seconds": summary.context_ttl_seconds,
        "context_bytes": summary.context_bytes,
    }
    target = _target(summary)
    if target is not None:
        meta["target"] = target
    return meta


def _read_credential(name, value):
    """A PEM given as bytes, or read from a path; ValueError naming the
    argument (never the contents) otherwise."""
    if value is None:
        return None
    if isinstance(value, (bytes, bytearray)):
        return bytes(value)
    try:
        with open(value, "rb") as f:
            return f.read()
    except OSError as e:
        raise ValueError(f"{name} = {os.fspath(value)!r}: cannot read: {e.strerror}") from None


def _check_token(token, where):
    # gRPC refuses metadata values outside visible ASCII; say where, not what.
    for i, ch in enumerate(token):
        if not "!" <= ch <= "~":
            raise ValueError(f"{where}: character {i} of the token is not visible ASCII, expected one word")
    return token


class Client:
    """A channel to one plsh-server. Thread-safe; close() (or `with`) when done.

    Plaintext by default. tls=True, or any tls_* argument, connects with TLS:
    tls_ca is the CA (PEM path or bytes) the server's certificate must chain
    to (default: the system's roots), tls_cert and tls_key this client's
    certificate and key for servers that ask for one, tls_server_name the
    name the server's certificate must carry (default: the target's host).
    token (or token_file, a file holding it) is sent as `authorization:
    Bearer <token>` with every call but health(); it never appears in repr()
    or an error message."""

    def __init__(self, target, options=None, *, tls=False, tls_ca=None, tls_cert=None, tls_key=None,
                 tls_server_name=None, token=None, token_file=None):
        # No client-side message limits (the server enforces its own), and a
        # fixed 32 MiB stream window instead of BDP probing, as the C++ client
        # (client.cpp: output chunks wait less on this client's window updates).
        opts = [("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1),
                ("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 32 << 20)]
        if token is not None and token_file is not None:
            raise ValueError("token and token_file are both set, expected one")
        if token_file is not None:
            try:
                with open(token_file, encoding="ascii", errors="replace") as f:
                    token = f.read().strip()
            except OSError as e:
                raise ValueError(f"token_file = {os.fspath(token_file)!r}: cannot read: {e.strerror}") from None
            if not token:
                raise ValueError(f"token_file = {os.fspath(token_file)!r} is empty, expected a bearer token")
        self._metadata = (("authorization", "Bearer " + _check_token(token, "token_file" if token_file else "token")),) \
            if token else None
        self._target = target
        self._regions = []  # SharedMemoryRegions registered through this client
        if tls or tls_ca is not None or tls_cert is not None or tls_key is not None or tls_server_name:
            if (tls_cert is None) != (tls_key is None):
                raise ValueError("tls_cert and tls_key: give both or neither")
            credentials = grpc.ssl_channel_credentials(
                root_certificates=_read_credential("tls_ca", tls_ca),
                private_key=_read_credential("tls_key", tls_key),
                certificate_chain=_read_credential("tls_cert", tls_cert))
            if tls_server_name:
                opts.append(("grpc.ssl_target_name_override", tls_server_name))
            self._channel = grpc.secure_channel(target, credentials, options=opts + list(options or []))
        else:
            self._channel = grpc.insecure_channel(target, options=opts + list(options or []))
        self._stub = pb_grpc.AttentionStub(self._channel)

    def __repr__(self):
        return f"Client({self._target!r}{', token=<set>' if self._metadata else ''})"

    def close(self):
        self._channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def info(self, timeout=10):
        """GetInfo as a GetInfoResponse message."""
        return self._unary("GetInfo", pb.GetInfoRequest(), timeout)

    def health(self, service="", timeout=10):
        """grpc.health.v1 Check: "SERVING", "NOT_SERVING", ... (sends no token: health needs none)

        The two health messages are encoded by hand: stubs generated from
        grpc/health/v1/health.proto would be the module grpc.health.v1,
        which the grpcio package itself shadows (Debian has no
        grpcio-health-checking)."""
        encoded = service.encode()
        request = b"\x0a" + _varint(len(encoded)) + encoded if encoded else b""  # field 1: service
        check = self._channel.unary_unary("/grpc.health.v1.Health/Check")
        with _rpc_errors():
            response = check(request, timeout=timeout)
        status = response[1] if len(response) >= 2 and response[0] == 0x08 else 0  # field 1: status (enum < 128)
        return {0: "UNKNOWN", 1: "SERVING", 2: "NOT_SERVING", 3: "SERVICE_UNKNOWN"}.get(status, "UNKNOWN")

    def attend(self, q, k, v, *, mode=None, samples=None, seed=0, causal=False, scale=None, slopes=None,
               q_pos0=None, k_pos0=0, lsh_algorithm="auto", window_eps=None, window_width=0, estimates=None,
               probe_rows=None, mask_row_budget=None, return_draws=False, check_finite=None, return_lse=False,
               out_dtype=None, wire_dtype=None, backend=None, chunk_bytes=0, deadline=None, request_id="",
               out=None, lse=None, sampling=None, target_rel_err=None, keep_context=False):
        """Runs one attention request; returns (out, meta).

        Defaults and limits are the server's, not this client's: an argument
        left as None is not sent, and the server applies its own default
        (info().defaults says which: mode lsh, samples 16, window_eps 1e-4,
        probe_rows 64, mask_row_budget 65536, estimates and check_finite on,
        backend its --backend, in this version). scale None is 1/sqrt(D) and
        q_pos0 None is Nk - Nq (SPEC section 1). samples must be in
        [1, info().limits.max_samples] (the server's --max-samples, 4096
        unless configured; the library allows at most 2^24).

        out has q's shape ([B, Nq, H, D] or [Nq, H, D]); float32 or float16
        as sent (bfloat16 comes back as float32). meta is a dict with the
        backend, device, the samples, seed, scale, q_pos0 and k_pos0 the
        server used, the error estimates (SPEC section 6: "summary", "heads")
        and the server's "timings" in seconds; with return_lse, meta["lse"]
        is the float32 [B, Nq, H] log-sum-exp. chunk_bytes bounds each
        message's payload (0: the largest the server allows, which its ack
        states as max_chunk_payload_bytes); deadline is in seconds. Raises
        PlshError with the gRPC status code on failure.

        Same-host shared memory (a server with --shm-dir): q, k and v that are
        arrays of a SharedMemoryRegion of this client (region.array(...)),
        in the wire dtype, are named in the request instead of sent, and the
        server reads them in place; out= and lse= arrays of a region receive
        the output there (out is then the array returned, meta["lse"] the
        lse array). Other arrays travel in chunks as usual, so regions and
        streaming mix freely.

        sampling ("iid", "stratified" or "ash"; None: the server's default,
        iid) picks how lsh draws a head's hashes (README, "Which mode").
        target_rel_err (in (0, 1]) makes an error-targeted request: the
        library tries configurations of `mode` from the cheapest up (mode
        None: windows) and keeps the first whose probe upper bound
        meta["summary"]["probe"]["rel_err_upper"] is under the target, or
        computes exact; meta["target"] lists the attempts, each with its
        FLOPs, estimate, bound and seconds, and "chosen", the one kept.
        keep_context keeps the forward's context on the server for
        backward(): meta["context_id"].
        """
        originals = (q, k, v)
        q, k, v = (np.asarray(a) for a in (q, k, v))
        if q.ndim not in (3, 4) or k.ndim != q.ndim or v.ndim != q.ndim:
            raise ValueError(f"q, k, v ranks {q.ndim}, {k.ndim}, {v.ndim}: expected all 4 ([B, N, H, D]) or all 3")
        batched = q.ndim == 4
        if not batched:
            q, k, v = q[None], k[None], v[None]
        if k.shape != v.shape:
            raise ValueError(f"k shape {k.shape} != v shape {v.shape}")
        wire = _wire_dtype_of(q, wire_dtype)
        out_wire = out_dtype or wire
        if out_wire not in _DTYPES:
            raise ValueError(f"out_dtype = {out_dtype!r}, expected one of {sorted(_DTYPES)}")
        if mode is not None and mode not in _MODES:
            raise ValueError(f"mode = {mode!r}, expected one of {sorted(_MODES)}")
        if lsh_algorithm not in _ALGORITHMS:
            raise ValueError(f"lsh_algorithm = {lsh_algorithm!r}, expected one of {sorted(_ALGORITHMS)}")
        if sampling is not None and sampling not in _SAMPLINGS:
            raise ValueError(f"sampling = {sampling!r}, expected one of {sorted(_SAMPLINGS)}")
        B, Nq, H, D = q.shape
        Nk, Hkv = k.shape[1], k.shape[2]

        header = pb.AttendHeader(
            request_id=request_id, batch=B, q_len=Nq, kv_len=Nk, heads=H, kv_heads=Hkv, head_dim=D,
            dtype=_DTYPES[wire], out_dtype=_DTYPES[out_wire], causal=causal, slopes=list(slopes or []),
            k_pos0=k_pos0, seed=seed, lsh_algorithm=_ALGORITHMS[lsh_algorithm], window_width=window_width,
            return_draws=return_draws, return_lse=return_lse, out_chunk_bytes=max(0, chunk_bytes),
            backend=backend or "", keep_context=keep_context)
        if mode is not None:
            header.mode = _MODES[mode]
        if sampling is not None:
            header.sampling = _SAMPLINGS[sampling]
        # Optional on the wire: unset means the server's default.
        for field, value in (("scale", scale), ("q_pos0", q_pos0), ("samples", samples),
                             ("window_eps", window_eps), ("estimates", estimates), ("probe_rows", probe_rows),
                             ("mask_row_budget", mask_row_budget), ("check_finite", check_finite),
                             ("target_rel_err", target_rel_err)):
            if value is not None:
                setattr(header, field, value)

        # Tensors in one of this client's shared-memory regions are named, not sent.
        refs = {}
        for name, array in (("q", originals[0]), ("k", originals[1]), ("v", originals[2])):
            ref = self._shm_ref(array, wire)
            if ref is not None:
                refs[name] = ref
        out_bytes = B * Nq * H * D * (4 if out_wire == "f32" else 2)
        for name, array, nbytes in (("out", out, out_bytes), ("lse", lse, B * Nq * H * 4)):
            if array is None:
                continue
            ref = self._shm_ref(array, out_wire if name == "out" else "f32")
            if ref is None or ref.byte_size != nbytes:
                raise ValueError(f"{name}= must be a C-contiguous array of {nbytes} bytes in a SharedMemoryRegion of "
                                 f"this client, in the output dtype")
            refs[name] = ref
        if "lse" in refs:
            header.return_lse = return_lse = True
        for name, ref in refs.items():
            getattr(header, name + "_shm").CopyFrom(ref)

        # Rows are flat over batch and sequence: [B * N, heads * D] slabs.
        tensors = [(t, _encode(a, wire).reshape(rows, -1)) for t, name, a, rows in
                   ((pb.TENSOR_Q, "q", q, B * Nq), (pb.TENSOR_K, "k", k, B * Nk), (pb.TENSOR_V, "v", v, B * Nk))
                   if name not in refs]
        stream = _Stream()

        def requests():
            yield pb.AttendRequest(header=header).SerializeToString()
            # Chunk sizes follow the limit the server states in its ack.
            ack = stream.wait_ack()
            if ack is None:
                return
            for tensor, start, rows in _input_chunks(ack, chunk_bytes, tensors):
                part = memoryview(rows).cast("B")
                # One copy, straight from the array into the message (grpcio
                # takes bytes); the protobuf message would copy it twice more.
                yield b"".join((_chunk_prefix(tensor, start, len(part) // rows.strides[0], len(part)), part))
            yield pb.AttendRequest(end=pb.EndOfInput()).SerializeToString()

        # The output, filled in place from each response's bytes.
        out_row, lse_row = H * D * (4 if out_wire == "f32" else 2), H * 4
        out_raw = np.empty(B * Nq * out_row, np.uint8) if "out" not in refs else None
        lse_raw = np.empty(B * Nq * lse_row, np.uint8) if return_lse and "lse" not in refs else None
        filled = {pb.TENSOR_OUT: 0, pb.TENSOR_LSE: 0}
        attend = self._channel.stream_stream("/plsh.v1.Attention/Attend")  # bytes both ways
        call = attend(requests(), timeout=deadline, metadata=self._metadata)
        with stream.receiving():
            for response in call:
                chunk = _parse_chunk(response) if stream.ack is not None else None
                if chunk is None:
                    message = pb.AttendResponse.FromString(response)
                    if stream.take(message) == "out_chunk":  # an encoding _parse_chunk leaves to protobuf
                        c = message.out_chunk
                        self._take_chunk(c.tensor, c.row_start, c.row_count, memoryview(c.data), out_raw, lse_raw,
                                         out_row, lse_row, filled)
                    continue
                tensor, row_start, row_count, at, n = chunk
                self._take_chunk(tensor, row_start, row_count, memoryview(response)[at:at + n], out_raw, lse_raw,
                                 out_row, lse_row, filled)
        if (out_raw is not None and filled[pb.TENSOR_OUT] != B * Nq) or \
                (lse_raw is not None and filled[pb.TENSOR_LSE] != B * Nq):
            raise PlshError(grpc.StatusCode.INTERNAL, "the server's output misses rows")

        result = out if out_raw is None else _decode_into(out_raw, out_wire, (B, Nq, H, D))
        meta = _meta(stream.summary)
        if return_lse:
            lse_out = lse if lse_raw is None else lse_raw.view("<f4").reshape(B, Nq, H)
            meta["lse"] = lse_out if batched or lse_raw is None else lse_out[0]
        return (result if batched or out_raw is None else result[0]), meta

    def backward(self, dout, **kwargs):
        """AttendBackward: (dq, dk, dv, meta) of a kept context (context_id=)
        or statelessly (q=, k=, v= and out=, lse= or recompute_forward=True).
        See plsh_client._backward.backward."""
        from ._backward import backward
        return backward(self, dout, **kwargs)

    def release_context(self, context_id, timeout=10):
        """ReleaseContext: drops a kept context now; returns the bytes the server gave back."""
        return self._unary("ReleaseContext", pb.ReleaseContextRequest(context_id=context_id), timeout).released_bytes

    @staticmethod
    def _take_chunk(tensor, row_start, row_count, data, out_raw, lse_raw, out_row, lse_row, filled):
        """An output chunk into its rows (one copy), in order and whole, as the server promises."""
        raw, row = (out_raw, out_row) if tensor == pb.TENSOR_OUT else (lse_raw, lse_row) \
            if tensor == pb.TENSOR_LSE else (None, 0)
        if raw is None or row_start != filled[tensor] or row_count < 1 or len(data) != row_count * row or \
                (row_start + row_count) * row > len(raw):
            raise PlshError(grpc.StatusCode.INTERNAL,
                            f"the server broke the plsh.v1 protocol: output chunk of tensor {tensor}, rows "
                            f"[{row_start}, +{row_count}) with {len(data)} bytes")
        raw[row_start * row:(row_start + row_count) * row] = np.frombuffer(data, np.uint8)
        filled[tensor] += row_count

    # ------------------------------------------------------ shared memory

    def register_shm(self, name, key, offset, byte_size, timeout=10):
        """RegisterSharedMemory: bytes [offset, offset + byte_size) of the file
        `key` in the server's --shm-dir, as region `name`."""
        self._unary("RegisterSharedMemory", pb.RegisterSharedMemoryRequest(
            name=name, key=key, offset=offset, byte_size=byte_size), timeout)

    def unregister_shm(self, name, timeout=10):
        """UnregisterSharedMemory (FAILED_PRECONDITION while a request uses it)."""
        self._unary("UnregisterSharedMemory", pb.UnregisterSharedMemoryRequest(name=name), timeout)
        self._regions = [r for r in self._regions if r.name != name]

    def list_shm(self, timeout=10):
        """ListSharedMemory: [{"name", "key", "offset", "byte_size", "requests"}]."""
        response = self._unary("ListSharedMemory", pb.ListSharedMemoryRequest(), timeout)
        return [{"name": r.name, "key": r.key, "offset": r.offset, "byte_size": r.byte_size,
                 "requests": r.requests} for r in response.regions]

    def shm_region(self, size, name=None, dir="/dev/shm"):
        """A new SharedMemoryRegion of `size` bytes in `dir` (the server's
        --shm-dir as this process sees it), registered with the server."""
        return SharedMemoryRegion(self, size, name=name, dir=dir)

    def _unary(self, method, request, timeout):
        with _rpc_errors():
            return getattr(self._stub, method)(request, timeout=timeout, metadata=self._metadata)

    def _shm_ref(self, array, wire):
        """The SharedMemoryRef of an array that lies in one of this client's
        regions, in the wire dtype and C-contiguous; None otherwise."""
        if not isinstance(array, np.ndarray) or not self._regions or not array.flags.c_contiguous:
            return None
        expected = {"f32": np.dtype("<f4"), "f16": np.dtype("<f2"), "bf16": np.dtype("<u2")}[wire]
        if array.dtype != expected:
            return None
        address = array.__array_interface__["data"][0]
        for region in self._regions:
            offset = address - region.address
            if 0 <= offset and offset + array.nbytes <= region.size:
                return pb.SharedMemoryRef(region=region.name, offset=offset, byte_size=array.nbytes)
        return None

