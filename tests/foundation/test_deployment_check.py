"""What Lynx refuses at start-up (``platform.deployment_check``), against the pinned SGLang's own ``ServerArgs``.

Arguments are parsed by SGLang's argparse (``ServerArgs.add_cli_args`` + ``from_cli_args``), exactly
what the plugin's ``from_cli_args`` hook sees; the resolved cases call SGLang's ``resolve_once`` (no
model load). Every refusal must name its flag.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sglang_lynx.config import LYNX_CONFIG_ENV, MODES, LynxConfig, LynxConfigError
from sglang_lynx.integration import plugin
from sglang_lynx.integration.platform.deployment_check import deployment_refusals, model_refusals
from sglang_lynx.integration.platform.runtime import missing_machinery

DECODE = ["--disaggregation-mode", "decode", "--disaggregation-transfer-backend", "mooncake_tcp"]
PREFILL = ["--disaggregation-mode", "prefill", "--disaggregation-transfer-backend", "mooncake_tcp"]
NO_OVERLAP = ["--disable-overlap-schedule"]


def server_args(model_path: str, argv: list[str]) -> Any:
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    return ServerArgs.from_cli_args(parser.parse_args(["--model-path", model_path, *argv]))


@pytest.fixture(scope="module")
def model_dir(model_path: str) -> str:
    return model_path


@pytest.fixture
def restored_environ() -> Iterator[None]:
    """SGLang's resolution writes process environment (e.g. MC_FORCE_TCP); later tests must not see it."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


# (mode, extra arguments on a decode (or other) server, the flag the message must name)
REFUSED = [
    ("lynx", [*DECODE, "--device", "cuda"], "--disable-overlap-schedule is missing"),
    ("lynx", [*DECODE, *NO_OVERLAP, "--tp-size", "4"], "--tp-size 4"),
    ("int8", [*PREFILL, "--tp-size", "3"], "--tp-size 3"),
    ("lynx", [*DECODE, *NO_OVERLAP, "--pp-size", "2"], "--pp-size 2"),
    ("lynx", [*DECODE, *NO_OVERLAP, "--dp-size", "2"], "--dp-size 2"),
    ("lynx", [*DECODE, *NO_OVERLAP, "--enable-dp-attention"], "--enable-dp-attention"),
    ("int4", [*DECODE, "--attn-dp-size", "2"], "--attn-dp-size 2"),
    ("int4", [*PREFILL, "--attn-cp-size", "2"], "--attn-cp-size 2"),
    ("int4", [*DECODE, "--dcp-size", "2"], "--dcp-size 2"),
    ("lynx", [*DECODE, *NO_OVERLAP, "--speculative-algorithm", "EAGLE"], "--speculative-algorithm EAGLE"),
    ("bf16", [*PREFILL, "--speculative-algorithm", "NGRAM"], "--speculative-algorithm NGRAM"),
    ("lynx-int8", [*DECODE, "--kv-cache-dtype", "fp8_e4m3"], "--kv-cache-dtype fp8_e4m3"),
    ("lynx", [*PREFILL, "--kv-cache-dtype", "fp8_e5m2"], "--kv-cache-dtype fp8_e5m2"),
    ("lynx", ["--disaggregation-mode", "decode", "--disaggregation-transfer-backend", "nixl", *NO_OVERLAP],
     "--disaggregation-transfer-backend nixl"),
    ("int8", ["--disaggregation-mode", "prefill", "--disaggregation-transfer-backend", "fake"],
     "--disaggregation-transfer-backend fake"),
    ("lynx", [*DECODE, *NO_OVERLAP, "--disaggregation-decode-enable-radix-cache"],
     "--disaggregation-decode-enable-radix-cache"),
    ("lynx", [*DECODE, *NO_OVERLAP, "--attention-backend", "trtllm_mha"], "--attention-backend trtllm_mha"),
    ("lynx", [*DECODE, *NO_OVERLAP, "--attention-backend", "fa3", "--decode-attention-backend", "flex_attention"],
     "--decode-attention-backend flex_attention"),
    ("lynx", [*DECODE, *NO_OVERLAP, "--prefill-attention-backend", "aiter"], "--prefill-attention-backend aiter"),
    ("lynx-int8", ["--disaggregation-transfer-backend", "mooncake_tcp"], "--disaggregation-mode"),
    ("bf16", [], "--disaggregation-mode"),
]


@pytest.mark.parametrize(("mode", "argv", "flag"), REFUSED, ids=[f"{m}:{f}" for m, _, f in REFUSED])
def test_each_unsupported_flag_is_refused_with_the_flag_named(model_dir: str, mode: str, argv: list[str],
                                                              flag: str) -> None:
    refusals = deployment_refusals(LynxConfig(mode=mode), server_args(model_dir, argv))
    assert len(refusals) == 1, refusals
    assert flag in refusals[0]
    with pytest.raises(LynxConfigError, match=flag.split()[0]):
        plugin.check_deployment(LynxConfig(mode=mode), server_args(model_dir, argv))


def test_several_reasons_are_all_given(model_dir: str) -> None:
    argv = [*DECODE, "--tp-size", "4", "--page-size", "16", "--kv-cache-dtype", "fp8_e4m3",
            "--speculative-algorithm", "EAGLE"]
    message = "; ".join(deployment_refusals(LynxConfig(mode="lynx"), server_args(model_dir, argv)))
    assert "--page-size" not in message, message  # paged KV is supported (transport.pages)
    for flag in ("--tp-size 4", "--kv-cache-dtype fp8_e4m3", "--speculative-algorithm EAGLE"):
        assert flag in message


BUILT_MODES = [mode for mode in MODES if not missing_machinery(LynxConfig(mode=mode))]


@pytest.mark.parametrize("mode", BUILT_MODES)
def test_what_the_pd_tests_run_is_not_refused(model_dir: str, mode: str) -> None:
    """Prefill and decode as the PD deployments start them (tests/lynx_testlib.py, tests/decode), every
    mode with SGLang's default overlap scheduler and with ``--disable-overlap-schedule``, at TP 1 and 2."""
    for decode in (DECODE, [*DECODE, *NO_OVERLAP]):
        for argv in (PREFILL, decode,
                     [*decode, "--page-size", "1", "--kv-cache-dtype", "bf16", "--dtype", "float32"],
                     [*PREFILL, "--tp-size", "2"], [*decode, "--tp-size", "2"]):
            assert deployment_refusals(LynxConfig(mode=mode), server_args(model_dir, argv)) == [], argv


@pytest.mark.parametrize("backend", ["flashinfer", "triton", "fa3", "torch_native"])
def test_the_attention_backends_the_verify_is_written_for_pass(model_dir: str, backend: str) -> None:
    """Mode lynx on a decode server accepts them; a backend matters nowhere else (no verify there)."""
    lynx_decode = [*DECODE, *NO_OVERLAP, "--attention-backend", backend]
    assert deployment_refusals(LynxConfig(mode="lynx"), server_args(model_dir, lynx_decode)) == []
    for mode, argv in (("lynx", PREFILL), ("lynx-int8", DECODE)):
        other = [*argv, "--attention-backend", "trtllm_mha"]
        assert deployment_refusals(LynxConfig(mode=mode), server_args(model_dir, other)) == [], (mode, argv)


@pytest.mark.parametrize("mode", BUILT_MODES)
@pytest.mark.parametrize("page_size", ["16", "64"])
def test_paged_kv_is_not_refused(model_dir: str, mode: str, page_size: str) -> None:
    """``--page-size N`` on both servers, every mode (tests/integration/test_lynx_paged.py runs them)."""
    decode = [*DECODE, *NO_OVERLAP] if mode == "lynx" else DECODE
    for argv in ([*PREFILL, "--page-size", page_size], [*decode, "--page-size", page_size]):
        assert deployment_refusals(LynxConfig(mode=mode), server_args(model_dir, argv)) == [], argv


def test_resolved_arguments_pass_and_a_resolved_refusal_stops_the_launcher(
        model_dir: str, monkeypatch: pytest.MonkeyPatch, restored_environ: None) -> None:
    """The resolve_once hook: SGLang's resolution (mooncake_tcp -> mooncake; a page size kept as asked)
    passes; a refusal exits."""
    from sglang.srt.arg_groups.model_override_base import resolved_view

    monkeypatch.setenv(LYNX_CONFIG_ENV, LynxConfig(mode="lynx").to_json())
    good = server_args(model_dir, [*DECODE, *NO_OVERLAP])
    good.resolve_once()
    assert resolved_view(good).disaggregation_transfer_backend == "mooncake"
    plugin._after_resolve_once(None, good)
    paged = server_args(model_dir, [*DECODE, *NO_OVERLAP, "--page-size", "64"])
    paged.resolve_once()
    assert resolved_view(paged).page_size == 64
    plugin._after_resolve_once(None, paged)
    bad = server_args(model_dir, [*DECODE, *NO_OVERLAP, "--kv-cache-dtype", "fp8_e4m3"])
    bad.resolve_once()
    with pytest.raises(SystemExit, match="--kv-cache-dtype fp8_e4m3"):
        plugin._after_resolve_once(None, bad)
    monkeypatch.delenv(LYNX_CONFIG_ENV)
    plugin._after_resolve_once(None, bad)  # no Lynx configuration: SGLang as usual


MODEL_CONFIGS = [
    ({"architectures": ["DeepseekV3ForCausalLM"], "kv_lora_rank": 512}, "kv_lora_rank 512"),
    ({"text_config": {"kv_lora_rank": 256}}, "kv_lora_rank 256"),
    ({"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 512}, "sliding_attention"),
    ({"layer_types": ["linear_attention", "full_attention"]}, "linear_attention"),
    ({"architectures": ["MistralForCausalLM"], "sliding_window": 4096}, "sliding_window 4096"),
    ({"is_hybrid_swa": True, "sliding_window": 128}, "sliding_window 128"),
]


@pytest.mark.parametrize(("config", "what"), MODEL_CONFIGS)
def test_mla_and_sliding_window_models_are_refused_from_config_json(
        tmp_path: Path, config: dict[str, Any], what: str) -> None:
    (tmp_path / "config.json").write_text(json.dumps(config))
    refusals = deployment_refusals(LynxConfig(mode="lynx-int8"), server_args(str(tmp_path), PREFILL))
    assert len(refusals) == 1 and "--model-path" in refusals[0] and what in refusals[0], refusals


def test_full_attention_configs_pass(model_dir: str) -> None:
    llama = json.loads((Path(model_dir) / "config.json").read_text())
    assert model_refusals(llama) == []
    qwen2 = {"sliding_window": 32768, "use_sliding_window": False, "layer_types": ["full_attention"] * 4}
    assert model_refusals(qwen2) == []
    # a hub id or a missing config.json is not read (the attention kind is found when the model loads)
    assert deployment_refusals(LynxConfig(mode="int8"), server_args("org/some-model", PREFILL)) == []


def test_lynx_exact_starts_on_a_bf16_pool_on_either_side_and_either_decode_loop(model_dir: str) -> None:
    for argv in (PREFILL, DECODE, [*DECODE, *NO_OVERLAP]):
        args = server_args(model_dir, [*argv, "--dtype", "bfloat16"])
        refusals = deployment_refusals(LynxConfig(mode="lynx-exact"), args)
        assert refusals == [], (argv, refusals)


@pytest.mark.parametrize("dtype", ["float32", "float16", "half"])
def test_lynx_exact_refuses_a_pool_that_is_not_bf16(model_dir: str, dtype: str) -> None:
    refusals = deployment_refusals(LynxConfig(mode="lynx-exact"), server_args(model_dir, [*PREFILL, "--dtype", dtype]))
    assert any(f"--dtype {dtype}" in r and "bf16 KV pool" in r for r in refusals), refusals
    for mode in ("lynx", "lynx-int8"):  # only the exact stream needs BF16
        assert deployment_refusals(LynxConfig(mode=mode), server_args(model_dir, [*PREFILL, "--dtype", dtype])) == []


def test_lynx_exact_accepts_a_bf16_pool(model_dir: str, tmp_path: Path) -> None:
    for argv in (["--dtype", "bfloat16"], ["--kv-cache-dtype", "bf16", "--dtype", "float32"], []):
        refusals = deployment_refusals(LynxConfig(mode="lynx-exact"), server_args(model_dir, [*PREFILL, *argv]))
        assert not any("bf16 KV pool" in r for r in refusals), (argv, refusals)
    (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": "float32"}))
    refusals = deployment_refusals(LynxConfig(mode="lynx-exact"), server_args(str(tmp_path), PREFILL))
    assert any("--dtype auto (config.json torch_dtype float32)" in r for r in refusals), refusals
