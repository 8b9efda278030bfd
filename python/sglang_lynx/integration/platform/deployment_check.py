"""What a Lynx server refuses at start-up, before the model loads: one pure function.

Lifecycle. In the launcher, the plugin's AFTER hook on ``ServerArgs.from_cli_args`` calls
:func:`deployment_refusals` on the parsed (not yet resolved) arguments, and its AFTER hook on
``ServerArgs.resolve_once`` calls it again on what SGLang resolved (a backend may force other values;
``mooncake_tcp`` resolves to ``mooncake``); both run before any scheduler process starts or a
weight is read. A non-empty answer stops the launcher with every reason (``SystemExit``). Each
reason names the flag and says what to do.

The function reads ``server_args`` with ``getattr`` and defaults (a ``ServerArgs``, its resolved
view, or any object with the same field names) and, when ``--model-path`` is a local directory,
its ``config.json`` (no other file; a hub id or a missing file is not checked: the model's
attention kind is then only found when the model loads).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from sglang_lynx.config import LynxConfig
from sglang_lynx.integration.platform.runtime import missing_machinery

PD_TRANSFER_BACKENDS = ("mooncake", "mooncake_tcp")
KV_CACHE_DTYPES = ("auto", "bf16", "bfloat16")
#: ``--dtype`` values that give a BF16 KV pool (with ``--kv-cache-dtype auto``); ``auto`` follows config.json.
BF16_DTYPES = ("bfloat16", "bf16")

#: the largest ``--tp-size`` Lynx runs (each rank streams its own KV heads; tested at 2 on the CPU)
MAX_TP_SIZE = 2

#: (ServerArgs field, flag): parallel widths Lynx does not handle (it moves and verifies the KV of
#: one model replica, split over at most MAX_TP_SIZE tensor-parallel ranks).
PARALLEL_WIDTHS: tuple[tuple[str, str], ...] = (
    ("pp_size", "--pp-size"),
    ("dp_size", "--dp-size"),
    ("attn_dp_size", "--attn-dp-size"),
    ("attn_cp_size", "--attn-cp-size"),
    ("dcp_size", "--dcp-size"),
)


def _width(server_args: Any, field: str) -> int:
    value = getattr(server_args, field, 1)
    return 1 if value is None else int(value)


def _pd_refusals(config: LynxConfig, server_args: Any) -> list[str]:
    mode = getattr(server_args, "disaggregation_mode", "null")
    backend = getattr(server_args, "disaggregation_transfer_backend", "mooncake")
    out = []
    if backend not in PD_TRANSFER_BACKENDS:
        out.append(f"--disaggregation-transfer-backend {backend}: Lynx streams the KV over Mooncake only; "
                   f"use --disaggregation-transfer-backend {' or '.join(PD_TRANSFER_BACKENDS)}")
    if mode == "decode" and getattr(server_args, "disaggregation_decode_enable_radix_cache", False):
        out.append("--disaggregation-decode-enable-radix-cache: the decode radix cache is not supported by "
                   "Lynx (the prefill would fail every request); drop the flag")
    return out


def _attention_refusals(config: LynxConfig, server_args: Any) -> list[str]:
    """Mode lynx, decode server: the chain verify hands its own forward batch to the attention backend
    (the DECODE one for the verify, the prefill one for the recompute fallback); refuse a backend it is
    not written for (``hook_targets.VERIFY_ATTENTION_BACKENDS``). Unset: checked again once resolved."""
    from sglang_lynx.integration.hook_targets import VERIFY_ATTENTION_BACKENDS

    if getattr(server_args, "disaggregation_mode", "null") != "decode" or not config.progressive:
        return []
    accepted = [b.name for b in VERIFY_ATTENTION_BACKENDS]
    general = getattr(server_args, "attention_backend", None)
    out = []
    for field, flag in (("decode_attention_backend", "--decode-attention-backend"),
                        ("prefill_attention_backend", "--prefill-attention-backend")):
        value = getattr(server_args, field, None)
        name, named = (value, flag) if value else (general, "--attention-backend")
        if name and name not in accepted:
            out.append(f"{named} {name}: mode '{config.mode}' verifies drafts with the attention backend's own "
                       f"kernels, and the verify is written for {', '.join(accepted)} only; use --attention-backend "
                       "flashinfer (or triton, fa3) on the decode server")
    return list(dict.fromkeys(out))


def _overlap_refusals(config: LynxConfig, server_args: Any) -> list[str]:
    """Mode lynx, decode server on an accelerator: the overlap loop runs the next batch's forward on
    its own stream while the hooks verify and upgrade between batches; the hooks are written for the
    CPU (one stream) and do not synchronise with that stream yet. The CPU runs both loops."""
    if getattr(server_args, "disaggregation_mode", "null") != "decode" or not config.progressive:
        return []
    device = getattr(server_args, "device", None)
    if device in (None, "cpu") or getattr(server_args, "disable_overlap_schedule", False):
        return []
    return [f"--disable-overlap-schedule is missing: mode '{config.mode}' on --device {device} runs its verify between "
            "batches without synchronising with the overlap scheduler's forward stream yet (the CPU runs "
            "both loops); add --disable-overlap-schedule to the decode server"]


def _parallel_refusals(server_args: Any) -> list[str]:
    out = []
    tp = _width(server_args, "tp_size")
    if tp > MAX_TP_SIZE:
        out.append(f"--tp-size {tp}: Lynx is tested with tensor parallel sizes 1 and {MAX_TP_SIZE} only (each rank "
                   f"streams its own KV heads); start the server with --tp-size {MAX_TP_SIZE} or 1")
    for field, flag in PARALLEL_WIDTHS:
        width = _width(server_args, field)
        if width > 1:
            out.append(f"{flag} {width}: Lynx handles one model replica without pipeline, data or context "
                       f"parallelism (widths 1 only; --tp-size up to {MAX_TP_SIZE}); start the server with {flag} 1")
    if getattr(server_args, "enable_dp_attention", False):
        out.append("--enable-dp-attention: data-parallel attention is not supported by Lynx; drop the flag")
    return out


def _kv_layout_refusals(server_args: Any) -> list[str]:
    out = []  # any --page-size works: both sides turn SGLang's page indices into token slots (transport.pages)
    dtype = getattr(server_args, "kv_cache_dtype", "auto")
    if dtype not in KV_CACHE_DTYPES:
        out.append(f"--kv-cache-dtype {dtype}: Lynx encodes a 16/32-bit KV pool only; use --kv-cache-dtype "
                   f"{' or '.join(KV_CACHE_DTYPES)}")
    algorithm = getattr(server_args, "speculative_algorithm", None)
    if algorithm not in (None, "", "NONE"):
        out.append(f"--speculative-algorithm {algorithm}: SGLang's speculative decoding is not supported on a "
                   "Lynx server (mode 'lynx' drafts on its own); drop the flag")
    return out


def exact_pool_refusals(config: LynxConfig, server_args: Any, model_config: dict[str, Any] | None) -> list[str]:
    """``lynx-exact`` restores BF16 bit patterns: it needs a BF16 KV pool (an fp32 or fp16 pool is refused,
    not coded: its values are not BF16, so the bins of the 8-bit code would not enumerate them).

    The pool is BF16 with ``--kv-cache-dtype bf16``, or with ``auto`` and ``--dtype bfloat16``, or ``auto``
    / ``auto`` and a ``config.json`` whose ``torch_dtype`` is bfloat16 (a hub id is not checked here)."""
    if not config.exact:
        return []
    kv_dtype = getattr(server_args, "kv_cache_dtype", "auto")
    if kv_dtype in BF16_DTYPES:
        return []
    dtype = str(getattr(server_args, "dtype", "auto"))
    if dtype == "auto":
        declared = (model_config or {}).get("torch_dtype") or (model_config or {}).get("dtype")
        if declared is None or str(declared) in BF16_DTYPES:
            return []
        dtype = f"auto (config.json torch_dtype {declared})"
    if dtype in BF16_DTYPES:
        return []
    return [f"--dtype {dtype}: mode 'lynx-exact' restores BF16 KV bit for bit and needs a bf16 KV pool; start "
            "the server with --dtype bfloat16 (or --kv-cache-dtype bf16), or use mode 'lynx'"]


def read_model_config(model_path: Any) -> dict[str, Any] | None:
    """The model's ``config.json`` when ``model_path`` is a local directory with a readable one."""
    if not model_path:
        return None
    path = Path(str(model_path)) / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


def model_refusals(model_config: dict[str, Any]) -> list[str]:
    """Attention kinds Lynx does not handle, read from a ``config.json`` (its text config too)."""
    out = []
    for cfg in (model_config, model_config.get("text_config")):
        if not isinstance(cfg, dict):
            continue
        if cfg.get("kv_lora_rank") is not None:
            out.append(f"--model-path: an MLA model (kv_lora_rank {cfg['kv_lora_rank']}): Lynx encodes "
                       "per-head K/V pools only; use a model with standard (MHA/GQA) attention")
        kinds = sorted({str(k) for k in cfg.get("layer_types") or ()} - {"full_attention"})
        window = cfg.get("sliding_window")
        if kinds or cfg.get("is_hybrid_swa") or (window and cfg.get("use_sliding_window", True) is not False):
            found = ", ".join(kinds) if kinds else f"sliding_window {window}"
            out.append(f"--model-path: a model with sliding-window or hybrid attention layers ({found}): Lynx "
                       "handles full-attention layers only; use a full-attention model")
    return list(dict.fromkeys(out))  # a text config repeating the top level says nothing new


def deployment_refusals(config: LynxConfig, server_args: Any,
                        model_config: dict[str, Any] | None = None) -> list[str]:
    """Why this server cannot run ``config`` (empty when it can); each reason names its flag.

    ``model_config`` defaults to the ``config.json`` under ``server_args.model_path`` (when local)."""
    if getattr(server_args, "disaggregation_mode", "null") not in ("prefill", "decode"):
        return ["--lynx needs --disaggregation-mode prefill or decode: Lynx only moves the KV cache between "
                "PD servers; start a prefill and a decode server, or drop --lynx on a single server"]
    out = [*_pd_refusals(config, server_args), *_attention_refusals(config, server_args),
           *_overlap_refusals(config, server_args),
           *_parallel_refusals(server_args), *_kv_layout_refusals(server_args)]
    if model_config is None:
        model_config = read_model_config(getattr(server_args, "model_path", None))
    if model_config is not None:
        out += model_refusals(model_config)
    out += exact_pool_refusals(config, server_args, model_config)
    missing = missing_machinery(config)
    if missing:
        out.append(f"mode {config.mode!r} is not implemented yet in this build: {missing}")
    return out
