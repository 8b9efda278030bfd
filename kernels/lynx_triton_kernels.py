"""The Triton kernels of the ``lynx`` codec: one fused encode pass and one fused decode-into-pool pass.

The exact code and byte layout are those of ``sglang_lynx.codec.lynx_format`` (its module docstring);
the Python wrappers that size buffers, validate input and launch these kernels are in
``lynx_triton``. Everything here is float32 arithmetic in the reference's operation order; division
is ``tl.math.div_rn`` (IEEE round-to-nearest, like torch) and launches pass
``enable_fp_fusion=False`` so that ``a * b + c`` is never contracted into an FMA on a GPU.

Tiling (``HD = heads * head_dim`` channels, ``HALF = HD / 2`` code bytes per token):

* keys (per-channel, per-chunk groups): program ``(page, chunk, pair block)`` holds ``BLOCK_HALF``
  channel pairs of one chunk (a ``C x 2 BLOCK_HALF`` tile) as two ``[BLOCK_C, BLOCK_HALF]`` tiles, even
  and odd channels, so the two codes of one byte sit in the same tile position. ``BLOCK_HALF`` is
  capped (the wrapper's ``pairs_per_program``): a tile over all ``HD`` channels made ptxas run for
  14 s at HD = 512 and over a minute at HD = 1024 with triton 3.6 (measured on an H200 and here,
  ``benchmark/kernels/results/gpu-h200-2026-12-04``), a stall of the first encode on a GPU server.
* values (per-token groups of ``G`` channels): program ``(page, block)`` holds ``BLOCK_R`` group rows
  (a row = one (token, head, group), ``G`` contiguous channels) as even / odd ``[BLOCK_R, BLOCK_G2]``
  tiles; ``G`` must be even.

Companding (alpha > 0) uses ``log1p(z) = log(w) * z / (w - 1)`` with ``w = 1 + z`` (Goldberg) and
``expm1(y) = (e - 1) * y / log(e)`` with ``e = exp(y)`` (Kahan): accurate to a few ulp with only
``tl.log`` / ``tl.exp``, which the interpreter also has (libdevice is GPU-only). Torch computes them
with its own log1p / expm1, so with alpha > 0 a code may differ by one step at a rounding boundary.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _fp16_floor_bits(lo):
    """int16 bits of the largest fp16 <= lo (float32)."""
    h = lo.to(tl.float16)
    bits = h.to(tl.int16, bitcast=True)
    too_big = h.to(tl.float32) > lo
    is_zero = (bits == 0) | (bits == -32768)
    stepped = tl.where(bits > 0, bits - 1, bits + 1)
    stepped = tl.where(is_zero, -32767, stepped).to(tl.int16)
    return tl.where(too_big, stepped, bits).to(tl.int16)


@triton.jit
def _f16_from_bits(bits):
    return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _log1p(z):
    w = 1.0 + z
    return tl.where(w == 1.0, z, tl.log(w) * tl.math.div_rn(z, tl.where(w == 1.0, 1.0, w - 1.0)))


@triton.jit
def _expm1(y):
    e = tl.exp(y)
    lg = tl.log(e)
    safe = (e != 1.0) & (lg != 0.0)
    return tl.where(safe, tl.math.div_rn((e - 1.0) * y, tl.where(safe, lg, 1.0)), y)


@triton.jit
def _compand(u, alpha, log1p_alpha):
    t = 2.0 * u - 1.0
    s = tl.where(t > 0, 1.0, tl.where(t < 0, -1.0, 0.0))
    y = tl.math.div_rn(s * _log1p(alpha * tl.abs(t)), log1p_alpha)
    return (y + 1.0) * 0.5


@triton.jit
def _expand(u, alpha, log1p_alpha):
    y = 2.0 * u - 1.0
    s = tl.where(y > 0, 1.0, tl.where(y < 0, -1.0, 0.0))
    t = tl.math.div_rn(s * _expm1(tl.abs(y) * log1p_alpha), alpha)
    return (t + 1.0) * 0.5


@triton.jit
def _codes(x, mn, rng, alpha, log1p_alpha, COMPAND: tl.constexpr):
    """(anchor a, biased residual r) int32 codes of x in a group with fp16 min ``mn`` and range ``rng``."""
    safe = tl.where(rng > 0, rng, 1.0)
    u = tl.minimum(tl.maximum(tl.math.div_rn(x - mn, safe), 0.0), 1.0)
    if COMPAND:
        u = _compand(u, alpha, log1p_alpha)
    a = tl.minimum(tl.maximum(tl.math.ceil(u * 15.0 - 0.5), 0.0), 15.0)
    f = tl.minimum(tl.maximum(tl.math.ceil(u * 225.0 - 0.5), 0.0), 225.0)
    r = tl.minimum(tl.maximum(f - a * 15.0, -7.0), 7.0) + 7.0
    return a.to(tl.int32), r.to(tl.int32)


@triton.jit
def _value(a, r, mn, rng, alpha, log1p_alpha, HAS_RES: tl.constexpr, COMPAND: tl.constexpr):
    """Float32 reconstruction of int32 codes (``r`` unused when not HAS_RES)."""
    if HAS_RES:
        u = tl.math.div_rn((a.to(tl.float32) * 15.0 + r.to(tl.float32)) - 7.0, 225.0)
    else:
        u = tl.math.div_rn(a.to(tl.float32), 15.0)
    if COMPAND:
        u = _expand(u, alpha, log1p_alpha)
    return u * rng + mn


@triton.jit
def _store_f16_bytes(ptr, idx, bits, mask):
    """Store int16 ``bits`` little-endian at byte offsets ``2 idx`` and ``2 idx + 1``."""
    b = bits.to(tl.int32)
    tl.store(ptr + 2 * idx, (b & 0xFF).to(tl.uint8), mask=mask)
    tl.store(ptr + 2 * idx + 1, ((b >> 8) & 0xFF).to(tl.uint8), mask=mask)


@triton.jit
def _load_f16_bytes(ptr, idx, mask):
    lo = tl.load(ptr + 2 * idx, mask=mask, other=0).to(tl.int32)
    hi = tl.load(ptr + 2 * idx + 1, mask=mask, other=0).to(tl.int32)
    return _f16_from_bits(lo | (hi << 8))


@triton.jit
def _header_value(anchor_ptr, elem, mask):
    lo = tl.load(anchor_ptr + 2 * elem, mask=mask, other=0).to(tl.int32)
    hi = tl.load(anchor_ptr + 2 * elem + 1, mask=mask, other=0).to(tl.int32)
    return ((lo | (hi << 8)) << 16).to(tl.float32, bitcast=True)


@triton.jit
def _store_pool(ptr, v, mask, POOL_BF16: tl.constexpr):
    """Store float32 ``v`` in the pool dtype; a bf16 pool is passed as int16 and rounded to nearest even
    here (the interpreter's float32 -> bf16 cast truncates)."""
    if POOL_BF16:
        b = v.to(tl.int32, bitcast=True)
        b = (b + (((b >> 16) & 1) + 0x7FFF)) >> 16
        tl.store(ptr, b.to(tl.int16), mask=mask)
    else:
        tl.store(ptr, v.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def encode_keys_kernel(
    x_ptr, anchor_ptr, residual_ptr, peak_ptr,
    T, page0, hdr_bytes, a_page_bytes, r_page_bytes, alpha, log1p_alpha,
    P: tl.constexpr, C: tl.constexpr, HD: tl.constexpr, S: tl.constexpr,
    BLOCK_C: tl.constexpr, BLOCK_HALF: tl.constexpr, COMPAND: tl.constexpr,
):  # fmt: skip
    page = page0 + tl.program_id(0)  # pages [page0, page0 + programs along axis 0) of the layer
    chunk = tl.program_id(1)
    page_start = page * P
    n_p = tl.minimum(T - page_start, P)
    rows = tl.arange(0, BLOCK_C)
    j = tl.program_id(2) * BLOCK_HALF + tl.arange(0, BLOCK_HALF)  # this program's channel pairs
    chunk_tokens = tl.minimum(tl.maximum(n_p - chunk * C, 0), C)
    row_ok = rows < chunk_tokens
    col_ok = j < HD // 2
    mask = row_ok[:, None] & col_ok[None, :]
    tok = page_start + chunk * C + rows
    # page 0 keys: the first S tokens take token S's values in the statistics (when the page has token S)
    sink_active = (page == 0) & (S > 0) & (n_p > S)
    stat_tok = tl.where(sink_active & (tok < S), S, tok)
    even = 2 * j
    s_off = stat_tok.to(tl.int64)[:, None] * HD + even[None, :]
    s_even = tl.load(x_ptr + s_off, mask=mask, other=0.0).to(tl.float32)
    s_odd = tl.load(x_ptr + s_off + 1, mask=mask, other=0.0).to(tl.float32)
    lo_e = tl.min(tl.where(mask, s_even, float("inf")), axis=0)
    hi_e = tl.max(tl.where(mask, s_even, float("-inf")), axis=0)
    lo_o = tl.min(tl.where(mask, s_odd, float("inf")), axis=0)
    hi_o = tl.max(tl.where(mask, s_odd, float("-inf")), axis=0)
    chunk_ok = col_ok & (chunk_tokens > 0)
    lo_e = tl.where(chunk_ok, lo_e, 0.0)
    hi_e = tl.where(chunk_ok, hi_e, 0.0)
    lo_o = tl.where(chunk_ok, lo_o, 0.0)
    hi_o = tl.where(chunk_ok, hi_o, 0.0)
    peak = tl.maximum(tl.maximum(tl.abs(lo_e), tl.abs(hi_e)), tl.maximum(tl.abs(lo_o), tl.abs(hi_o)))
    program = (tl.program_id(0) * tl.num_programs(1) + chunk) * tl.num_programs(2) + tl.program_id(2)
    tl.store(peak_ptr + program, tl.max(peak, axis=0))
    mn_e_bits = _fp16_floor_bits(lo_e)
    mn_o_bits = _fp16_floor_bits(lo_o)
    mn_e = _f16_from_bits(mn_e_bits)
    mn_o = _f16_from_bits(mn_o_bits)
    rng_e_bits = _fp16_floor_bits(-(hi_e - mn_e)) ^ -32768  # ceil(z) = -floor(-z): flip the sign bit
    rng_o_bits = _fp16_floor_bits(-(hi_o - mn_o)) ^ -32768
    rng_e = _f16_from_bits(rng_e_bits)
    rng_o = _f16_from_bits(rng_o_bits)
    block = anchor_ptr + hdr_bytes + page.to(tl.int64) * a_page_bytes
    groups = tl.cdiv(n_p, C) * HD
    meta = chunk * HD + even
    _store_f16_bytes(block, meta, mn_e_bits, chunk_ok)
    _store_f16_bytes(block, meta + 1, mn_o_bits, chunk_ok)
    _store_f16_bytes(block + 2 * groups, meta, rng_e_bits, chunk_ok)
    _store_f16_bytes(block + 2 * groups, meta + 1, rng_o_bits, chunk_ok)
    x_off = tok.to(tl.int64)[:, None] * HD + even[None, :]
    x_even = tl.load(x_ptr + x_off, mask=mask, other=0.0).to(tl.float32)
    x_odd = tl.load(x_ptr + x_off + 1, mask=mask, other=0.0).to(tl.float32)
    a_e, r_e = _codes(x_even, mn_e[None, :], rng_e[None, :], alpha, log1p_alpha, COMPAND)
    a_o, r_o = _codes(x_odd, mn_o[None, :], rng_o[None, :], alpha, log1p_alpha, COMPAND)
    code_off = (chunk * C + rows)[:, None] * (HD // 2) + j[None, :]
    tl.store(block + 4 * groups + code_off, (a_e | (a_o << 4)).to(tl.uint8), mask=mask)
    res_block = residual_ptr + page.to(tl.int64) * r_page_bytes
    tl.store(res_block + code_off, (r_e | (r_o << 4)).to(tl.uint8), mask=mask)


@triton.jit
def encode_values_kernel(
    x_ptr, anchor_ptr, residual_ptr, peak_ptr,
    T, page0, hdr_bytes, a_page_bytes, r_page_bytes, alpha, log1p_alpha,
    P: tl.constexpr, G: tl.constexpr, HD: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_G2: tl.constexpr, COMPAND: tl.constexpr,
):  # fmt: skip
    page = page0 + tl.program_id(0)
    blk = tl.program_id(1)
    page_start = page * P
    n_p = tl.minimum(T - page_start, P)
    groups = n_p * (HD // G)
    row = blk * BLOCK_R + tl.arange(0, BLOCK_R)
    k = tl.arange(0, BLOCK_G2)
    row_ok = row < groups
    mask = row_ok[:, None] & (k < G // 2)[None, :]
    x_off = page_start.to(tl.int64) * HD + row.to(tl.int64)[:, None] * G + 2 * k[None, :]
    x_even = tl.load(x_ptr + x_off, mask=mask, other=0.0).to(tl.float32)
    x_odd = tl.load(x_ptr + x_off + 1, mask=mask, other=0.0).to(tl.float32)
    lo = tl.minimum(
        tl.min(tl.where(mask, x_even, float("inf")), axis=1), tl.min(tl.where(mask, x_odd, float("inf")), axis=1)
    )
    hi = tl.maximum(
        tl.max(tl.where(mask, x_even, float("-inf")), axis=1), tl.max(tl.where(mask, x_odd, float("-inf")), axis=1)
    )
    lo = tl.where(row_ok, lo, 0.0)
    hi = tl.where(row_ok, hi, 0.0)
    tl.store(peak_ptr + tl.program_id(0) * tl.num_programs(1) + blk, tl.max(tl.maximum(tl.abs(lo), tl.abs(hi)), axis=0))
    mn_bits = _fp16_floor_bits(lo)
    mn = _f16_from_bits(mn_bits)
    rng_bits = _fp16_floor_bits(-(hi - mn)) ^ -32768
    rng = _f16_from_bits(rng_bits)
    block = anchor_ptr + hdr_bytes + page.to(tl.int64) * a_page_bytes
    _store_f16_bytes(block, row, mn_bits, row_ok)
    _store_f16_bytes(block + 2 * groups, row, rng_bits, row_ok)
    a_e, r_e = _codes(x_even, mn[:, None], rng[:, None], alpha, log1p_alpha, COMPAND)
    a_o, r_o = _codes(x_odd, mn[:, None], rng[:, None], alpha, log1p_alpha, COMPAND)
    code_off = row[:, None] * (G // 2) + k[None, :]
    tl.store(block + 4 * groups + code_off, (a_e | (a_o << 4)).to(tl.uint8), mask=mask)
    tl.store(residual_ptr + page.to(tl.int64) * r_page_bytes + code_off, (r_e | (r_o << 4)).to(tl.uint8), mask=mask)


@triton.jit
def decode_keys_kernel(
    anchor_ptr, residual_ptr, pool_ptr, slot_ptr,
    T, pool_stride, hdr_bytes, a_page_bytes, r_page_bytes, sink, alpha, log1p_alpha,
    P: tl.constexpr, C: tl.constexpr, HD: tl.constexpr,
    BLOCK_C: tl.constexpr, BLOCK_HALF: tl.constexpr,
    HAS_RES: tl.constexpr, COMPAND: tl.constexpr, POOL_BF16: tl.constexpr,
):  # fmt: skip
    page = tl.program_id(0)
    chunk = tl.program_id(1)
    page_start = page * P
    n_p = tl.minimum(T - page_start, P)
    rows = tl.arange(0, BLOCK_C)
    j = tl.program_id(2) * BLOCK_HALF + tl.arange(0, BLOCK_HALF)
    chunk_tokens = tl.minimum(tl.maximum(n_p - chunk * C, 0), C)
    row_ok = rows < chunk_tokens
    col_ok = j < HD // 2
    mask = row_ok[:, None] & col_ok[None, :]
    chunk_ok = col_ok & (chunk_tokens > 0)
    even = 2 * j
    block = anchor_ptr + hdr_bytes + page.to(tl.int64) * a_page_bytes
    groups = tl.cdiv(n_p, C) * HD
    meta = chunk * HD + even
    mn_e = _load_f16_bytes(block, meta, chunk_ok)
    mn_o = _load_f16_bytes(block, meta + 1, chunk_ok)
    rng_e = _load_f16_bytes(block + 2 * groups, meta, chunk_ok)
    rng_o = _load_f16_bytes(block + 2 * groups, meta + 1, chunk_ok)
    code_off = (chunk * C + rows)[:, None] * (HD // 2) + j[None, :]
    a = tl.load(block + 4 * groups + code_off, mask=mask, other=0).to(tl.int32)
    if HAS_RES:
        r = tl.load(residual_ptr + page.to(tl.int64) * r_page_bytes + code_off, mask=mask, other=0).to(tl.int32)
    else:
        r = a
    v_e = _value(a & 15, r & 15, mn_e[None, :], rng_e[None, :], alpha, log1p_alpha, HAS_RES, COMPAND)
    v_o = _value(a >> 4, r >> 4, mn_o[None, :], rng_o[None, :], alpha, log1p_alpha, HAS_RES, COMPAND)
    tok = page_start + chunk * C + rows
    is_sink = (tok < sink)[:, None] & mask
    elem = tok.to(tl.int64)[:, None] * HD + even[None, :]
    v_e = tl.where(is_sink, _header_value(anchor_ptr, elem, is_sink), v_e)
    v_o = tl.where(is_sink, _header_value(anchor_ptr, elem + 1, is_sink), v_o)
    slot = tl.load(slot_ptr + tok, mask=row_ok, other=0)
    dst = pool_ptr + slot[:, None] * pool_stride + even[None, :]
    _store_pool(dst, v_e, mask, POOL_BF16)
    _store_pool(dst + 1, v_o, mask, POOL_BF16)


@triton.jit
def decode_values_kernel(
    anchor_ptr, residual_ptr, pool_ptr, slot_ptr,
    T, pool_stride, hdr_bytes, a_page_bytes, r_page_bytes, sink, alpha, log1p_alpha,
    P: tl.constexpr, G: tl.constexpr, HD: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_G2: tl.constexpr,
    HAS_RES: tl.constexpr, COMPAND: tl.constexpr, POOL_BF16: tl.constexpr,
):  # fmt: skip
    page = tl.program_id(0)
    blk = tl.program_id(1)
    page_start = page * P
    n_p = tl.minimum(T - page_start, P)
    groups = n_p * (HD // G)
    row = blk * BLOCK_R + tl.arange(0, BLOCK_R)
    k = tl.arange(0, BLOCK_G2)
    row_ok = row < groups
    mask = row_ok[:, None] & (k < G // 2)[None, :]
    block = anchor_ptr + hdr_bytes + page.to(tl.int64) * a_page_bytes
    mn = _load_f16_bytes(block, row, row_ok)
    rng = _load_f16_bytes(block + 2 * groups, row, row_ok)
    code_off = row[:, None] * (G // 2) + k[None, :]
    a = tl.load(block + 4 * groups + code_off, mask=mask, other=0).to(tl.int32)
    if HAS_RES:
        r = tl.load(residual_ptr + page.to(tl.int64) * r_page_bytes + code_off, mask=mask, other=0).to(tl.int32)
    else:
        r = a
    v_e = _value(a & 15, r & 15, mn[:, None], rng[:, None], alpha, log1p_alpha, HAS_RES, COMPAND)
    v_o = _value(a >> 4, r >> 4, mn[:, None], rng[:, None], alpha, log1p_alpha, HAS_RES, COMPAND)
    tok = page_start + row // (HD // G)
    ch = (row % (HD // G)) * G
    is_sink = (tok < sink)[:, None] & mask
    elem = tok.to(tl.int64)[:, None] * HD + ch[:, None] + 2 * k[None, :]
    v_e = tl.where(is_sink, _header_value(anchor_ptr, elem, is_sink), v_e)
    v_o = tl.where(is_sink, _header_value(anchor_ptr, elem + 1, is_sink), v_o)
    slot = tl.load(slot_ptr + tok, mask=row_ok, other=0)
    dst = pool_ptr + slot[:, None] * pool_stride + ch[:, None] + 2 * k[None, :]
    _store_pool(dst, v_e, mask, POOL_BF16)
    _store_pool(dst + 1, v_o, mask, POOL_BF16)
