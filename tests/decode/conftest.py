"""The real bf16 ``lynx`` PD deployment with the test hooks, for the decode-side server tests.

Started once for the modules that use it (``test_lynx_bf16_lossless.py``, ``test_lynx_pd_speculative.py``),
bounded in time, and stopped right after the last test that uses it (``lynx_testlib.shared``): a pair
held for the whole session (~5 GB) made the fault matrix wait minutes for memory before each extra server.
``test_lynx_pd_speculative.py`` runs first (:func:`pytest_collection_modifyitems`), so the last user is the
bf16 module's paced comparison and the pair is gone before the ``lynx-exact`` module's two pairs start:
at most two pairs (~14 GB with their routers) are up at once, not three (~21.5 GB of 24), which leaves
room for the unit tiers that ``scripts/test.sh`` runs beside the server tier.

The pair also carries the link pacer, through a rate file (``SGLANG_LYNX_LINK_GBPS=@file``) that holds
``lynx_deployments.UNPACED_GBPS`` except inside ``lynx_deployments.paced`` (the bf16 module's
natural-timing test): one pair start less than a separate paced pair. At 9,999 Gb/s a page's bytes
take nanoseconds, so the other tests see loopback timing, as they did without the pacer.

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
from lynx_deployments import LYNX_CONFIG, UNPACED_GBPS, start_lynx_pd

from lynx_testlib import shared

HERE = Path(__file__).parent


@pytest.fixture(scope="session")
def lynx_pd(model_path: str, deployment_logs: Path) -> Iterator[Any]:
    from pd_requests import pd_generate

    log_dir = deployment_logs / "pd-lynx-bf16-hooks"
    rate_file = deployment_logs / "pd-lynx-bf16-hooks-link-gbps"
    rate_file.write_text(UNPACED_GBPS)
    deployment = start_lynx_pd(model_path, log_dir, LYNX_CONFIG,
                               {"SGLANG_LYNX_TEST_HOOKS": "1", "SGLANG_LYNX_LINK_GBPS": f"@{rate_file}"})
    deployment.lynx_rate_file = rate_file
    try:
        pd_generate(deployment, {"text": "Hello", "sampling_params": {"max_new_tokens": 2, "temperature": 0.0}})
    except BaseException:
        deployment.stop()
        raise
    yield from shared("lynx_pd", deployment)


FIRST_MODULE, BEFORE_MODULE = "test_lynx_pd_speculative.py", "test_lynx_bf16_lossless.py"


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    """Move the tests of :data:`FIRST_MODULE` (kept together, in their order) right before the first test of
    :data:`BEFORE_MODULE` when both are selected (the module docstring says why)."""
    moved = [item for item in items if item.path.name == FIRST_MODULE and item.path.parent == HERE]
    rest = [item for item in items if item not in moved]
    at = next((i for i, item in enumerate(rest) if item.path.name == BEFORE_MODULE and item.path.parent == HERE), None)
    if moved and at is not None:
        items[:] = rest[:at] + moved + rest[at:]
