"""Validated configuration of a Lynx deployment (``--lynx-config``).

The configuration is a frozen dataclass built from JSON text, a JSON file, or keyword arguments.
Every field is validated on construction; an error names the field, the bad value and what is
allowed, so a typo in ``--lynx-config`` fails at start-up rather than mid-request.

The configuration travels from ``launch_server`` to every SGLang subprocess as JSON in the
environment variable ``LYNX_CONFIG_ENV`` (SGLang rebuilds its ``ServerArgs`` from its own dataclass
fields only, so extra flags do not survive the trip on their own).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

LYNX_CONFIG_ENV = "SGLANG_LYNX_CONFIG"

#: Every transfer mode, in order of bytes on the wire. ``lynx`` is progressive (anchor + residual
#: streams with speculative decoding); the others move one stream (``lynx-int8`` two, without
#: speculation). ``lynx-exact`` adds a third, lossless stream to ``lynx``: the verify then runs on the
#: prefill's BF16 KV restored bit for bit, so its output is stock BF16 PD's.
MODES: tuple[str, ...] = (
    "bf16",
    "int8",
    "int4",
    "kivi-int4",
    "kivi-int2",
    "lynx-paper",
    "lynx-int4",
    "lynx-int8",
    "lynx",
    "lynx-exact",
)

FALLBACK_POLICIES: tuple[str, ...] = ("recompute", "fail")
# as sglang_lynx.integration.decode.row_gemm.POLICIES
VERIFY_GEMM_POLICIES: tuple[str, ...] = ("rows", "split", "batched")
VERIFY_ATTENTION_POLICIES: tuple[str, ...] = ("kernel", "per-input")
AUTO = "auto"  # an arena size derived from the model, the mode and the KV pool
MAX_ARENA_MB = 1 << 20  # 1 TiB
MAX_RECENT_TOKENS = 1 << 20  # as sglang_lynx.codec.layout.MAX_RECENT_TOKENS (the config imports no codec)


class LynxConfigError(ValueError):
    """A ``--lynx-config`` value is malformed; the message names the field."""


@dataclass(frozen=True)
class LynxConfig:
    """Every knob of Lynx, with its default.

    Invariants (checked in ``__post_init__``): ``mode`` is one of :data:`MODES`; token counts are
    positive powers of two with ``chunk_tokens`` dividing ``page_tokens``; ``alpha >= 0``;
    ``1 <= max_draft_tokens <= 256``; timeouts are positive and finite; arena sizes are ``"auto"``
    or a positive number of MiB (whether one fits the model is checked when the KV pool exists:
    ``transfer/arena_size.py``).
    """

    mode: str = "lynx"
    # --- codec ---
    page_tokens: int = 256  # P: page-level min/scale normalisation span
    chunk_tokens: int = 32  # C: per-channel key chunk of the KIVI / lynx-paper baselines
    alpha: float = 0.0  # companding strength (0 = linear); chosen by measurement, see BENCHMARKS.md
    group_size: int = 64  # group of int8/int4 baselines
    value_group_size: int = 64  # lynx: head dims per value group (chosen by measurement, BENCHMARKS.md)
    key_chunk_tokens: int = 64  # lynx: tokens per key chunk, capped at page_tokens (measured, BENCHMARKS.md)
    sink_tokens: int = 1  # leading tokens of a request kept exact (attention sink)
    recent_tokens: int = 48  # lynx: last tokens whose residual also rides in the anchor (measured, BENCHMARKS.md)
    kivi_recent_tokens: int = 0  # kivi-int4/-int2: KIVI's residual length R, last R tokens sent in bf16 (0 = off)
    # --- streams ---
    residual_chunk_bytes: int = 4 << 20  # residual goes in chunks of this size ...
    residual_window: int = 2  # ... with at most this many in flight
    transfer_timeout_s: float = 60.0  # a stream that has not landed by then fails
    # --- prefill ---
    prefill_page_cache_mb: int = 256  # encoded pages of radix-cached prefixes kept for reuse (0: off)
    # a chunked prefill's pages are encoded and sent chunk by chunk while the later chunks are computed
    # (integration/transport/prefill_stream.py); False: the whole request after its last chunk
    stream_prefill: bool = True
    # ... and, within each chunk, every this many layers as soon as the forward has written them, so the
    # first layers' anchor is on the wire while the last ones are computed (0: per chunk only). CPU KV
    # pools; a layered request is encoded as it is computed, without the encoded-page cache
    # (integration/transport/prefill_layers.py; measured: benchmark/serving/results/ttkt-layers; the
    # group size swept in ttkt-group-sweep*: 1 gave the earliest tokens)
    stream_layer_group: int = 1
    # ... and a forward that computes the request's last token and more than one SGLang page of it sends
    # each group's partial last page and trailers with the group, not after the forward (false: after it,
    # as before 2026-12-06; integration/transport/prefill_layers.py, LayerGroups._pages_to_queue)
    stream_last_page: bool = True
    # --- staging arenas (MiB, or "auto"; see transfer/arena_size.py) ---
    # "auto": the streams of the server's whole KV pool in this mode (every request in flight fits),
    # capped at arena_cap_mb; an explicit size is used as given. Either must hold one max-context
    # request's streams, checked at start-up. A request that does not fit right now waits (FIFO).
    send_arena_mb: int | str = "auto"  # prefill: encoded streams until the decode has them
    receive_arena_mb: int | str = "auto"  # decode: streams until they are dequantized into the pool
    arena_cap_mb: int = 2048  # upper bound of an "auto" arena (memory the arena may take)
    # decode, lynx-exact: private BF16 KV (16 bits per value, on the pool's device) of requests restored
    # while their streams land (integration/transport/exact_prefetch.py); a request beyond it is restored
    # once its streams landed (0: never ahead)
    exact_prefetch_mb: int = 1024
    # lynx-exact: threads that code the exact-stream pieces of one part at once, on the prefill (encode) and
    # on the decode (restore); 0: automatic, a quarter of this host's cores, 1 to 8 (1 on this 2-core CI
    # host). The bytes are the same for any count (codec/exact_request.py, PieceRunner)
    exact_threads: int = 0
    # --- speculative decoding ---
    max_draft_tokens: int = 64
    residual_timeout_s: float = 30.0  # after the anchor lands, how long to wait for the residual
    fallback: str = "recompute"  # residual failed or late: recompute the prefix, or fail the request
    # greedy verify stops at a target top-2 logit margin <= this (where the verify and decode kernels
    # round differently); < 0: automatic (0 where the verify is computed like decode), see
    # decode/speculative.py auto_tie_margin()
    verify_tie_margin: float = -1.0
    # how the verify's GEMMs treat its n rows: "rows" = one pass over each weight for all rows, each
    # rounded exactly as a 1-row GEMM (a kernel checked against this host's 1-row GEMM; "split" where the
    # check fails or it is not built); "split" = one 1-row GEMM per row (both: every row as a decode
    # step computes it, lossless in bf16); "batched" = one n-row GEMM (bf16 output may then differ from
    # lynx-int8's). See integration/decode/row_gemm.py.
    verify_gemm: str = "rows"
    # how the verify's attention (SGLang's CPU backend) treats its n inputs: "kernel" = one pass over the
    # row's K/V for all inputs by a C kernel that computes each input's SDPA call bit for bit (checked at
    # start-up and per shape; "per-input" where a check fails or it is not built); "per-input" = one SDPA
    # call per input, as a decode step makes it. Both lossless. See integration/decode/attention_kernel.py.
    verify_attention: str = "kernel"
    # a greedy verify runs in passes of this many inputs, then twice as many each pass, and stops at
    # the first pass that rejects a draft (the rows after it would be thrown away); 0: one pass over
    # every draft. Each row computes as in the one pass, so the outcome is the same; see decode/commit.py
    verify_first_pass: int = 4
    # when every draft may be accepted, the verify computes one more row (the last draft as input, in a
    # KV slot allocated as SGLang's next decode step would) and releases the token after the last draft
    # too: one token a decode step earlier per fully accepted window. See integration/decode/bonus_slot.py
    verify_bonus_token: bool = True

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise LynxConfigError(f"mode: {self.mode!r} is not a Lynx mode; valid modes: {', '.join(MODES)}")
        for name in ("page_tokens", "chunk_tokens", "group_size", "value_group_size", "key_chunk_tokens"):
            _require_pow2(name, getattr(self, name))
        if self.page_tokens % self.chunk_tokens:
            raise LynxConfigError(
                f"chunk_tokens: {self.chunk_tokens} must divide page_tokens ({self.page_tokens})"
            )
        _require_int("sink_tokens", self.sink_tokens, lo=0, hi=self.page_tokens)
        _require_int("recent_tokens", self.recent_tokens, lo=0, hi=MAX_RECENT_TOKENS)
        _require_int("kivi_recent_tokens", self.kivi_recent_tokens, lo=0, hi=MAX_RECENT_TOKENS)
        _require_int("residual_chunk_bytes", self.residual_chunk_bytes, lo=4096, hi=1 << 30)
        _require_int("residual_window", self.residual_window, lo=1, hi=64)
        _require_int("prefill_page_cache_mb", self.prefill_page_cache_mb, lo=0, hi=1 << 20)
        _require_int("exact_prefetch_mb", self.exact_prefetch_mb, lo=0, hi=1 << 20)
        for name in ("stream_prefill", "stream_last_page", "verify_bonus_token"):
            if not isinstance(getattr(self, name), bool):
                raise LynxConfigError(f"{name}: expected true or false, got {getattr(self, name)!r}")
        _require_int("stream_layer_group", self.stream_layer_group, lo=0, hi=4096)
        _require_int("exact_threads", self.exact_threads, lo=0, hi=256)
        for name in ("send_arena_mb", "receive_arena_mb"):
            value = getattr(self, name)
            if value != AUTO and (isinstance(value, bool) or not isinstance(value, int)):
                raise LynxConfigError(f"{name}: expected an integer (MiB) or {AUTO!r}, got {value!r}")
            if value != AUTO:
                _require_int(name, value, lo=1, hi=MAX_ARENA_MB)
        _require_int("arena_cap_mb", self.arena_cap_mb, lo=1, hi=MAX_ARENA_MB)
        _require_int("max_draft_tokens", self.max_draft_tokens, lo=1, hi=256)
        _require_float("alpha", self.alpha, lo=0.0, hi=1e6)
        _require_float("transfer_timeout_s", self.transfer_timeout_s, lo=1e-3, hi=3600.0)
        _require_float("residual_timeout_s", self.residual_timeout_s, lo=1e-3, hi=3600.0)
        if self.exact and self.alpha != 0.0:
            raise LynxConfigError(
                f"alpha: mode 'lynx-exact' needs alpha 0 (its exact stream enumerates the bins of the linear "
                f"code), got {self.alpha}"
            )
        if self.verify_tie_margin != -1.0:
            _require_float("verify_tie_margin", self.verify_tie_margin, lo=0.0, hi=1000.0)
        if self.verify_gemm not in VERIFY_GEMM_POLICIES:
            raise LynxConfigError(
                f"verify_gemm: {self.verify_gemm!r} is not a policy; valid: {', '.join(VERIFY_GEMM_POLICIES)}"
            )
        if self.verify_attention not in VERIFY_ATTENTION_POLICIES:
            raise LynxConfigError(f"verify_attention: {self.verify_attention!r} is not a policy; valid: "
                                  f"{', '.join(VERIFY_ATTENTION_POLICIES)}")
        _require_int("verify_first_pass", self.verify_first_pass, lo=0, hi=256)
        if self.fallback not in FALLBACK_POLICIES:
            raise LynxConfigError(
                f"fallback: {self.fallback!r} is not a policy; valid: {', '.join(FALLBACK_POLICIES)}"
            )

    # ----- derived facts -----
    @property
    def progressive(self) -> bool:
        """True when the mode drafts on the anchor and verifies once the rest landed (``lynx``, ``lynx-exact``)."""
        return self.mode in ("lynx", "lynx-exact")

    @property
    def exact(self) -> bool:
        """True when the mode also sends the lossless third stream (``lynx-exact``; BF16 KV pools only)."""
        return self.mode == "lynx-exact"

    def exact_thread_count(self, cpus: int | None = None) -> int:
        """``exact_threads``, with 0 resolved for a host of ``cpus`` cores (default: this one's)."""
        if self.exact_threads:
            return self.exact_threads
        return max(1, min(8, (cpus if cpus is not None else os.cpu_count() or 1) // 4))

    @property
    def codec_name(self) -> str:
        """Name of the codec in the codec registry that this mode puts on the wire (the mode itself:
        ``lynx-int4`` is the lynx anchor alone, ``lynx-int8`` anchor + residual without speculation)."""
        return self.mode

    def codec_params(self) -> dict[str, Any]:
        """Keyword arguments for ``sglang_lynx.codec.registry.get_codec``."""
        fields = (
            "page_tokens", "chunk_tokens", "alpha", "group_size", "value_group_size", "key_chunk_tokens", "sink_tokens",
            "recent_tokens", "kivi_recent_tokens",
        )  # fmt: skip
        return {k: getattr(self, k) for k in fields}

    # ----- (de)serialisation -----
    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LynxConfig:
        if not isinstance(data, dict):
            raise LynxConfigError(f"--lynx-config must be a JSON object, got {type(data).__name__}")
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(data) - set(known))
        if unknown:
            raise LynxConfigError(
                f"unknown field(s) {', '.join(unknown)}; valid fields: {', '.join(sorted(known))}"
            )
        coerced: dict[str, Any] = {}
        for name, value in data.items():
            coerced[name] = _coerce(name, value, known[name].type)
        return cls(**coerced)

    @classmethod
    def parse(cls, text: str | None) -> LynxConfig:
        """Build from ``--lynx-config``: JSON text, a path to a JSON file, a bare mode name, or None."""
        if text is None or text.strip() == "":
            return cls()
        stripped = text.strip()
        if stripped in MODES:
            return cls(mode=stripped)
        if not stripped.startswith("{"):
            path = Path(stripped)
            if not path.is_file():
                raise LynxConfigError(
                    f"--lynx-config: {text!r} is neither a JSON object, a mode ({', '.join(MODES)}), "
                    "nor an existing file"
                )
            stripped = path.read_text()
        try:
            data = json.loads(stripped)
        except json.JSONDecodeError as exc:
            raise LynxConfigError(f"--lynx-config is not valid JSON: {exc}") from None
        return cls.from_dict(data)

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> LynxConfig | None:
        """The configuration published for this process tree, or None when Lynx is off."""
        env = os.environ if environ is None else environ
        text = env.get(LYNX_CONFIG_ENV)
        return None if text is None else cls.parse(text)

    def publish(self, environ: Any = None) -> None:
        """Make this configuration reach every subprocess started after this call."""
        (os.environ if environ is None else environ)[LYNX_CONFIG_ENV] = self.to_json()


def _coerce(name: str, value: Any, annotation: Any) -> Any:
    kind = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", str(annotation))
    if kind == "int":
        if isinstance(value, bool) or not isinstance(value, int):
            raise LynxConfigError(f"{name}: expected an integer, got {value!r}")
        return value
    if kind == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise LynxConfigError(f"{name}: expected a number, got {value!r}")
        return float(value)
    if kind == "int | str":  # a size or "auto"
        if value == AUTO:
            return value
        if isinstance(value, bool) or not isinstance(value, int):
            raise LynxConfigError(f"{name}: expected an integer (MiB) or {AUTO!r}, got {value!r}")
        return value
    if kind == "str":
        if not isinstance(value, str):
            raise LynxConfigError(f"{name}: expected a string, got {value!r}")
        return value
    return value


def _require_int(name: str, value: Any, *, lo: int, hi: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise LynxConfigError(f"{name}: expected an integer, got {value!r}")
    if not lo <= value <= hi:
        raise LynxConfigError(f"{name}: {value} is out of range [{lo}, {hi}]")


def _require_pow2(name: str, value: Any) -> None:
    _require_int(name, value, lo=1, hi=1 << 20)
    if value & (value - 1):
        raise LynxConfigError(f"{name}: {value} must be a power of two")


def _require_float(name: str, value: Any, *, lo: float, hi: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise LynxConfigError(f"{name}: expected a number, got {value!r}")
    if not math.isfinite(value) or not lo <= value <= hi:
        raise LynxConfigError(f"{name}: {value} is out of range [{lo}, {hi}]")
