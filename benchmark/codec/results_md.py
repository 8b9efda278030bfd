"""Keep ``RESULTS.md`` as marked sections, each rewritten by the script that owns it."""

from __future__ import annotations

from pathlib import Path

HEADER = "# Codec measurements\n\nWritten by the scripts in benchmark/codec/; each section names its command.\n"


def replace_section(path: Path, name: str, body: str) -> None:
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    text = path.read_text() if path.exists() else HEADER
    block = f"{start}\n{body.rstrip()}\n{end}"
    if start in text and end in text:
        before, rest = text.split(start, 1)
        after = rest.split(end, 1)[1]
        text = before + block + after
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    path.write_text(text)
