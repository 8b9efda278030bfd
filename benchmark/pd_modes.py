"""One real PD deployment per Lynx mode, one at a time, for the per-mode benchmarks.

``for_each_mode(modes, job, ...)`` starts the project's PD deployment (prefill + decode over
Mooncake + sglang_router, ``python/sglang_lynx/launch/deployment.py``) with ``--lynx --lynx-config
MODE`` on SGLang's default (overlap) scheduler, as a serving team runs it (every mode the same,
so that all are comparable, as in bench_ttkt.py), calls ``job(mode, deployment)``, and stops the
deployment before the next mode. ``raw`` means a plain SGLang PD deployment (no ``--lynx``). A mode
whose deployment does not start (or whose job raises) is recorded in ``failures`` with the reason and
skipped; every start is bounded by ``start_timeout_s``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]


def stop_on_sigterm() -> None:
    """Make SIGTERM (``timeout``, a CI runner) unwind like Ctrl-C, so the run's ``with`` blocks tear down its
    deployments and its shaped link (network namespace, veth) instead of leaving them behind."""

    def _raise(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, _raise)
ALL_MODES = ("bf16", "int8", "int4", "kivi-int4", "kivi-int2", "lynx-int4", "lynx-int8", "lynx")
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
CHILD_ENV = {**OFFLINE_ENV, "PYTHONUNBUFFERED": "1"}  # unbuffered: a killed run's log still shows how far it got


#: Benchmark-only variants of a mode, ``MODE~VARIANT``: the mode with one setting changed, to measure
#: what that setting buys in the same run (e.g. ``lynx~buffered``: the KV of a chunked prefill sent
#: after its last chunk, as before streaming; ``lynx~layers``: each group of 5 layers queued as soon as the
#: prefill's forward has written it, ``integration/transport/prefill_layers.py``, the default from 2026-12-05
#: until the sweep made it 1; ``lynx~chunks``: per chunk only, as before; ``lynx~layers=N``: groups of N
#: layers, for a sweep; ``lynx-exact~noahead``: the exact KV restored only once every stream landed, as
#: before the decode restored it while the parts land, ``integration/transport/exact_prefetch.py``;
#: ``lynx~nobonus``: no bonus row in the verify, ``integration/decode/bonus_slot.py``; ``lynx~resw1``: one
#: residual chunk in flight instead of two, ``lynx~res64k``: residual chunks of 64 KiB, so an anchor waits
#: behind less residual, ``transfer/scheduler.py`` rule 2; ``lynx~lastpart``: the partial last page and the
#: trailers after the forward, as before ``stream_last_page``).
VARIANTS: dict[str, dict[str, Any]] = {"buffered": {"stream_prefill": False},
                                       "smallres": {"residual_chunk_bytes": 1 << 20},
                                       "layers": {"stream_layer_group": 5},
                                       "chunks": {"stream_layer_group": 0},
                                       "noahead": {"exact_prefetch_mb": 0},
                                       "nobonus": {"verify_bonus_token": False},
                                       "resw1": {"residual_window": 1},
                                       "res64k": {"residual_chunk_bytes": 64 << 10},
                                       "lastpart": {"stream_last_page": False}}
#: Variants that change a server argument instead of the Lynx configuration, for any mode (``raw`` too):
#: ``raw~no-overlap`` is stock SGLang PD on its non-overlap scheduler.
SERVER_VARIANTS: dict[str, list[str]] = {"no-overlap": ["--disable-overlap-schedule"]}


def lynx_config(mode: str) -> dict[str, Any]:
    """The Lynx configuration of a benchmark mode (a mode name, or ``MODE~VARIANT``) as ``LynxConfig`` fields."""
    base, _, variant = mode.partition("~")
    if not variant or variant in SERVER_VARIANTS:
        return {"mode": base}
    name, _, value = variant.partition("=")
    if name == "layers" and value:
        if not value.isdigit():
            raise ValueError(f"{mode!r}: layers=N takes a layer count, got {value!r}")
        return {"mode": base, "stream_layer_group": int(value)}
    if variant not in VARIANTS:
        raise ValueError(f"{mode!r}: unknown variant {variant!r}; known: {', '.join(VARIANTS)}, layers=N")
    return {"mode": base, **VARIANTS[variant]}


def lynx_config_arg(mode: str) -> str:
    """The ``--lynx-config`` value of a benchmark mode: the mode name, or its configuration as JSON."""
    config = lynx_config(mode)
    return config["mode"] if len(config) == 1 else json.dumps(config)


def mode_server_args(mode: str, extra: list[str] | None = None) -> list[str]:
    base, _, variant = mode.partition("~")
    args = [*(extra or []), *SERVER_VARIANTS.get(variant, [])]
    if base == "raw":
        if variant and variant not in SERVER_VARIANTS:
            raise ValueError(f"{mode!r}: raw takes only server variants ({', '.join(SERVER_VARIANTS)})")
        return args
    return [*args, "--lynx", "--lynx-config", lynx_config_arg(mode)]


@dataclass
class ModeRuns:
    """What happened per mode: the job's return value, or why the mode was skipped."""

    results: dict[str, Any] = field(default_factory=dict)
    failures: dict[str, str] = field(default_factory=dict)
    start_seconds: dict[str, float] = field(default_factory=dict)


def for_each_mode(modes: list[str], job: Callable[[str, Any], Any], *, model_path: str, log_dir: Path,
                  start_timeout_s: float = 900.0, extra_server_args: list[str] | None = None,
                  link_gbps: float | None = None, link: Any = None) -> ModeRuns:
    """``link_gbps``: the application pacer's rate (Lynx streams only); ``link``: an open shaped link
    (``launch.links.open_deployment_link``) whose far side every deployment's prefill runs behind."""
    from sglang_lynx.launch.deployment import PDDeployment
    from sglang_lynx.launch.processes import ServerStartError

    os.environ.update(OFFLINE_ENV)
    if link_gbps:
        os.environ["SGLANG_LYNX_LINK_GBPS"] = str(link_gbps)
    runs = ModeRuns()
    for mode in modes:
        print(f"[{mode}] starting the PD deployment (bounded: {start_timeout_s:.0f} s)", flush=True)
        try:
            with PDDeployment(model_path, extra_args=mode_server_args(mode, extra_server_args),
                              log_dir=log_dir / mode) as dep:
                if link is not None:
                    from sglang_lynx.launch.links import place_on_link

                    place_on_link(dep, link)
                runs.start_seconds[mode] = round(dep.start(timeout_s=start_timeout_s), 1)
                print(f"[{mode}] deployment up in {runs.start_seconds[mode]:.0f} s at {dep.url}", flush=True)
                runs.results[mode] = job(mode, dep)
        except ServerStartError as exc:
            runs.failures[mode] = f"deployment failed to start: {str(exc)[:800]}"
        except (OSError, RuntimeError, ValueError, subprocess.SubprocessError) as exc:
            runs.failures[mode] = f"{type(exc).__name__}: {str(exc)[:800]}"
        if mode in runs.failures:
            print(f"[{mode}] skipped: {runs.failures[mode][:300]}", flush=True)
    return runs


def run_bounded(argv: list[str], timeout_s: float, log_path: Path, env: dict[str, str] | None = None) -> int:
    """Run ``argv`` (own process group, output to ``log_path``); kill the group after ``timeout_s``.

    Returns the exit code, or -9 when it had to be killed."""
    import signal

    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("ab") as log:
        log.write(f"\n=== {time.strftime('%H:%M:%S')} {' '.join(argv)}\n".encode())
        log.flush()
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                cwd=REPO_ROOT, env={**os.environ, **CHILD_ENV, **(env or {})},
                                start_new_session=True)
        try:
            return proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
            log.write(f"\n=== killed after {timeout_s:.0f} s\n".encode())
            return -9


def default_model_path() -> str:
    from sglang_lynx.models.prepare import prepare

    return str(prepare("smollm2-135m"))
