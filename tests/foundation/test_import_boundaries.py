"""The package boundaries DEVELOPERS.md promises, checked on the source (no import needed).

- only ``sglang_lynx.integration`` imports ``sglang``;
- only ``sglang_lynx/transfer/mooncake_engine.py`` imports ``mooncake``;
- the codec (and the pure decode math) imports neither, nor ``sglang_lynx.integration``.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "python" / "sglang_lynx"
KERNELS = Path(__file__).resolve().parents[2] / "kernels"


def _imported_roots(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def _sources() -> list[Path]:
    return sorted([*PACKAGE.rglob("*.py"), *KERNELS.rglob("*.py")])


def _imports(path: Path, root: str) -> bool:
    return any(n == root or n.startswith(root + ".") for n in _imported_roots(path))


def test_the_sources_are_found() -> None:
    assert len(_sources()) > 50


def test_only_integration_imports_sglang() -> None:
    offenders = [str(p.relative_to(PACKAGE.parent.parent)) for p in _sources()
                 if _imports(p, "sglang") and "integration" not in p.relative_to(PACKAGE.parent).parts[:2]]
    assert offenders == []


def test_only_the_engine_wrapper_imports_mooncake() -> None:
    importers = [p for p in _sources() if _imports(p, "mooncake")]
    assert [p.relative_to(PACKAGE) for p in importers] == [Path("transfer/mooncake_engine.py")]


def test_codec_and_decode_math_import_neither_sglang_nor_mooncake_nor_integration() -> None:
    for sub in ("codec", "decode"):
        for path in (PACKAGE / sub).rglob("*.py"):
            for root in ("sglang", "mooncake", "sglang_lynx.integration", "sglang_lynx.transfer"):
                assert not _imports(path, root), f"{path.relative_to(PACKAGE)} imports {root}"
