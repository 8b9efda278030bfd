"""The real bf16 ``lynx`` PD deployment with the test hooks, for the decode-side server tests.

Started once for the modules that use it (``test_lynx_bf16_lossless.py``, ``test_lynx_pd_speculative.py``),
bounded in time, and stopped right after the last test that uses it (``lynx_testlib.shared``): a pair
held for the whole session (~5 GB) made the fault matrix wait minutes for memory before each extra server.

The decode server runs with ``SGLANG_LYNX_TEST_HOOKS=1`` so that a request can ask, through
``sampling_params.custom_params``, for ``lynx_test_hold_residual_drafts = k`` (the residual counts as
landed only once k drafts exist or the draft window closed) or ``lynx_test_ignore_residual`` (never
landed: the late-residual policy). The model runs in its own dtype (bf16), the default of every
deployment a user runs.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from lynx_deployments import LYNX_CONFIG, start_lynx_pd

from lynx_testlib import shared


@pytest.fixture(scope="session")
def lynx_pd(model_path: str, deployment_logs: Path) -> Iterator[Any]:
    from pd_requests import pd_generate

    deployment = start_lynx_pd(model_path, deployment_logs / "pd-lynx-bf16-hooks", LYNX_CONFIG,
                               {"SGLANG_LYNX_TEST_HOOKS": "1"})
    try:
        pd_generate(deployment, {"text": "Hello", "sampling_params": {"max_new_tokens": 2, "temperature": 0.0}})
    except BaseException:
        deployment.stop()
        raise
    yield from shared("lynx_pd", deployment)
