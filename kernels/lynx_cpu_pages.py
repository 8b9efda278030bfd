"""Page blocks of the ``lynx`` codec from the CPU fast path, for radix-cache-aware encoding.

``encode_page_blocks(x, kind, first_page, count)`` returns the (anchor, residual) block of each page
``first_page .. first_page + count - 1`` of one layer ``x[T, H, D]``, byte-identical to the blocks
inside ``lynx_cpu_fast.encode(x, kind)`` (and so to the reference): the C pass runs on those pages
alone, with the sink tokens only when the span starts at page 0 (they only shape page 0). The layer
header and trailer are the caller's (``codec.page_cache.encode_with_cache``). The residual block is
the computed one, also for ``lynx-int4`` (which does not send it; its trailer is cut from it).
"""

from __future__ import annotations

import torch
from torch import Tensor

from sglang_lynx.codec.base import validate_input
from sglang_lynx.codec.layout import Kind, LayoutParams, page_block_bytes, page_sizes
from sglang_lynx.codec.quant_math import FP16_SAFE_ABS

from .lynx_cpu_fast import DTYPE_CODES, _check_common, _check_cpu, library


def encode_page_blocks(
    x: Tensor,
    kind: Kind,
    first_page: int,
    count: int,
    *,
    params: LayoutParams,
    layer: int | None = None,
    codec_name: str = "lynx",
) -> list[tuple[Tensor, Tensor]]:
    """Blocks of pages ``[first_page, first_page + count)`` of a validated CPU ``x`` (alpha = 0)."""
    _check_cpu(x)
    tokens, heads, dim = (int(s) for s in x.shape)
    page = params.page_tokens
    sizes = page_sizes(tokens, page)
    if first_page < 0 or count < 1 or first_page + count > len(sizes):
        raise ValueError(f"pages [{first_page}, {first_page + count}) are not pages of {tokens} tokens")
    if x.dtype not in DTYPE_CODES:
        validate_input(x, kind, layer, page)
    group = _check_common(params, 0.0, dim)
    span = x[first_page * page : first_page * page + sum(sizes[first_page : first_page + count])].contiguous()
    a_page, r_page = page_block_bytes("lynx", page, heads, dim, kind, params)
    block_sizes = [page_block_bytes("lynx", s, heads, dim, kind, params) for s in sizes[first_page:][:count]]
    anchor = torch.empty(sum(a for a, _ in block_sizes), dtype=torch.uint8)
    residual = torch.empty(sum(r for _, r in block_sizes), dtype=torch.uint8)
    peak = torch.zeros(count, dtype=torch.float32)
    sink = params.sink_tokens if first_page == 0 else 0
    rc = library().lynx_encode(
        span.data_ptr(), DTYPE_CODES[span.dtype], int(span.shape[0]), heads * dim, int(kind == "k"), page,
        params.chunk_tokens, group, sink, 0, a_page, r_page, anchor.data_ptr(), residual.data_ptr(), peak.data_ptr(),
    )  # fmt: skip
    if rc == 1:  # a NaN or Inf: the reference's error, naming layer and page
        validate_input(x, kind, layer, page)
    if rc != 0:
        raise RuntimeError(f"lynx CPU fast path: encode failed with code {rc} (-1: out of memory)")
    bad = peak > FP16_SAFE_ABS
    if bool(bad.any()):
        at = int(bad.nonzero()[0, 0])
        where = f"layer {layer} {kind}" if layer is not None else kind
        raise ValueError(
            f"{codec_name} {where} page {first_page + at}: |value| up to {float(peak[at]):g} exceeds "
            f"{FP16_SAFE_ABS:g}, the largest magnitude this codec's fp16 metadata can describe; use the bf16 codec "
            "for such tensors"
        )
    out, a_at, r_at = [], 0, 0
    for a, r in block_sizes:
        out.append((anchor[a_at : a_at + a], residual[r_at : r_at + r]))
        a_at, r_at = a_at + a, r_at + r
    return out
