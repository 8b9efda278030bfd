"""Make the repository root importable so `benchmark.accuracy` resolves (it is not an installed package)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from benchmark.accuracy.token_count import CharsPerTokenCounter, TokenCounter  # noqa: E402


@pytest.fixture
def counter() -> TokenCounter:
    return CharsPerTokenCounter()
