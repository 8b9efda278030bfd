"""What the Lynx transport adds to SGLang's Mooncake bootstrap messages (pure; no sglang import).

SGLang's decode side sends the prefill side two ZMQ multipart messages: a *registration* (once per
decode engine rank: buffer pointers) and a *metadata* message per request (its KV slot indices).
Lynx appends one trailing frame to each, ``LYNX1`` + JSON:

- registration: ``{"session", "arena_addr", "arena_bytes", "control", "fingerprint"}`` — the decode's
  Lynx Mooncake session, its registered staging arena, its control endpoint, and the Lynx
  configuration it runs (prefill refuses a peer whose fingerprint differs: mismatched configs would
  otherwise corrupt silently);
- metadata: ``{"target": RemoteTarget.to_dict(), "tokens": T}`` — where this request's streams go,
  and how many tokens its KV holds (SGLang sends page indices; with ``--page-size`` > 1 the last
  page may be partial: ``transport.pages``).

SGLang's parsers read frames by position and ignore trailing ones, so an older peer is unaffected.
Everything parsed here is validated before use: peer metadata is never trusted for sizes or
addresses without checks.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sglang_lynx.config import LynxConfig

MAGIC = b"LYNX1"
DUMP_ENV = "SGLANG_LYNX_DEBUG_DUMP_DIR"  # tests only: both ends save the KV they sent / wrote
MAX_FIELD_BYTES = 16 << 10


@dataclass(frozen=True)
class TpRank:
    """Which tensor-parallel rank a Lynx side serves (each rank moves its own KV heads only)."""

    rank: int = 0
    size: int = 1

    @property
    def dump_tag(self) -> str:
        """Prefix of this rank's debug dump names after the role: '' at TP 1, ``r<rank>-`` above."""
        return f"r{self.rank}-" if self.size > 1 else ""


class LynxWireError(ValueError):
    """A Lynx frame from a peer is malformed."""


def config_fingerprint(config: LynxConfig) -> str:
    """What both ends must agree on for the bytes to mean the same thing."""
    params = config.codec_params()
    return f"{config.mode}|" + "|".join(f"{k}={params[k]}" for k in sorted(params))


def encode_field(data: dict[str, Any]) -> bytes:
    return MAGIC + json.dumps(data, sort_keys=True).encode()


def parse_field(msg: list[bytes]) -> dict[str, Any] | None:
    """The Lynx frame of a message, or None if the message carries none."""
    if not msg or not isinstance(msg[-1], (bytes, bytearray)) or not bytes(msg[-1]).startswith(MAGIC):
        return None
    raw = bytes(msg[-1])[len(MAGIC):]
    if len(raw) > MAX_FIELD_BYTES:
        raise LynxWireError(f"Lynx frame of {len(raw)} bytes exceeds {MAX_FIELD_BYTES}")
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise LynxWireError(f"Lynx frame is not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise LynxWireError("Lynx frame must be a JSON object")
    return data


def validate_registration(data: dict[str, Any]) -> dict[str, Any]:
    """Check a decode peer's registration frame; return it (raises LynxWireError)."""
    for key, kind in (("session", str), ("control", str), ("fingerprint", str), ("arena_addr", int),
                      ("arena_bytes", int)):
        value = data.get(key)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise LynxWireError(f"registration field {key!r}: expected {kind.__name__}, got {value!r}")
    if not 0 < data["arena_addr"] < 1 << 63:
        raise LynxWireError(f"registration field 'arena_addr': {data['arena_addr']} is not a valid address")
    if not 0 < data["arena_bytes"] < 1 << 48:
        raise LynxWireError(f"registration field 'arena_bytes': {data['arena_bytes']} is out of range")
    if not data["control"].startswith("tcp://"):
        raise LynxWireError(f"registration control endpoint {data['control']!r} is not tcp://host:port")
    return data


def dump_kv(name: str, k_layers: Any, v_layers: Any) -> None:
    """Save a request's K and V layers to ``$SGLANG_LYNX_DEBUG_DUMP_DIR/<name>.pt`` (tests only). The layers
    may be lazy (any iterable): nothing is read from them unless dumping is on."""
    directory = os.environ.get(DUMP_ENV)
    if not directory:
        return
    import torch

    Path(directory).mkdir(parents=True, exist_ok=True)
    torch.save({"k": [t.clone() for t in k_layers], "v": [t.clone() for t in v_layers]},
               Path(directory) / f"{name}.pt")
