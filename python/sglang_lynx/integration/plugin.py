"""The ``sglang.srt.plugins`` entry point of sglang-lynx.

Lifecycle. SGLang calls :func:`load_plugin` in every process it starts (the launcher before it
parses arguments, then each scheduler, detokenizer and engine process), and applies the
registered hooks right after. In the launcher process the hooks on ``ServerArgs`` add
``--lynx`` / ``--lynx-config`` to the command line and validate them; the validated
configuration is published as JSON in the environment (``SGLANG_LYNX_CONFIG``), which every
child inherits, so a child's :func:`load_plugin` sees it and installs the Lynx runtime hooks
(transport, decode) for the configured mode. On a CPU host the CPU hooks are installed in every
process, with or without ``--lynx``.

Lifetime of the published config: from the launcher's argument parse (``from_cli_args``) to the
end of ``Engine._launch_subprocesses`` (every scheduler, detokenizer and helper process has been
started with a copy of the environment by then); the launcher then withdraws it, so nothing started
later in that process (a second server in one test process, any other tool) inherits a stale
config. A parse without ``--lynx`` withdraws it too. Children keep their own copy.

What Lynx does not support (a mode whose machinery is not in this build, a flag combination, a
model kind: ``platform.deployment_check``) stops the launcher before the model loads, twice checked: on the
parsed arguments (``from_cli_args``) and on SGLang's resolved ones (``resolve_once``); the message
names the flag.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
from typing import Any

from sglang_lynx.config import LYNX_CONFIG_ENV, MODES, LynxConfig, LynxConfigError
from sglang_lynx.integration.hook_targets import register
from sglang_lynx.integration.platform.cpu_host import install_cpu_host_hooks
from sglang_lynx.integration.platform.deployment_check import deployment_refusals
from sglang_lynx.integration.platform.health_gate import install_health_gate
from sglang_lynx.integration.platform.runtime import install_runtime

logger = logging.getLogger("sglang_lynx")


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
    """Refuse what Lynx does not support (``platform.deployment_check``), every reason naming its flag."""
    refusals = deployment_refusals(config, server_args)
    if refusals:
        raise LynxConfigError("; ".join(refusals))


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
    else:
        withdraw_published_config()  # this server runs without Lynx: an earlier parse's config must not reach it


def withdraw_published_config() -> None:
    """Remove the published config from this process's environment (see the module docstring)."""
    os.environ.pop(LYNX_CONFIG_ENV, None)


def _after_launch_subprocesses(result: Any, *args: Any, **kwargs: Any) -> None:
    """The server's processes are started (they inherited the config): the launcher gates its health
    endpoints on the Lynx transport's health (``platform.health_gate``), then withdraws the config."""
    if LynxConfig.from_env() is not None:
        try:
            install_health_gate()
        except Exception:  # the offline Engine has no HTTP app to gate: nothing to do there
            logger.exception("sglang-lynx: the health gate could not be installed")
    withdraw_published_config()


def _after_resolve_once(result: Any, server_args: Any, *args: Any, **kwargs: Any) -> None:
    """The same check on what SGLang resolved (page size, backend), still before any model load."""
    config = LynxConfig.from_env()
    if config is None or not getattr(server_args, "_resolution_finished", False):
        return
    from sglang.srt.arg_groups.model_override_base import resolved_view

    try:
        check_deployment(config, resolved_view(server_args))
    except LynxConfigError as exc:
        raise SystemExit(f"sglang-lynx: {exc}") from None


def load_plugin() -> None:
    """Entry point (group ``sglang.srt.plugins``, name ``lynx``)."""
    install_cpu_host_hooks()
    register("sglang.srt.server_args.ServerArgs.add_cli_args", _add_lynx_cli_args, "after")
    register("sglang.srt.server_args.ServerArgs.from_cli_args", _after_from_cli_args, "after")
    register("sglang.srt.server_args.ServerArgs.resolve_once", _after_resolve_once, "after")
    register("sglang.srt.entrypoints.engine.Engine._launch_subprocesses", _after_launch_subprocesses, "after")
    config = LynxConfig.from_env()
    if config is not None:
        install_runtime(config)
