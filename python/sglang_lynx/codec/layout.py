"""The one table of byte layouts of every KV codec, and the sizes that follow from it.

Every codec encodes one layer's keys or values ``x[num_tokens, num_heads, head_dim]`` into two
contiguous ``uint8`` streams, *anchor* and *residual* (residual is empty for one-stream schemes).
All streams are **page-major**: the tokens are cut into pages of ``page_tokens`` tokens (the last
page may be partial) and each page is encoded into a block that depends on that page only, so a
page of a prefix that was encoded before can be reused (see ``page_cache``). A stream is::

    [layer header][page 0 block][page 1 block]...[page n-1 block][layer trailer]

The layer header is only used by ``lynx`` (its exact sink tokens), the layer trailer (anchor stream only) by
``lynx`` (the residual nibbles of the last ``recent_tokens`` tokens; see ``lynx_format``) and KIVI (the
bf16 values of the last ``kivi_recent_tokens`` tokens, KIVI's full-precision residual; see ``baselines``). Inside a
page block the order is always: page metadata, group metadata, codes; codes are packed low nibble
(or low crumb) first. The exact per-scheme layout is documented in the scheme's module
(``lynx_format``, ``lynx_paper``, ``baselines``); this module holds the *sizes*, which the receiver
computes from shapes alone to preallocate staging before any byte arrives.

Groupings (one metadata record per group):

* ``token``   -- ``G = min(group_size, head_dim)`` consecutive channels of one token and head
  (``lynx``: ``min(value_group_size, head_dim)``, see the row's ``token_group_field``);
* ``channel`` -- ``C = chunk_tokens`` consecutive tokens of one channel (the last chunk of a partial
  page may be shorter; ``lynx``: ``min(key_chunk_tokens, page_tokens)``, the row's ``chunk_field``);
* ``none``    -- no metadata (bf16).

Invariant: ``stream_bytes`` of a scheme equals ``len(encode(x).anchor), len(encode(x).residual)``
for every shape; tests check it on random shapes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Kind = Literal["k", "v"]
Grouping = Literal["token", "channel", "none"]

KINDS: tuple[str, ...] = ("k", "v")
MAX_RECENT_TOKENS = 1 << 20


@dataclass(frozen=True)
class LayoutParams:
    """Sizes that shape the layouts; fields and defaults mirror ``sglang_lynx.config.LynxConfig``."""

    page_tokens: int = 256
    chunk_tokens: int = 32
    group_size: int = 64
    sink_tokens: int = 1
    value_group_size: int = 64  # lynx only: dims per value group (measured: BENCHMARKS / RESULTS.md)
    key_chunk_tokens: int = 64  # lynx only: tokens per key chunk (capped at page_tokens; measured, as above)
    recent_tokens: int = 48  # lynx only: last tokens whose residual also rides in the anchor (trailer; measured)
    kivi_recent_tokens: int = 0  # KIVI only: its residual length R, the last R tokens sent in bf16 (0 = off)

    def __post_init__(self) -> None:
        for name in ("page_tokens", "chunk_tokens", "group_size", "value_group_size", "key_chunk_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected a positive integer, got {value!r}")
        if self.page_tokens % self.chunk_tokens:
            raise ValueError(f"chunk_tokens ({self.chunk_tokens}) must divide page_tokens ({self.page_tokens})")
        if self.page_tokens % min(self.key_chunk_tokens, self.page_tokens):
            raise ValueError(f"key_chunk_tokens ({self.key_chunk_tokens}) must divide page_tokens ({self.page_tokens})")
        if isinstance(self.sink_tokens, bool) or not isinstance(self.sink_tokens, int):
            raise ValueError(f"sink_tokens: expected an integer, got {self.sink_tokens!r}")
        if not 0 <= self.sink_tokens <= self.page_tokens:
            raise ValueError(f"sink_tokens: {self.sink_tokens} is out of range [0, {self.page_tokens}]")
        for name in ("recent_tokens", "kivi_recent_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{name}: expected an integer, got {value!r}")
            if not 0 <= value <= MAX_RECENT_TOKENS:
                raise ValueError(f"{name}: {value} is out of range [0, {MAX_RECENT_TOKENS}]")


@dataclass(frozen=True)
class SchemeLayout:
    """How one scheme spends bytes. ``*_bits`` are bits per code; 16 means raw bf16 values."""

    name: str
    anchor_bits: int
    residual_bits: int
    k_grouping: Grouping
    v_grouping: Grouping
    group_meta_bytes: int  # anchor-stream bytes per group: fp16 min + fp16 range (or mean + spread)
    page_meta_bytes_per_channel: int  # anchor-stream bytes per (page, channel): lynx-paper's page min/scale
    sink_bytes_per_value: int  # layer-header bytes per value of the first sink_tokens tokens (bf16)
    meta_dtype: str  # dtype of every metadata record
    token_group_field: str = "group_size"  # the LayoutParams field that sizes ``token`` groups
    trailer_bits_per_value: int = 0  # layer-trailer bits per value of the last recent_tokens tokens
    chunk_field: str = "chunk_tokens"  # the LayoutParams field that sizes ``channel`` groups (see key_chunk)
    trailer_field: str = "recent_tokens"  # the LayoutParams field that counts the layer trailer's tokens

    def grouping(self, kind: Kind) -> Grouping:
        return self.k_grouping if kind == "k" else self.v_grouping


#: THE table. ``lynx-int4`` / ``lynx-int8`` are the ``lynx`` codec decoded anchor-only / full;
#: ``lynx-exact`` is ``lynx`` plus a third stream whose size depends on the values (``lynx_exact``
#: documents its layout; ``benchmark/codec/results/bits_per_stream.json`` its measured bits per value).
LAYOUTS: dict[str, SchemeLayout] = {
    "bf16": SchemeLayout("bf16", 16, 0, "none", "none", 0, 0, 0, "none"),
    "int8": SchemeLayout("int8", 8, 0, "token", "token", 4, 0, 0, "float16"),
    "int4": SchemeLayout("int4", 4, 0, "token", "token", 4, 0, 0, "float16"),
    "kivi-int4": SchemeLayout("kivi-int4", 4, 0, "channel", "token", 4, 0, 0, "float16", "group_size", 16,
                              trailer_field="kivi_recent_tokens"),
    "kivi-int2": SchemeLayout("kivi-int2", 2, 0, "channel", "token", 4, 0, 0, "float16", "group_size", 16,
                              trailer_field="kivi_recent_tokens"),
    "lynx-paper": SchemeLayout("lynx-paper", 4, 4, "channel", "channel", 4, 4, 0, "float16"),
    "lynx": SchemeLayout("lynx", 4, 4, "channel", "token", 4, 0, 2, "float16", "value_group_size", 4,
                         "key_chunk_tokens"),
}
#: Names that map onto a layout of the table, with whether their residual stream is sent.
ALIASES: dict[str, tuple[str, bool]] = {
    "lynx-int4": ("lynx", False),
    "lynx-int8": ("lynx", True),
    "lynx-exact": ("lynx", True),  # + the exact stream (``lynx_exact``): entropy-coded, no fixed size
}


def scheme_layout(codec_name: str) -> SchemeLayout:
    """The layout row of a codec name (aliases resolved); unknown names list the valid ones."""
    base = ALIASES.get(codec_name, (codec_name, True))[0]
    if base not in LAYOUTS:
        valid = ", ".join([*LAYOUTS, *ALIASES])
        raise ValueError(f"unknown codec {codec_name!r}; valid codecs: {valid}")
    return LAYOUTS[base]


def check_shape(num_tokens: int, num_heads: int, head_dim: int, kind: str) -> None:
    """Reject shapes no scheme can lay out, with a message that says why."""
    for name, value in (("num_tokens", num_tokens), ("num_heads", num_heads), ("head_dim", head_dim)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{name}: expected an integer, got {value!r}")
    if num_tokens < 0 or num_heads < 1 or head_dim < 1:
        raise ValueError(f"bad KV shape [{num_tokens}, {num_heads}, {head_dim}]")
    if (num_heads * head_dim) % 4:
        raise ValueError(f"num_heads * head_dim must be a multiple of 4, got {num_heads} * {head_dim}")
    if kind not in KINDS:
        raise ValueError(f"kind must be 'k' or 'v', got {kind!r}")


def token_group(params: LayoutParams, head_dim: int, field: str = "group_size") -> int:
    """Channels per ``token`` group: ``min(params.<field>, head_dim)``, which must divide head_dim."""
    size = getattr(params, field)
    group = min(size, head_dim)
    if head_dim % group:
        raise ValueError(f"{field} {size} does not divide head_dim {head_dim}")
    return group


def key_chunk(params: LayoutParams, field: str = "chunk_tokens") -> int:
    """Tokens per ``channel`` group: ``min(params.<field>, page_tokens)`` (a divisor of page_tokens)."""
    return min(getattr(params, field), params.page_tokens)


def num_groups(
    grouping: Grouping,
    page_tokens: int,
    num_heads: int,
    head_dim: int,
    params: LayoutParams,
    field: str = "group_size",
    chunk_field: str = "chunk_tokens",
) -> int:
    """Metadata records of one page block holding ``page_tokens`` tokens."""
    if grouping == "none":
        return 0
    if grouping == "token":
        return page_tokens * num_heads * (head_dim // token_group(params, head_dim, field))
    chunks = -(-page_tokens // key_chunk(params, chunk_field))
    return chunks * num_heads * head_dim


def sink_count(codec_name: str, num_tokens: int, params: LayoutParams) -> int:
    """Tokens kept exact in the layer header."""
    return min(params.sink_tokens, num_tokens) if scheme_layout(codec_name).sink_bytes_per_value else 0


def header_bytes(codec_name: str, num_tokens: int, num_heads: int, head_dim: int, params: LayoutParams) -> int:
    layout = scheme_layout(codec_name)
    return sink_count(codec_name, num_tokens, params) * num_heads * head_dim * layout.sink_bytes_per_value


def trailer_count(codec_name: str, num_tokens: int, params: LayoutParams) -> int:
    """Last tokens the layer trailer (end of the anchor stream) carries: ``lynx``: their residual nibbles
    (``recent_tokens``); KIVI: their bf16 values (``kivi_recent_tokens``, KIVI's full-precision residual)."""
    layout = scheme_layout(codec_name)
    return min(getattr(params, layout.trailer_field), num_tokens) if layout.trailer_bits_per_value else 0


def trailer_bytes(codec_name: str, num_tokens: int, num_heads: int, head_dim: int, params: LayoutParams) -> int:
    layout = scheme_layout(codec_name)
    return trailer_count(codec_name, num_tokens, params) * num_heads * head_dim * layout.trailer_bits_per_value // 8


def page_block_bytes(
    codec_name: str, page_tokens: int, num_heads: int, head_dim: int, kind: Kind, params: LayoutParams
) -> tuple[int, int]:
    """(anchor, residual) bytes of one page block that holds ``page_tokens`` tokens."""
    layout = scheme_layout(codec_name)
    values = page_tokens * num_heads * head_dim
    groups = num_groups(layout.grouping(kind), page_tokens, num_heads, head_dim, params, layout.token_group_field,
                        layout.chunk_field)
    anchor = (
        layout.page_meta_bytes_per_channel * num_heads * head_dim
        + groups * layout.group_meta_bytes
        + values * layout.anchor_bits // 8
    )
    residual = values * layout.residual_bits // 8
    if codec_name in ALIASES and not ALIASES[codec_name][1]:
        residual = 0
    return anchor, residual


def page_sizes(num_tokens: int, page_tokens: int) -> list[int]:
    """Tokens of each page: full pages, then the partial last page if any."""
    full, rest = divmod(num_tokens, page_tokens)
    return [page_tokens] * full + ([rest] if rest else [])


def stream_bytes(
    codec_name: str,
    num_tokens: int,
    num_heads: int,
    head_dim: int,
    kind: Kind,
    params: LayoutParams | None = None,
) -> tuple[int, int]:
    """(anchor, residual) bytes of one layer's encoded K or V; residual is 0 for one-stream schemes."""
    params = params or LayoutParams()
    check_shape(num_tokens, num_heads, head_dim, kind)
    anchor = header_bytes(codec_name, num_tokens, num_heads, head_dim, params)
    anchor += trailer_bytes(codec_name, num_tokens, num_heads, head_dim, params)
    residual = 0
    for tokens in page_sizes(num_tokens, params.page_tokens):
        page_anchor, page_residual = page_block_bytes(codec_name, tokens, num_heads, head_dim, kind, params)
        anchor += page_anchor
        residual += page_residual
    return anchor, residual


def bits_per_value(
    codec_name: str, num_tokens: int, num_heads: int, head_dim: int, params: LayoutParams | None = None
) -> tuple[float, float]:
    """Effective (anchor, residual) bits per value, payload + metadata, averaged over K and V."""
    values = 2 * num_tokens * num_heads * head_dim
    anchor = residual = 0
    for kind in ("k", "v"):
        a, r = stream_bytes(codec_name, num_tokens, num_heads, head_dim, kind, params)  # type: ignore[arg-type]
        anchor += a
        residual += r
    return 8 * anchor / values, 8 * residual / values


def residual_tail_bytes(codec_name: str, num_tokens: int, num_heads: int, head_dim: int,
                        params: LayoutParams | None = None) -> int:  # fmt: skip
    """Bytes at the end of one layer's residual stream that the wire leaves out because the layer trailer
    (end of the anchor stream) carries them (``wire_residual``): the trailer's size when the residual holds
    more than it, else 0 (a request of at most ``recent_tokens`` tokens sends its residual whole)."""
    params = params or LayoutParams()
    residual = stream_bytes(codec_name, num_tokens, num_heads, head_dim, "k", params)[1]
    tail = trailer_bytes(codec_name, num_tokens, num_heads, head_dim, params)
    return tail if 0 < tail < residual else 0


def wire_bits_per_value(
    codec_name: str, num_tokens: int, num_heads: int, head_dim: int, params: LayoutParams | None = None
) -> tuple[float, float]:
    """(anchor, residual) bits per value *on the wire*: :func:`bits_per_value` less the residual bytes the
    anchor's trailer already carries (``wire_residual``)."""
    anchor, residual = bits_per_value(codec_name, num_tokens, num_heads, head_dim, params)
    tail = residual_tail_bytes(codec_name, num_tokens, num_heads, head_dim, params)
    return anchor, residual - 8 * tail / (num_tokens * num_heads * head_dim)
