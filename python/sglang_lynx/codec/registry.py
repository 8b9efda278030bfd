"""Name -> codec registry. ``get_codec(name, **params)`` builds a stateless, reusable codec.

Params are ``sglang_lynx.config.LynxConfig`` fields: ``page_tokens``, ``chunk_tokens``,
``group_size``, ``sink_tokens``, ``value_group_size``, ``key_chunk_tokens`` and ``recent_tokens``
(layout; the last three are lynx's only) and ``alpha`` (companding of ``lynx`` and ``lynx-paper``;
``lynx-paper`` defaults to the paper's alpha = 3 when none is given, ``lynx`` to 0). Other
``LynxConfig`` fields are accepted and ignored, so ``get_codec(cfg.codec_name, **asdict(cfg))`` works.
Unknown names raise ``ValueError`` listing the valid ones.
"""

from __future__ import annotations

from typing import Any

from .base import KVCodec
from .baselines import Bf16Codec, Int4Codec, Int8Codec, KiviInt2Codec, KiviInt4Codec
from .layout import LayoutParams
from .lynx_codec import LynxCodec, LynxExactCodec, LynxInt4Codec, LynxInt8Codec
from .lynx_paper import LynxPaperCodec

CODECS: dict[str, type[KVCodec]] = {
    "bf16": Bf16Codec,
    "int8": Int8Codec,
    "int4": Int4Codec,
    "kivi-int4": KiviInt4Codec,
    "kivi-int2": KiviInt2Codec,
    "lynx-paper": LynxPaperCodec,
    "lynx": LynxCodec,
    "lynx-int4": LynxInt4Codec,
    "lynx-int8": LynxInt8Codec,
    "lynx-exact": LynxExactCodec,
}
LAYOUT_FIELDS = ("page_tokens", "chunk_tokens", "group_size", "sink_tokens", "value_group_size", "key_chunk_tokens",
                 "recent_tokens", "kivi_recent_tokens")
ALPHA_CODECS = ("lynx", "lynx-int4", "lynx-int8", "lynx-paper", "lynx-exact")


def codec_names() -> list[str]:
    return list(CODECS)


def get_codec(name: str, **params: Any) -> KVCodec:
    if name not in CODECS:
        raise ValueError(f"unknown codec {name!r}; valid codecs: {', '.join(CODECS)}")
    layout = LayoutParams(**{key: params[key] for key in LAYOUT_FIELDS if key in params})
    extra: dict[str, Any] = {}
    if name in ALPHA_CODECS and "alpha" in params:
        extra["alpha"] = float(params["alpha"])
    return CODECS[name](layout, **extra)
