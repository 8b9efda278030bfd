"""The ``sglang.srt.plugins`` entry point of sglang-lynx.

Lifecycle. SGLang calls :func:`load_plugin` in every process it starts (the launcher before it
parses arguments, then each scheduler, detokenizer and engine process), and applies the
registered hooks right after. In the launcher process the hooks on ``ServerArgs`` add
``--lynx`` / ``--lynx-config`` to the command line and validate them; the validated
configuration is published as JSON in the environment (``SGLANG_LYNX_CONFIG``), which every
child inherits, so a child's :func:`load_plugin` sees it and installs the Lynx runtime hooks
(transport, decode) for the configured mode. On a CPU host the CPU hooks are installed in every
process, with or without ``--lynx``.

A mode whose machinery is not in this build fails at start-up with a message that says so.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
from typing import Any

from sglang_lynx.config import LYNX_CONFIG_ENV, MODES, LynxConfig, LynxConfigError
from sglang_lynx.integration.cpu_host import install_cpu_host_hooks
from sglang_lynx.integration.hook_targets import register
from sglang_lynx.integration.runtime import install_runtime, missing_machinery

logger = logging.getLogger("sglang_lynx")

PD_TRANSFER_BACKENDS = ("mooncake", "mooncake_tcp")


def _add_lynx_cli_args(result: Any, parser: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> None:
    if any("--lynx" in action.option_strings for action in parser._actions):
        return
    group = parser.add_argument_group("Lynx (sglang-lynx): progressive speculative KV transfer")
    group.add_argument(
        "--lynx",
        action="store_true",
        default=False,
        help="Move the KV cache of PD requests with Lynx (see --lynx-config).",
    )
    group.add_argument(
        "--lynx-config",
        type=str,
        default=None,
        help=(
            "Lynx configuration: a JSON object, a path to a JSON file, or a bare mode name. "
            f"Modes: {', '.join(MODES)}. Fields: {', '.join(f.name for f in dataclasses.fields(LynxConfig))}."
        ),
    )


def lynx_config_from_namespace(args: argparse.Namespace) -> LynxConfig | None:
    """The validated configuration asked for on the command line, or None without ``--lynx``."""
    enabled = bool(getattr(args, "lynx", False))
    text = getattr(args, "lynx_config", None)
    if not enabled:
        if text is not None:
            raise LynxConfigError("--lynx-config was given without --lynx")
        return None
    return LynxConfig.parse(text)


def check_deployment(config: LynxConfig, server_args: Any) -> None:
    """Refuse combinations that cannot work, with a message that names the flag."""
    mode = getattr(server_args, "disaggregation_mode", "null")
    backend = getattr(server_args, "disaggregation_transfer_backend", "mooncake")
    if mode in ("prefill", "decode") and backend not in PD_TRANSFER_BACKENDS:
        raise LynxConfigError(
            f"--lynx needs --disaggregation-transfer-backend {' or '.join(PD_TRANSFER_BACKENDS)}, got {backend!r}"
        )
    page_size = getattr(server_args, "page_size", None) or 1
    missing = missing_machinery(config, mode, page_size)
    if missing:
        raise LynxConfigError(f"mode {config.mode!r} is not implemented yet in this build: {missing}")


def _after_from_cli_args(server_args: Any, cls: Any, args: argparse.Namespace, *rest: Any, **kw: Any) -> None:
    try:
        config = lynx_config_from_namespace(args)
        if config is not None:
            check_deployment(config, server_args)
    except LynxConfigError as exc:
        raise SystemExit(f"sglang-lynx: {exc}") from None
    if config is not None:
        config.publish()
        logger.info("sglang-lynx: %s published in %s", config.to_json(), LYNX_CONFIG_ENV)


def load_plugin() -> None:
    """Entry point (group ``sglang.srt.plugins``, name ``lynx``)."""
    install_cpu_host_hooks()
    register("sglang.srt.server_args.ServerArgs.add_cli_args", _add_lynx_cli_args, "after")
    register("sglang.srt.server_args.ServerArgs.from_cli_args", _after_from_cli_args, "after")
    config = LynxConfig.from_env()
    if config is not None:
        install_runtime(config)
