"""Real Lynx PD deployments for the decode-side server tests: how they are started and configured."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from lynx_testlib import TEST_SERVER_ARGS, scoped_env, started

# the decode server runs SGLang's default (overlap) scheduler; NO_OVERLAP_ARGS is the other loop
DECODE_ARGS = ["--enable-metrics"]
NO_OVERLAP_ARGS = ["--disable-overlap-schedule"]
RESIDUAL_TIMEOUT_S = 20.0
# a loaded 2-core host can take minutes to prefill a batch: the bounds transfer_timeout_s sets (a decode's wait
# for staging, 4 x it at most, and a region held from the metadata through the prefill's forward; the prefill's
# wait for a send region) must not be what a test measures. (The decode's deadline for the streams runs from
# the prefill's success, and since 2026-12-07 no prefill-side bound counts a request's age.)
TRANSFER_TIMEOUT_S = 900.0
LYNX_CONFIG = json.dumps({"mode": "lynx", "residual_timeout_s": RESIDUAL_TIMEOUT_S,
                          "transfer_timeout_s": TRANSFER_TIMEOUT_S})
INT8_CONFIG = json.dumps({"mode": "lynx-int8", "transfer_timeout_s": TRANSFER_TIMEOUT_S})


def start_lynx_pd(model_path: str, log_dir: Path, config: str, env: dict[str, str] | None = None,
                  extra: list[str] | None = None) -> Any:
    """Start a PD pair with ``--lynx --lynx-config config`` (and ``extra``, e.g. ``NO_OVERLAP_ARGS``);
    ``env`` is set for the servers' start only."""
    from sglang_lynx.launch.deployment import PDDeployment

    deployment = PDDeployment(model_path, extra_args=[*TEST_SERVER_ARGS, *DECODE_ARGS, *(extra or []), "--lynx",
                                                      "--lynx-config", config], log_dir=log_dir)
    with scoped_env(env):
        return started(deployment)


UNPACED_GBPS = "9999"  # the pacer's ceiling (< 10,000 Gb/s): loopback timing
RATE_REREAD_S = 0.2  # TokenBucketPacer's default re-read interval


@contextlib.contextmanager
def paced(deployment: Any, gbps: str) -> Iterator[Any]:
    """Inside: ``deployment`` (``conftest.lynx_pd``) paces its Lynx streams at ``gbps``; unpaced again after."""
    rate_file: Path = deployment.lynx_rate_file
    rate_file.write_text(gbps)
    time.sleep(2 * RATE_REREAD_S)  # the next transfer re-reads the file
    try:
        yield deployment
    finally:
        rate_file.write_text(UNPACED_GBPS)
        time.sleep(2 * RATE_REREAD_S)
