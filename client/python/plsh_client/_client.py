"""The implementation behind plsh_client.Client (see the package docstring)."""

import os
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import grpc
import numpy as np

from . import _layout
from ._proto import pb
from ._results import AttendResult, BackwardResult, attend_result
from ._rpc import PlshError, Stream, ack_payload, payload_cap, rpc_errors
from ._shm import SharedMemoryRegion
from ._wire import (DTYPE_NAMES, DTYPES, ELEMENT_BYTES, Options, attend_header, chunk_prefix, choice, decode, encode,
                    input_chunks, varint, wire_dtype_of)

DEFAULT_TARGET = "127.0.0.1:50051"
# Requests whose tensors (in and out) are at most this many bytes go in one
# message each way (AttendUnary) unless rpc= says otherwise: on loopback a
# Python Attend stream costs several milliseconds more than a unary call
# (grpcio's stream machinery: a thread per call, a message per chunk), and
# a unary call of this size costs no more than the C++ client's stream.
# bench/RESULTS.md, "Python client latency".
UNARY_MAX_BYTES = 1 << 20

PathOrBytes = Union[str, bytes, bytearray, "os.PathLike[str]"]


def _read_credential(name: str, value: Optional[PathOrBytes]) -> Optional[bytes]:
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


def _check_token(token: str, where: str) -> str:
    # gRPC refuses metadata values outside visible ASCII; say where, not what.
    for i, ch in enumerate(token):
        if not "!" <= ch <= "~":
            raise ValueError(f"{where}: character {i} of the token is not visible ASCII, expected one word")
    return token


def _token(token: Optional[str], token_file: Optional[PathOrBytes]) -> Tuple[Optional[str], str]:
    """The bearer token and where it came from: token=, token_file=, or
    $PLSH_TOKEN (as the CLI reads it) when neither is given."""
    if token is not None and token_file is not None:
        raise ValueError("token and token_file are both set, expected one")
    if token_file is not None:
        path = os.fsdecode(token_file) if isinstance(token_file, (bytes, bytearray)) else os.fspath(token_file)
        try:
            with open(path, encoding="ascii", errors="replace") as f:
                token = f.read().strip()
        except OSError as e:
            raise ValueError(f"token_file = {path!r}: cannot read: {e.strerror}") from None
        if not token:
            raise ValueError(f"token_file = {path!r} is empty, expected a bearer token")
        return token, "token_file"
    if token is not None:
        return token, "token"
    return os.environ.get("PLSH_TOKEN") or None, "PLSH_TOKEN"


class Client:
    """A channel to one plsh-server, kept open for every call (close() or
    `with` when done). Thread-safe.

    target: "host:port"; None: $PLSH_TARGET, else 127.0.0.1:50051. Plaintext
    by default. tls=True, or any tls_* argument, connects with TLS: tls_ca is
    the CA (PEM path or bytes) the server's certificate must chain to
    (default: the system's roots), tls_cert and tls_key this client's
    certificate and key for servers that ask for one, tls_server_name the
    name the server's certificate must carry (default: the target's host).
    token (or token_file, a file holding it; neither: $PLSH_TOKEN, as the
    CLI) is sent as `authorization: Bearer <token>` with every call but
    health(); it never appears in repr() or an error message."""

    def __init__(self, target: Optional[str] = None, options: Optional[Sequence[Tuple[str, Any]]] = None, *,
                 tls: bool = False, tls_ca: Optional[PathOrBytes] = None, tls_cert: Optional[PathOrBytes] = None,
                 tls_key: Optional[PathOrBytes] = None, tls_server_name: Optional[str] = None,
                 token: Optional[str] = None, token_file: Optional[PathOrBytes] = None) -> None:
        target = target or os.environ.get("PLSH_TARGET") or DEFAULT_TARGET
        # No client-side message limits (the server enforces its own), and a
        # fixed 32 MiB stream window instead of BDP probing, as the C++ client
        # (client.cpp: output chunks wait less on this client's window updates).
        opts: List[Tuple[str, Any]] = [("grpc.max_receive_message_length", -1),
                                       ("grpc.max_send_message_length", -1),
                                       ("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 32 << 20)]
        found, where = _token(token, token_file)
        self._metadata = (("authorization", "Bearer " + _check_token(found, where)),) if found else None
        self._target = target
        self._regions: List[SharedMemoryRegion] = []  # registered through this client
        self._info: Any = None            # GetInfo, once: the chunk payload cap without waiting for an ack
        self._info_refused = False        # GetInfo not allowed (a token without it): stream and wait for acks
        self._unary_refused = False       # AttendUnary not allowed: stream
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
        # Every method once, bytes both ways: messages are (de)serialized here.
        method = "/plsh.v1.Attention/"
        self._attend_stream = self._channel.stream_stream(method + "Attend")
        self._attend_unary = self._channel.unary_unary(method + "AttendUnary")
        self._backward_stream = self._channel.stream_stream(
            method + "AttendBackward", request_serializer=lambda m: m.SerializeToString(),
            response_deserializer=pb.BackwardResponse.FromString)
        self._health_check = self._channel.unary_unary("/grpc.health.v1.Health/Check")
        self._unaries = {name: self._channel.unary_unary(
            method + name, request_serializer=lambda m: m.SerializeToString(),
            response_deserializer=getattr(pb, name + "Response").FromString)
            for name in ("GetInfo", "ReleaseContext", "RegisterSharedMemory", "UnregisterSharedMemory",
                         "ListSharedMemory")}

    def __repr__(self) -> str:
        return f"Client({self._target!r}{', token=<set>' if self._metadata else ''})"

    @property
    def target(self) -> str:
        return self._target

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def info(self, timeout: float = 10) -> Any:
        """GetInfo as a plsh.v1 GetInfoResponse message (version, backends,
        limits, defaults, and the backend-dependent constants: row_align, ...)."""
        info = self._unary("GetInfo", pb.GetInfoRequest(), timeout)
        self._info = info
        return info

    def cached_info(self) -> Any:
        """GetInfo of this channel's first call that asked (None where the
        server does not allow it: a token without GetInfo)."""
        if self._info is None and not self._info_refused:
            try:
                self.info()
            except PlshError as e:
                if e.code not in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNIMPLEMENTED):
                    raise
                self._info_refused = True
        return self._info

    def health(self, service: str = "", timeout: float = 10) -> str:
        """grpc.health.v1 Check: "SERVING", "NOT_SERVING", ... (sends no token: health needs none)

        The two health messages are encoded by hand: stubs generated from
        grpc/health/v1/health.proto would be the module grpc.health.v1,
        which the grpcio package itself shadows (Debian has no
        grpcio-health-checking)."""
        encoded = service.encode()
        request = b"\x0a" + varint(len(encoded)) + encoded if encoded else b""  # field 1: service
        with rpc_errors():
            response = self._health_check(request, timeout=timeout)
        status = response[1] if len(response) >= 2 and response[0] == 0x08 else 0  # field 1: status (enum < 128)
        return {0: "UNKNOWN", 1: "SERVING", 2: "NOT_SERVING", 3: "SERVICE_UNKNOWN"}.get(status, "UNKNOWN")

    def attend(self, q: Any, k: Any, v: Any, *, layout: str = "bnhd", check_layout: bool = True,
               mode: Optional[str] = None, samples: Optional[int] = None, seed: Optional[int] = None,
               sampling: Optional[str] = None, causal: bool = False, scale: Optional[float] = None,
               slopes: Optional[Sequence[float]] = None, q_pos0: Optional[int] = None, k_pos0: int = 0,
               lsh_algorithm: str = "auto", window_eps: Optional[float] = None, window_width: int = 0,
               estimates: Optional[bool] = None, probe_rows: Optional[int] = None,
               mask_row_budget: Optional[int] = None, return_draws: bool = False, check_finite: Optional[bool] = None,
               target_rel_err: Optional[float] = None, backend: Optional[str] = None, return_lse: bool = False,
               out_dtype: Optional[str] = None, wire_dtype: Optional[str] = None, keep_context: bool = False,
               chunk_bytes: int = 0, deadline: Optional[float] = None, request_id: str = "",
               out: Optional[np.ndarray] = None, lse: Optional[np.ndarray] = None, rpc: str = "auto",
               options: Optional[Options] = None, bf16_bits: bool = False) -> AttendResult:
        """Runs one attention request; returns an AttendResult (out, lse, the
        estimates, timings; `out, meta = c.attend(...)` also works).

        q is [B, Nq, H, D] (or [Nq, H, D]), k and v [B, Nk, Hkv, D] with
        layout="bnhd", plsh's own and FlashAttention's; layout="bhnd" takes
        and returns scaled_dot_product_attention's [B, H, N, D] (the client
        transposes). Shapes that look transposed are refused with an error
        that says which tensor (check_layout=False accepts them as given:
        plsh_client._layout). q, k and v share one dtype: float32 or
        float16, or anything with wire_dtype= ("f32", "f16", "bf16"; bf16
        also takes uint16 bit patterns as they are).

        Defaults and limits are the server's, not this client's: an argument
        left as None is not sent, and the server applies its own default
        (info().defaults says which: mode lsh, samples 16, window_eps 1e-4,
        probe_rows 64, mask_row_budget 65536, estimates and check_finite on,
        backend its --backend, seed 0, in this version). scale None is
        1/sqrt(D) and q_pos0 None is Nk - Nq (SPEC section 1). samples must
        be in [1, info().limits.max_samples] (the server's --max-samples,
        4096 unless configured; the library allows at most 2^24). The seed is
        yours: the same seed draws the same hashes (SPEC section 5); the
        fresh seed per training step of SPEC section 8 is plsh_client.torch's.

        out has q's shape and layout; float32 or float16 as sent (bfloat16
        comes back as float32). With return_lse, result.lse is the float32
        log-sum-exp ([B, Nq, H] in bnhd, [B, H, Nq] in bhnd). chunk_bytes
        bounds each message's payload (0: the largest the server allows);
        deadline is in seconds. rpc: "auto" sends requests whose tensors
        total at most UNARY_MAX_BYTES (and half the server's message
        payload) as one AttendUnary message each way, others on the Attend
        stream; "stream" or "unary" force one. Raises PlshError with the
        gRPC status code on failure, ValueError for arguments this client
        can tell are wrong before sending.

        Same-host shared memory (a server with --shm-dir): q, k and v that are
        arrays of a SharedMemoryRegion of this client (region.array(...)),
        in the wire dtype and bnhd, are named in the request instead of
        sent, and the server reads them in place; out= and lse= arrays of a
        region receive the output there (result.out is then that array).
        Other arrays travel in chunks, so regions and streaming mix freely.

        sampling ("iid", "stratified" or "ash"; None: the server's default,
        iid) picks how lsh draws a head's hashes (README, "Which mode").
        target_rel_err (in (0, 1]) makes an error-targeted request: the
        library tries configurations of `mode` from the cheapest up (mode
        None: windows) and keeps the first whose probe upper bound
        summary.probe.rel_err_upper is under the target, or computes exact;
        result.target lists the attempts. keep_context keeps the forward's
        context on the server for backward(): result.context_id.
        options: an Options value instead of the option arguments.
        bf16_bits: a bfloat16 output as its uint16 bit patterns, not float32.
        """
        given = Options(mode=mode, samples=samples, seed=seed, sampling=sampling, causal=causal, scale=scale,
                        slopes=slopes, q_pos0=q_pos0, k_pos0=k_pos0, lsh_algorithm=lsh_algorithm,
                        window_eps=window_eps, window_width=window_width, estimates=estimates, probe_rows=probe_rows,
                        mask_row_budget=mask_row_budget, return_draws=return_draws, check_finite=check_finite,
                        target_rel_err=target_rel_err, backend=backend)
        if options is not None and given != Options():
            raise ValueError("options= and the option arguments: give the options one way")
        options = options if options is not None else given
        choice("rpc", rpc, {"auto": 0, "stream": 1, "unary": 2})
        arrays = _Inputs(q, k, v, layout, check_layout, options.slopes, wire_dtype)
        out_wire = out_dtype or arrays.wire
        choice("out_dtype", out_wire, DTYPES)
        s = arrays.shape
        header = attend_header(s, arrays.wire, out_wire, options)
        header.request_id = request_id
        header.return_lse = return_lse
        header.keep_context = keep_context
        header.out_chunk_bytes = max(0, chunk_bytes)

        refs = self._shm_refs(arrays, out_wire, out, lse)
        if "lse" in refs:
            header.return_lse = return_lse = True
        for name, ref in refs.items():
            getattr(header, name + "_shm").CopyFrom(ref)
        out_row, lse_row = s.heads * s.head_dim * ELEMENT_BYTES[out_wire], s.heads * 4
        rows = s.batch * s.q_len
        unary = self._use_unary(rpc, refs, arrays, rows * (out_row + (lse_row if return_lse else 0)))
        if unary:
            try:
                summary, out_raw, lse_raw = self._call_unary(header, arrays, deadline, retry=rpc == "auto")
            except _Retry:
                unary = False
        if not unary:
            summary, out_raw, lse_raw = self._call_stream(header, arrays, refs, chunk_bytes, deadline,
                                                          rows, out_row, lse_row if return_lse else 0)
        result_out = out if out_raw is None else arrays.from_bnhd(
            decode(out_raw, out_wire, (s.batch, s.q_len, s.heads, s.head_dim), bf16_bits))
        result_lse = None
        if return_lse:
            result_lse = lse if lse_raw is None else arrays.from_bnhd(
                lse_raw.view("<f4").reshape(s.batch, s.q_len, s.heads))
        return attend_result(summary, result_out, result_lse, "AttendUnary" if unary else "Attend")

    def _use_unary(self, rpc: str, refs: Dict[str, Any], arrays: "_Inputs", out_bytes: int) -> bool:
        if rpc != "auto":
            return rpc == "unary"
        if refs or self._unary_refused:
            return False
        total = arrays.nbytes + out_bytes
        info = self.cached_info()
        if info is None:
            return False
        return total <= min(UNARY_MAX_BYTES, int(info.limits.max_chunk_payload_bytes) // 2)

    def _call_unary(self, header: Any, arrays: "_Inputs", deadline: Optional[float],
                    retry: bool) -> Tuple[Any, Any, Any]:
        """AttendUnary: the request encoded in one copy from the arrays."""
        head = header.SerializeToString()
        parts: List[Any] = [b"\x0a", varint(len(head)), head]  # field 1: header
        for number, slab in ((2, arrays.q), (3, arrays.k), (4, arrays.v)):  # fields 2-4: q, k, v bytes
            data = slab.data.cast("B")
            parts += [varint(number << 3 | 2), varint(len(data)), data]
        try:
            with rpc_errors():
                raw = self._attend_unary(b"".join(parts), timeout=deadline, metadata=self._metadata)
        except PlshError as e:
            if not retry or e.code != grpc.StatusCode.PERMISSION_DENIED or self._metadata is None:
                raise
            # A token allowed Attend but not AttendUnary: stream from now on.
            self._unary_refused = True
            raise _Retry() from None
        response = pb.AttendUnaryResponse.FromString(raw)
        s = arrays.shape
        out_bytes = s.batch * s.q_len * s.heads * s.head_dim * ELEMENT_BYTES[DTYPE_NAMES.get(header.out_dtype, "f32")]
        lse_bytes = s.batch * s.q_len * s.heads * 4 if header.return_lse else 0
        if len(response.out) != out_bytes or len(response.lse) != lse_bytes:
            raise PlshError(grpc.StatusCode.INTERNAL, f"the server broke the plsh.v1 protocol: AttendUnary answered "
                            f"{len(response.out)} bytes of out and {len(response.lse)} of lse")
        out_raw = np.frombuffer(bytearray(response.out), np.uint8)
        lse_raw = np.frombuffer(bytearray(response.lse), np.uint8) if header.return_lse else None
        return response.summary, out_raw, lse_raw

    def _call_stream(self, header: Any, arrays: "_Inputs", refs: Dict[str, Any], chunk_bytes: int,
                     deadline: Optional[float], rows: int, out_row: int, lse_row: int) -> Tuple[Any, Any, Any]:
        """Attend: header, input chunks, end; output chunks into place, then the summary."""
        slabs = ((pb.TENSOR_Q, "q", arrays.q), (pb.TENSOR_K, "k", arrays.k), (pb.TENSOR_V, "v", arrays.v))
        tensors = [(t, slab) for t, name, slab in slabs if name not in refs]
        stream = Stream()
        known = self._info.limits.max_chunk_payload_bytes if self._info is not None else 0

        def requests() -> Any:
            yield pb.AttendRequest(header=header).SerializeToString()
            # Chunk sizes follow the limit the server states: in GetInfo when
            # this client asked already, else in its ack.
            cap = known
            if not cap:
                ack = stream.wait_ack()
                if ack is None:
                    return
                cap = ack_payload(ack)
            for tensor, start, part in input_chunks(payload_cap(cap, chunk_bytes), tensors):
                data = part.data.cast("B")
                # One copy, straight from the array into the message (grpcio takes bytes).
                yield b"".join((chunk_prefix(2, tensor, start, len(data) // part.strides[0], len(data)), data))
            yield pb.AttendRequest(end=pb.EndOfInput()).SerializeToString()

        out_raw = np.empty(rows * out_row, np.uint8) if "out" not in refs else None
        lse_raw = np.empty(rows * lse_row, np.uint8) if lse_row and "lse" not in refs else None
        outputs = {pb.TENSOR_OUT: _Rows(out_raw, out_row), pb.TENSOR_LSE: _Rows(lse_raw, lse_row)}
        call = self._attend_stream(requests(), timeout=deadline, metadata=self._metadata)
        with stream.receiving():
            for response in call:
                message = pb.AttendResponse.FromString(response)
                if stream.take(message) == "out_chunk":
                    c = message.out_chunk
                    if c.tensor not in outputs:
                        raise _protocol_error(c.tensor, c.row_start, c.row_count, len(c.data))
                    outputs[c.tensor].take(c.tensor, c.row_start, c.row_count, c.data)
        for rows_of in outputs.values():
            if rows_of.raw is not None and rows_of.filled * rows_of.row != len(rows_of.raw):
                raise PlshError(grpc.StatusCode.INTERNAL, "the server's output misses rows")
        return stream.summary, out_raw, lse_raw

    def backward(self, dout: Any, *, context_id: Optional[str] = None, keep_context: bool = False,
                 kv_shape: Optional[Sequence[int]] = None, q: Any = None, k: Any = None, v: Any = None,
                 out: Any = None, lse: Any = None, recompute_forward: bool = False, layout: str = "bnhd",
                 mode: Optional[str] = None, samples: Optional[int] = None, seed: Optional[int] = None,
                 sampling: Optional[str] = None, causal: bool = False, scale: Optional[float] = None,
                 slopes: Optional[Sequence[float]] = None, q_pos0: Optional[int] = None, k_pos0: int = 0,
                 lsh_algorithm: str = "auto", window_eps: Optional[float] = None, window_width: int = 0,
                 check_finite: Optional[bool] = None, backend: Optional[str] = None,
                 options: Optional[Options] = None, grad_dtype: Optional[str] = None,
                 wire_dtype: Optional[str] = None, out_dtype: Optional[str] = None, chunk_bytes: int = 0,
                 deadline: Optional[float] = None, request_id: str = "", bf16_bits: bool = False) -> BackwardResult:
        """AttendBackward (SPEC section 8): dq, dk, dv as a BackwardResult
        (`dq, dk, dv, meta = c.backward(...)` also works).

        By context: context_id= (a forward's result.context_id, made with
        keep_context=True) and dout alone go up; kv_shape (k's shape) saves
        the client reading Nk and Hkv from the stream. keep_context keeps
        the context for another backward. Statelessly: q=, k=, v= and either
        out= and lse= (the forward's, return_lse=True) or
        recompute_forward=True, with the forward's options (mode ...
        backend, as attend's, or options=): the same options give the same
        draws (the seed is the forward's result.seed). dout has out's shape
        and dtype in `layout`; gradients come in the forward's dtype unless
        grad_dtype says otherwise. Raises PlshError (FAILED_PRECONDITION for
        a context that is gone, saying why). See plsh_client._backward."""
        from ._backward import backward
        forward = Options(mode=mode, samples=samples, seed=seed, sampling=sampling, causal=causal, scale=scale,
                          slopes=slopes, q_pos0=q_pos0, k_pos0=k_pos0, lsh_algorithm=lsh_algorithm,
                          window_eps=window_eps, window_width=window_width, check_finite=check_finite, backend=backend)
        if options is not None and forward != Options():
            raise ValueError("options= and the option arguments: give the forward's options one way")
        if context_id is not None and (options is not None or forward != Options()):
            raise ValueError("by context_id the server holds the forward and its options: give only dout (and "
                             "kv_shape)")
        if options is None and context_id is None:
            options = forward
        return backward(self, dout, context_id=context_id, keep_context=keep_context, kv_shape=kv_shape, q=q, k=k,
                        v=v, out=out, lse=lse, recompute_forward=recompute_forward, layout=layout, options=options,
                        grad_dtype=grad_dtype, wire_dtype=wire_dtype, out_dtype=out_dtype, chunk_bytes=chunk_bytes,
                        deadline=deadline, request_id=request_id, bf16_bits=bf16_bits)

    def release_context(self, context_id: str, timeout: float = 10) -> int:
        """ReleaseContext: drops a kept context now; returns the bytes the server gave back."""
        return int(self._unary("ReleaseContext", pb.ReleaseContextRequest(context_id=context_id),
                               timeout).released_bytes)

    # ------------------------------------------------------ shared memory

    def register_shm(self, name: str, key: str, offset: int, byte_size: int, timeout: float = 10) -> None:
        """RegisterSharedMemory: bytes [offset, offset + byte_size) of the file
        `key` in the server's --shm-dir, as region `name`."""
        self._unary("RegisterSharedMemory", pb.RegisterSharedMemoryRequest(
            name=name, key=key, offset=offset, byte_size=byte_size), timeout)

    def unregister_shm(self, name: str, timeout: float = 10) -> None:
        """UnregisterSharedMemory (FAILED_PRECONDITION while a request uses it)."""
        self._unary("UnregisterSharedMemory", pb.UnregisterSharedMemoryRequest(name=name), timeout)
        self._regions = [r for r in self._regions if r.name != name]

    def list_shm(self, timeout: float = 10) -> List[Dict[str, Any]]:
        """ListSharedMemory: [{"name", "key", "offset", "byte_size", "requests"}]."""
        response = self._unary("ListSharedMemory", pb.ListSharedMemoryRequest(), timeout)
        return [{"name": r.name, "key": r.key, "offset": r.offset, "byte_size": r.byte_size,
                 "requests": r.requests} for r in response.regions]

    def shm_region(self, size: int, name: Optional[str] = None, dir: str = "/dev/shm") -> SharedMemoryRegion:
        """A new SharedMemoryRegion of `size` bytes in `dir` (the server's
        --shm-dir as this process sees it), registered with the server."""
        return SharedMemoryRegion(self, size, name=name, dir=dir)

    def _unary(self, method: str, request: Any, timeout: Optional[float]) -> Any:
        with rpc_errors():
            return self._unaries[method](request, timeout=timeout, metadata=self._metadata)

    def _shm_refs(self, arrays: "_Inputs", out_wire: str, out: Optional[np.ndarray],
                  lse: Optional[np.ndarray]) -> Dict[str, Any]:
        """The SharedMemoryRefs of the tensors that lie in this client's regions."""
        refs = {}
        for name, array in zip(("q", "k", "v"), arrays.originals):
            ref = self._shm_ref(array, arrays.wire)
            if ref is not None:
                if arrays.layout != "bnhd":
                    raise ValueError(f"{name} is in a shared-memory region with layout={arrays.layout!r}: the server "
                                     f"reads regions as they are, expected layout='bnhd'")
                refs[name] = ref
        s = arrays.shape
        out_bytes = s.batch * s.q_len * s.heads * s.head_dim * ELEMENT_BYTES[out_wire]
        lse_bytes = s.batch * s.q_len * s.heads * 4
        for name, array, nbytes, wire in (("out", out, out_bytes, out_wire), ("lse", lse, lse_bytes, "f32")):
            if array is None:
                continue
            ref = self._shm_ref(array, wire)
            if ref is None or ref.byte_size != nbytes or arrays.layout != "bnhd":
                raise ValueError(f"{name}= must be a C-contiguous array of {nbytes} bytes in a SharedMemoryRegion of "
                                 f"this client, in the output dtype, with layout='bnhd'")
            refs[name] = ref
        return refs

    def _shm_ref(self, array: Any, wire: str) -> Any:
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


class _Retry(Exception):
    """AttendUnary was refused for this client: the call goes again on the stream."""


class _Inputs:
    """q, k and v checked (shapes in their layout, one dtype), as [B * N, H * D] wire slabs in bnhd."""

    def __init__(self, q: Any, k: Any, v: Any, layout: str, check_layout: bool, slopes: Optional[Sequence[float]],
                 wire_dtype: Optional[str]) -> None:
        self.originals = (q, k, v)
        self.layout = layout
        arrays = [np.asarray(a) for a in (q, k, v)]
        self.shape, self.batched = _layout.resolve_shapes(arrays[0].shape, arrays[1].shape, arrays[2].shape, layout,
                                                          slopes=slopes, check=check_layout)
        for name, a in zip(("k", "v"), arrays[1:]):
            if a.dtype != arrays[0].dtype:
                raise ValueError(f"{name}: dtype {a.dtype}, expected q's dtype {arrays[0].dtype} (one dtype for q, k "
                                 f"and v; wire_dtype= sets what goes on the wire)")
        self.wire = wire_dtype_of("q", arrays[0], wire_dtype)
        self._axes = _layout.to_bnhd_axes(layout, arrays[0].ndim)
        s = self.shape
        slabs = []
        for a, n, h in zip(arrays, (s.q_len, s.kv_len, s.kv_len), (s.heads, s.kv_heads, s.kv_heads)):
            slabs.append(encode(np.transpose(a, self._axes), self.wire).reshape(s.batch * n, h * s.head_dim))
        self.q, self.k, self.v = slabs
        self.nbytes = sum(x.nbytes for x in slabs)

    def from_bnhd(self, a: np.ndarray) -> np.ndarray:
        """An output [B, N, H(, D)] in the inputs' layout and rank (a view)."""
        if self.layout == "bhnd":
            a = np.swapaxes(a, 1, 2)
        return a if self.batched else a[0]


class _Rows:
    """One output tensor filled from its chunks: in row order and whole, as the server promises."""

    def __init__(self, raw: Optional[np.ndarray], row: int) -> None:
        self.raw, self.row, self.filled = raw, row, 0

    def take(self, tensor: int, row_start: int, row_count: int, data: bytes) -> None:
        raw = self.raw
        if raw is None or row_start != self.filled or row_count < 1 or len(data) != row_count * self.row or \
                (row_start + row_count) * self.row > len(raw):
            raise _protocol_error(tensor, row_start, row_count, len(data))
        raw[row_start * self.row:(row_start + row_count) * self.row] = np.frombuffer(data, np.uint8)
        self.filled += row_count


def _protocol_error(tensor: int, row_start: int, row_count: int, nbytes: int) -> PlshError:
    return PlshError(grpc.StatusCode.INTERNAL, f"the server broke the plsh.v1 protocol: output chunk of tensor "
                     f"{tensor}, rows [{row_start}, +{row_count}) with {nbytes} bytes")
