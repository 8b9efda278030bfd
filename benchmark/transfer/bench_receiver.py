"""Receiver side of bench_streams.py: a Mooncake engine with one registered staging arena.

Run (possibly inside a namespace): ``python bench_receiver.py HOST ARENA_BYTES``. Prints one JSON
line {"session_id", "arena_addr", "arena_bytes"}; then ``crc OFFSET LENGTH`` lines on stdin are answered
with the crc32 of that arena slice, and ``exit`` (or EOF) ends it.
"""

from __future__ import annotations

import ctypes
import json
import sys

from sglang_lynx.transfer.mooncake_engine import MooncakeEngine
from sglang_lynx.transfer.streams import checksum_at


def main() -> None:
    host, arena_bytes = sys.argv[1], int(sys.argv[2])
    engine = MooncakeEngine.start(host)
    arena = (ctypes.c_char * arena_bytes)()
    base = ctypes.addressof(arena)
    engine.register(base, arena_bytes)
    print(json.dumps({"session_id": engine.session_id, "arena_addr": base, "arena_bytes": arena_bytes}),
          flush=True)
    for line in sys.stdin:
        parts = line.split()
        if not parts or parts[0] == "exit":
            break
        if parts[0] == "crc":
            print(checksum_at(base + int(parts[1]), int(parts[2])), flush=True)
    engine.close()


if __name__ == "__main__":
    main()
