"""What plsh_client puts on the wire and reads back: the enum names (read
from the proto's enums, so that a value added there is a name here), the
AttendHeader of a call's options, and tensors as little-endian bytes.
Shared by Client.attend, Client.backward and the torch op."""

from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from ._proto import pb


def _names(enum: Any, prefix: str, keep_zero: bool) -> Dict[str, int]:
    """{"exact": MODE_EXACT, ...} from the proto enum's value names."""
    return {name[len(prefix):].lower(): number for name, number in enum.items()
            if keep_zero or number != 0}


# DTYPE_F32 -> "f32"; MODE_EXACT -> "exact"; LSH_ALGORITHM_PER_SAMPLE -> "per_sample"; SAMPLING_ASH -> "ash"
DTYPES = _names(pb.DType, "DTYPE_", keep_zero=False)
MODES = _names(pb.Mode, "MODE_", keep_zero=False)
ALGORITHMS = _names(pb.LshAlgorithm, "LSH_ALGORITHM_", keep_zero=True)
SAMPLINGS = _names(pb.Sampling, "SAMPLING_", keep_zero=True)
MODE_NAMES = {number: name for name, number in MODES.items()}
ALGORITHM_NAMES = {number: name for name, number in ALGORITHMS.items()}
SAMPLING_NAMES = {number: name for name, number in SAMPLINGS.items()}
DTYPE_NAMES = {number: name for name, number in DTYPES.items()}
ELEMENT_BYTES = {"f32": 4, "f16": 2, "bf16": 2}
# numpy arrays sent as they are: float32 and float16, and bfloat16 as its
# uint16 bit patterns (what a torch.bfloat16 tensor's .view(torch.int16) gives).
_AS_IS = {np.dtype(np.float32): "f32", np.dtype(np.float16): "f16"}


def choice(name: str, value: Optional[str], table: Mapping[str, int]) -> None:
    """ValueError naming the argument unless value is None or a name of table."""
    if value is not None and value not in table:
        raise ValueError(f"{name} = {value!r}, expected one of {', '.join(sorted(table))}")


def wire_dtype_of(name: str, array: np.ndarray, wire_dtype: Optional[str]) -> str:
    """The wire dtype of an input: wire_dtype when given, else the array's own."""
    if wire_dtype is not None:
        choice("wire_dtype", wire_dtype, DTYPES)
        return wire_dtype
    found = _AS_IS.get(array.dtype)
    if found is None:
        raise ValueError(f"{name}: dtype {array.dtype} is not sent as is; expected float32 or float16 "
                         f"(or wire_dtype= to convert)")
    return found


def _to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16), round to nearest even."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    nan = (bits & 0x7FFFFFFF) > 0x7F800000
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    return np.asarray(np.where(nan, ((bits >> 16) | 0x40).astype(np.uint16), rounded))


def bf16_bits_to_f32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def encode(array: np.ndarray, wire: str) -> np.ndarray:
    """The array's bytes on the wire, little-endian and C order (no copy when
    it is so already). bf16 takes float arrays, or uint16 bit patterns as they are."""
    if wire == "f32":
        return np.ascontiguousarray(array, dtype="<f4")
    if wire == "f16":
        return np.ascontiguousarray(array, dtype="<f2")
    if array.dtype == np.uint16:
        return np.ascontiguousarray(array, dtype="<u2")
    return _to_bf16_bits(array).astype("<u2")


def decode(raw: np.ndarray, wire: str, shape: Sequence[int], bf16_bits: bool = False) -> np.ndarray:
    """An output from its wire bytes (a uint8 array): a view for float32 and
    float16, float32 values (or with bf16_bits the uint16 patterns) for bfloat16."""
    if wire == "f32":
        return raw.view("<f4").reshape(shape)
    if wire == "f16":
        return raw.view("<f2").reshape(shape)
    bits = raw.view("<u2").reshape(shape)
    return bits if bf16_bits else bf16_bits_to_f32(bits)


@dataclass
class Options:
    """The options of one attention, as Client.attend takes them. None
    leaves a field unset on the wire: the server applies its default
    (GetInfo's defaults say which)."""
    mode: Optional[str] = None
    samples: Optional[int] = None
    seed: Optional[int] = None
    sampling: Optional[str] = None
    causal: bool = False
    scale: Optional[float] = None
    slopes: Optional[Sequence[float]] = None
    q_pos0: Optional[int] = None
    k_pos0: int = 0
    lsh_algorithm: str = "auto"
    window_eps: Optional[float] = None
    window_width: int = 0
    estimates: Optional[bool] = None
    probe_rows: Optional[int] = None
    mask_row_budget: Optional[int] = None
    return_draws: bool = False
    check_finite: Optional[bool] = None
    target_rel_err: Optional[float] = None
    backend: Optional[str] = None
    extra: Dict[str, Any] = field(default_factory=dict)  # AttendHeader fields by name, for options newer than these

    def check(self) -> None:
        choice("mode", self.mode, MODES)
        choice("lsh_algorithm", self.lsh_algorithm, ALGORITHMS)
        choice("sampling", self.sampling, SAMPLINGS)
        if self.seed is not None and not 0 <= self.seed < 1 << 64:
            raise ValueError(f"seed = {self.seed}, expected an integer in [0, 2^64)")


# The optional AttendHeader fields that an Options value left as None does not set.
_OPTIONAL = ("scale", "q_pos0", "samples", "window_eps", "estimates", "probe_rows", "mask_row_budget",
             "check_finite", "target_rel_err")


def attend_header(shape: "Shape", wire: str, out_wire: str, o: Options) -> Any:
    """The AttendHeader of a request (Attend, AttendUnary, and the forward of a stateless AttendBackward)."""
    o.check()
    header = pb.AttendHeader(
        batch=shape.batch, q_len=shape.q_len, kv_len=shape.kv_len, heads=shape.heads, kv_heads=shape.kv_heads,
        head_dim=shape.head_dim, dtype=DTYPES[wire], out_dtype=DTYPES[out_wire], causal=o.causal,
        slopes=list(o.slopes or []), k_pos0=o.k_pos0, seed=o.seed or 0, lsh_algorithm=ALGORITHMS[o.lsh_algorithm],
        window_width=o.window_width, return_draws=o.return_draws, backend=o.backend or "")
    if o.mode is not None:
        header.mode = MODES[o.mode]
    if o.sampling is not None:
        header.sampling = SAMPLINGS[o.sampling]
    for name in _OPTIONAL:
        value = getattr(o, name)
        if value is not None:
            setattr(header, name, value)
    for name, value in o.extra.items():
        setattr(header, name, value)
    return header


@dataclass(frozen=True)
class Shape:
    """A request's sizes, in plsh's [B, N, H, D] terms."""
    batch: int
    q_len: int
    kv_len: int
    heads: int
    kv_heads: int
    head_dim: int


def input_chunks(payload: int, tensors: List[Tuple[int, np.ndarray]]) -> Iterator[Tuple[int, int, np.ndarray]]:
    """(tensor, row_start, rows) of every chunk of the [rows, row bytes]
    slabs in tensors [(tensor, slab)], whole rows of at most `payload` bytes
    (at least one row)."""
    for tensor, rows in tensors:
        per_chunk = max(1, payload // max(1, rows.strides[0]))
        for start in range(0, rows.shape[0], per_chunk):
            yield tensor, start, rows[start:start + per_chunk]


def varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def chunk_prefix(field_number: int, tensor: int, row_start: int, row_count: int, nbytes: int) -> bytes:
    """Everything of a request message whose field `field_number` is a
    TensorChunk, but the chunk data's bytes: so that the data goes into the
    message in one copy, from the array (protobuf would copy it twice more).
    Read back by protobuf on the server's side in C++ (proto/chunk_codec.cpp)."""
    fields = (b"\x08" + varint(tensor) + b"\x10" + varint(row_start) + b"\x18" + varint(row_count) +
              b"\x22" + varint(nbytes))
    return varint(field_number << 3 | 2) + varint(len(fields) + nbytes) + fields
