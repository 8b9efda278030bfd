"""Page blocks of the ``lynx`` codec from the CPU fast path, for radix-cache-aware encoding.

``encode_pages_into(x, kind, first_page, count, anchor, residual)`` writes pages ``first_page ..
first_page + count - 1`` of one layer ``x[T, H, D]`` at their offsets in the layer's streams,
byte-identical to ``lynx_cpu_fast.encode(x, kind)`` there (and so to the reference): the C pass runs on
those pages only (page indices stay absolute, so page 0 keeps its sink tokens and writes the header).
``encode_page_blocks`` returns the pages' blocks as views instead. The trailer is the caller's
(``codec.page_reuse_encode``). The residual is the computed one, also for ``lynx-int4`` (which does
not send it; its trailer is cut from it).
"""

from __future__ import annotations

import torch
from torch import Tensor

from sglang_lynx.codec.base import ACCEPTED_DTYPES, validate_input
from sglang_lynx.codec.layout import Kind, LayoutParams, check_shape, key_chunk, page_sizes
from sglang_lynx.codec.lynx_format import KEY_CHUNK_FIELD
from sglang_lynx.codec.page_reuse_encode import check_page_range
from sglang_lynx.codec.quant_math import FP16_SAFE_ABS

from .lynx_cpu_fast import DTYPE_CODES, _check_common, _check_cpu, _layout, library, raise_encode_errors
from .lynx_cpu_threads import run_pages


def encode_pages_into(
    x: Tensor,
    kind: Kind,
    first_page: int,
    count: int,
    anchor: Tensor,
    residual: Tensor,
    *,
    params: LayoutParams,
    layer: int | None = None,
    codec_name: str = "lynx",
    threads: int | None = None,
) -> None:
    """Write pages ``[first_page, first_page + count)`` of a CPU ``x`` (alpha = 0) at their offsets in the
    layer's streams ``anchor`` / ``residual`` (contiguous uint8, at least the layer's ``lynx`` sizes;
    page 0 also writes the header). Nothing else of the buffers is touched."""
    if not isinstance(x, Tensor) or x.dim() != 3 or x.dtype not in ACCEPTED_DTYPES:
        validate_input(x, kind, layer, params.page_tokens)  # the reference's errors
    _check_cpu(x, anchor, residual)
    tokens, heads, dim = (int(s) for s in x.shape)
    check_shape(tokens, heads, dim, kind)
    sizes = page_sizes(tokens, params.page_tokens)
    group = _check_common(params, 0.0, dim)
    lay = _layout(tokens, heads, dim, kind, params)
    check_page_range(tokens, params.page_tokens, first_page, count, (("anchor", anchor, lay.a_len),
                                                                     ("residual", residual, lay.r_len)))
    x = x.contiguous()
    peak = torch.zeros(max(lay.pages, 1), dtype=torch.float32)
    lib, ap, rp, pp = library(), anchor.data_ptr(), residual.data_ptr(), peak.data_ptr()
    args = (x.data_ptr(), DTYPE_CODES[x.dtype], tokens, heads * dim, int(kind == "k"), params.page_tokens,
            key_chunk(params, KEY_CHUNK_FIELD), group, params.sink_tokens, lay.sink, lay.hdr, lay.a_page,
            lay.r_page)  # fmt: skip
    span_values = sum(sizes[first_page : first_page + count]) * heads * dim
    rcs = run_pages(lambda p0, p1: lib.lynx_encode(*args, first_page + p0, first_page + p1, ap, rp, pp, FP16_SAFE_ABS),
                    count, span_values, threads)  # fmt: skip
    raise_encode_errors(rcs, x, kind, layer, params, peak, codec_name)


def encode_page_blocks(
    x: Tensor,
    kind: Kind,
    first_page: int,
    count: int,
    *,
    params: LayoutParams,
    layer: int | None = None,
    codec_name: str = "lynx",
    threads: int | None = None,
) -> list[tuple[Tensor, Tensor]]:
    """Blocks of pages ``[first_page, first_page + count)`` of a CPU ``x`` (alpha = 0), as views."""
    tokens, heads, dim = (int(s) for s in x.shape) if isinstance(x, Tensor) and x.dim() == 3 else (0, 0, 0)
    if not tokens:
        validate_input(x, kind, layer, params.page_tokens)
    lay = _layout(tokens, heads, dim, kind, params)
    anchor = torch.empty(lay.a_len, dtype=torch.uint8)
    residual = torch.empty(lay.r_len, dtype=torch.uint8)
    encode_pages_into(x, kind, first_page, count, anchor, residual, params=params, layer=layer,
                      codec_name=codec_name, threads=threads)
    sizes = page_sizes(tokens, params.page_tokens)
    out = []
    for p in range(first_page, first_page + count):
        a_at, r_at = lay.hdr + p * lay.a_page, p * lay.r_page
        full = sizes[p] == params.page_tokens
        a_len = lay.a_page if full else lay.a_len - lay.trailer - a_at
        r_len = lay.r_page if full else lay.r_len - r_at
        out.append((anchor[a_at : a_at + a_len], residual[r_at : r_at + r_len]))
    return out
