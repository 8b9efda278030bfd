"""Write (or remove) the ``.pth`` file that runs ``cpu_boot.boot()`` in every interpreter.

``python -m sglang_lynx.platform.install_shim [--remove]``; idempotent. The line is guarded so a
broken or uninstalled sglang_lynx never stops Python from starting.
"""

from __future__ import annotations

import argparse
import sys
import sysconfig
from pathlib import Path

PTH_NAME = "sglang_lynx_cpu_boot.pth"
PTH_LINE = (
    "import os; exec(\"try:\\n from sglang_lynx.platform.cpu_boot import boot; boot()\\n"
    "except Exception as e:\\n os.environ.get('SGLANG_LYNX_DEBUG') and print('sglang-lynx boot:', e)\")\n"
)


def pth_path() -> Path:
    return Path(sysconfig.get_paths()["purelib"]) / PTH_NAME


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--remove", action="store_true")
    args = parser.parse_args(argv)
    path = pth_path()
    if args.remove:
        path.unlink(missing_ok=True)
        print(f"removed {path}")
        return 0
    if not path.exists() or path.read_text() != PTH_LINE:
        path.write_text(PTH_LINE)
    print(f"CPU boot shim: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
