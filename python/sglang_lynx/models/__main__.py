"""``python -m sglang_lynx.models {prepare,path,check} NAME`` and ``build-shape SHAPE``.

prepare  build (or confirm) the Hugging Face checkpoint of NAME and print its directory
path     print the directory the checkpoint lives in (whether or not it is prepared)
check    exit 1 and list the problems if the prepared checkpoint is missing or damaged
build-shape  build (or confirm) the small random checkpoint of SHAPE (llama3, qwen3, mistral or all:
             8 KV heads x head_dim 128, a few layers, the default model's tokenizer) and print its
             directory; ``path``/``check`` take its full name (``llama3-shape``...)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from sglang_lynx.models.catalog import DEFAULT_MODEL, MODELS, SHAPES, model_dir

SHAPE_ALIASES = {name.removesuffix("-shape"): name for name in SHAPES}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sglang_lynx.models", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["prepare", "path", "check", "build-shape"])
    parser.add_argument("name", nargs="?", default=DEFAULT_MODEL,
                        choices=sorted([*MODELS, *SHAPES, *SHAPE_ALIASES, "all"]))
    parser.add_argument("--cache-dir", type=Path, default=None,
                        help="cache root (default $SGLANG_LYNX_CACHE or ~/.cache/sglang-lynx)")
    parser.add_argument("--force", action="store_true", help="rebuild even if a valid checkpoint exists")
    args = parser.parse_args(argv)
    if args.command == "build-shape":
        return _build_shapes(args.name, args.cache_dir, args.force)
    if args.name == "all" or args.name in SHAPE_ALIASES:
        parser.error(f"{args.command} takes a model or full shape name ({', '.join(sorted([*MODELS, *SHAPES]))})")
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


def _build_shapes(name: str, cache_dir: Path | None, force: bool) -> int:
    from sglang_lynx.models.prepare import ModelPrepareError
    from sglang_lynx.models.shapes import build_shape

    names = sorted(SHAPES) if name == "all" else [SHAPE_ALIASES.get(name, name)]
    if any(n not in SHAPES for n in names):
        print(f"error: {name!r} is not a shape; shapes: {', '.join(sorted(SHAPE_ALIASES))}, all", file=sys.stderr)
        return 2
    try:
        for shape in names:
            print(build_shape(shape, root=cache_dir, force=force))
    except ModelPrepareError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
