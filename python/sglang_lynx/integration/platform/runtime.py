"""Which Lynx machinery this build has, and installing it in an SGLang process.

``missing_machinery(config, disaggregation_mode)`` names what a mode still lacks (empty string when
it can run); the launcher refuses to start such a mode. ``install_runtime(config)`` registers the
hooks of every piece the mode needs, in the SGLang process that calls it (scheduler, engine).
Each piece is listed in ``MACHINERY`` with the modes that need it and whether it is built.
"""

from __future__ import annotations

from dataclasses import dataclass

from sglang_lynx.config import LynxConfig


@dataclass(frozen=True)
class Machinery:
    name: str
    modes: tuple[str, ...]  # modes that need it
    built: bool
    what: str


ALL_TRANSFER_MODES = ("bf16", "int8", "int4", "kivi-int4", "kivi-int2", "lynx-paper", "lynx-int4", "lynx-int8", "lynx",
                      "lynx-exact")

MACHINERY: tuple[Machinery, ...] = (
    Machinery("transport", ALL_TRANSFER_MODES, True, "the Lynx KV transport inside SGLang's PD path (issue 4)"),
    Machinery("speculative-decode", ("lynx", "lynx-exact"), True, "admission on anchor, drafting and verify (issue 5)"),
    Machinery("exact-stream", ("lynx-exact",), True,
              "the exact stream through the transport (third priority) and the decode's BF16 restore (issue 15)"),
)


def missing_machinery(config: LynxConfig, disaggregation_mode: str = "prefill", page_size: int = 1) -> str:
    """What ``config.mode`` still lacks in this build for this server ('' when nothing is missing)."""
    missing = [m.what for m in MACHINERY if config.mode in m.modes and not m.built]
    if disaggregation_mode not in ("prefill", "decode"):
        missing.append("--lynx on a server that is not a PD prefill or decode server (a single server "
                       "running the codec)")
    if page_size != 1:
        missing.append(f"--page-size {page_size} (the Lynx transport handles page size 1 only)")
    return "; ".join(missing)


def install_runtime(config: LynxConfig) -> None:
    """Register the hooks ``config.mode`` needs in this process (the launcher checked the mode)."""
    missing = missing_machinery(config)
    if missing:
        raise NotImplementedError(f"sglang-lynx mode {config.mode!r} is not implemented yet: {missing}")
    from sglang_lynx.integration.transport.kv_manager import install_transport_hooks

    install_transport_hooks(config)
    if config.progressive:
        from sglang_lynx.integration.decode.install import install_decode_hooks

        install_decode_hooks(config)
