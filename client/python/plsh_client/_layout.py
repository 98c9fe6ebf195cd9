"""Tensor layouts, and the shape checks that keep a transposed tensor from
giving a silent wrong answer.

Two layouts, for 4-D tensors and their 3-D form without the batch axis:
  "bnhd"  [B, N, H, D]: plsh's own (the wire's, SPEC section 1) and
          FlashAttention's; Client and the CLI default to it;
  "bhnd"  [B, H, N, D]: torch.nn.functional.scaled_dot_product_attention's;
          plsh_client.torch defaults to it.

Every check names the tensor that is wrong. A shape that reads as another
layout would, where the declared reading is implausible, is an error that
names the probable transposition (check_layout=False accepts it as given):
  - q's (positions, heads) are k's (heads, positions) swapped: one of them is
    in the other layout (unless explicit slopes, one per declared head, say
    the heads are meant);
  - q, k and v all have more heads than positions, and more than
    MAX_PLAUSIBLE_HEADS heads, with the standard slopes: all of them are.
The same with at most MAX_PLAUSIBLE_HEADS heads (a first decode step, Nq =
Nk = 1 with 8 heads, reads so too) cannot be decided: a LayoutWarning.
"""

import warnings
from typing import Optional, Sequence, Tuple

from ._wire import Shape

LAYOUTS = ("bnhd", "bhnd")
# No published model has more query heads than this (the largest have 128):
# more heads than positions and more than this is a transposition.
MAX_PLAUSIBLE_HEADS = 256


class LayoutWarning(UserWarning):
    """Shapes that read as plausibly in either layout: plsh read them as declared."""


def check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout = {layout!r}, expected 'bnhd' ([B, N, H, D]: plsh's, FlashAttention's) or "
                         f"'bhnd' ([B, H, N, D]: scaled_dot_product_attention's)")


def to_bnhd_axes(layout: str, rank: int) -> Tuple[int, ...]:
    """The axes that take a tensor of `layout` (rank 3 or 4) to plsh's bnhd."""
    if layout == "bnhd":
        return tuple(range(rank))
    return (0, 2, 1, 3) if rank == 4 else (1, 0, 2)


def _form(layout: str, batched: bool) -> str:
    letters = {"bnhd": "[B, N, H, D]", "bhnd": "[B, H, N, D]"}[layout]
    return letters if batched else letters.replace("B, ", "")


def _other(layout: str) -> str:
    return "bhnd" if layout == "bnhd" else "bnhd"


def _shape_text(shape: Sequence[int]) -> str:
    return "[" + ", ".join(str(int(n)) for n in shape) + "]"


def resolve_shapes(q: Sequence[int], k: Sequence[int], v: Sequence[int], layout: str, *,
                   slopes: Optional[Sequence[float]] = None, check: bool = True,
                   names: Tuple[str, str, str] = ("q", "k", "v")) -> Tuple[Shape, bool]:
    """The request's Shape and whether the tensors had a batch axis, from q,
    k and v's shapes in `layout`; ValueError (or a LayoutWarning) as the
    module docstring says."""
    check_layout(layout)
    qn, kn, vn = names
    rank = len(q)
    if rank not in (3, 4):
        raise ValueError(f"{qn}: shape {_shape_text(q)} has rank {rank}, expected {_form(layout, True)} or "
                         f"{_form(layout, False)} (layout={layout!r})")
    for name, shape in ((kn, k), (vn, v)):
        if len(shape) != rank:
            raise ValueError(f"{name}: shape {_shape_text(shape)} has rank {len(shape)}, expected rank {rank} like "
                             f"{qn} {_shape_text(q)}")
    batched = rank == 4
    axes = to_bnhd_axes(layout, rank)
    qb, kb, vb = (tuple(int(s[a]) for a in axes) if batched else (1,) + tuple(int(s[a]) for a in axes)
                  for s in (q, k, v))
    form = _form(layout, batched)
    # [B, N, H, D] from here on: index 1 positions, 2 heads, 3 head_dim.
    if kb != vb:
        wrong = [(name, s) for name, s in ((kn, kb), (vn, vb)) if s[3] != qb[3] or s[0] != qb[0]]
        if len(wrong) == 1:
            name, s = wrong[0]
            what, index = ("head_dim", 3) if s[3] != qb[3] else ("batch", 0)
            raise ValueError(f"{name}: shape {_shape_text(k if name == kn else v)} has {what} = {s[index]}, "
                             f"expected {qn}'s {what} = {qb[index]} ({form})")
        raise ValueError(f"{kn} {_shape_text(k)} and {vn} {_shape_text(v)}: expected one shape for both ({form})")
    if kb[0] != qb[0]:
        raise ValueError(f"{kn} and {vn}: batch = {kb[0]}, expected {qn}'s batch = {qb[0]} ({form})")
    if kb[3] != qb[3]:
        raise ValueError(f"{kn} and {vn}: head_dim = {kb[3]}, expected {qn}'s head_dim = {qb[3]} ({form}); or {qn} "
                         f"is the one wrong")
    sizes = Shape(batch=qb[0], q_len=qb[1], kv_len=kb[1], heads=qb[2], kv_heads=kb[2], head_dim=qb[3])
    if check:
        _check_plausible(sizes, q, k, layout, form, slopes, names)
    return sizes, batched


def _check_plausible(s: Shape, q: Sequence[int], k: Sequence[int], layout: str, form: str,
                     slopes: Optional[Sequence[float]], names: Tuple[str, str, str]) -> None:
    qn, kn, vn = names
    if slopes is not None and len(slopes) == s.heads:
        return  # one slope per declared head: the heads are meant
    other = _other(layout)
    fix = (f"pass layout={other!r} if every tensor is {_form(other, len(q) == 4)}, transpose the one that is not, "
           f"or check_layout=False if the shapes are meant")
    if s.q_len == s.kv_heads and s.heads == s.kv_len and s.q_len != s.heads:
        # One side is in the other layout. The side with more heads than positions is the likely one.
        suspect = f"{qn}" if s.heads > s.q_len else f"{kn} and {vn}"
        raise ValueError(
            f"{qn} {_shape_text(q)} read as {layout} {form} has {s.q_len} positions and {s.heads} heads, and "
            f"{kn}, {vn} {_shape_text(k)} have {s.kv_len} positions and {s.kv_heads} heads: one side's positions "
            f"are the other's heads, so {suspect} is probably in the other layout ({other}); {fix}")
    if slopes is None and s.heads > s.q_len and s.kv_heads > s.kv_len:
        text = (f"{qn} {_shape_text(q)}, {kn} and {vn} {_shape_text(k)} read as {layout} {form} have more heads "
                f"({s.heads}, {s.kv_heads}) than positions ({s.q_len}, {s.kv_len})")
        if s.heads > MAX_PLAUSIBLE_HEADS:
            raise ValueError(f"{text}: they are probably all in the other layout ({other}); {fix}")
        warnings.warn(f"{text}; read as {layout} (if they are {_form(other, len(q) == 4)}, pass layout={other!r})",
                      LayoutWarning, stacklevel=4)
