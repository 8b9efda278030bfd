"""JSON-lines results files: the one reader the benchmark areas share."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_jsonl(path: Path, missing_ok: bool = False) -> list[dict[str, Any]]:
    """Every JSON line of ``path`` (blank lines skipped); a bad line raises ``ValueError`` naming
    ``path:line``. A missing file is ``[]`` with ``missing_ok``, else ``FileNotFoundError``."""
    if missing_ok and not path.exists():
        return []
    lines = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if line.strip():
            try:
                lines.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{number}: not a JSON line ({exc})") from exc
    return lines
