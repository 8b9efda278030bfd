"""KV codecs of sglang-lynx: pure torch (no sglang, no mooncake).

Entry points: ``registry.get_codec(name, **params)`` / ``codec_names()``; ``layout.stream_bytes`` (sizes
from shapes alone); ``request.encode_request`` / ``decode_request_into`` / ``upgrade_request_into``;
``page_reuse_encode.encode_with_cache``. The ``lynx`` byte format is specified in ``lynx_format``;
``lynx-exact``'s third (lossless) stream in ``lynx_exact`` (bins: ``exact_bins``; whole request: ``exact_request``;
read while it lands: ``exact_request_reader``).
"""

from .base import EncodedKV, KVCodec
from .layout import stream_bytes
from .registry import codec_names, get_codec

__all__ = ["EncodedKV", "KVCodec", "codec_names", "get_codec", "stream_bytes"]
