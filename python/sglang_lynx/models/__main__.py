"""``python -m sglang_lynx.models {prepare,path,check} NAME``.

prepare  build (or confirm) the Hugging Face checkpoint of NAME and print its directory
path     print the directory the checkpoint lives in (whether or not it is prepared)
check    exit 1 and list the problems if the prepared checkpoint is missing or damaged
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from sglang_lynx.models.catalog import DEFAULT_MODEL, MODELS, model_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sglang_lynx.models", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["prepare", "path", "check"])
    parser.add_argument("name", nargs="?", default=DEFAULT_MODEL, choices=sorted(MODELS))
    parser.add_argument("--cache-dir", type=Path, default=None,
                        help="cache root (default $SGLANG_LYNX_CACHE or ~/.cache/sglang-lynx)")
    parser.add_argument("--force", action="store_true", help="rebuild even if a valid checkpoint exists")
    args = parser.parse_args(argv)
    if args.command == "path":
        print(model_dir(args.name, args.cache_dir))
        return 0
    from sglang_lynx.models.prepare import ModelPrepareError, check_checkpoint, prepare

    if args.command == "check":
        problems = check_checkpoint(model_dir(args.name, args.cache_dir))
        for problem in problems:
            print(f"problem: {problem}", file=sys.stderr)
        return 1 if problems else 0
    try:
        print(prepare(args.name, root=args.cache_dir, force=args.force))
    except ModelPrepareError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
