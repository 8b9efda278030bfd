"""The CPU-host shim: pre-import boot (every interpreter) and the SGLang server defaults."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest

from sglang_lynx.integration.platform.cpu_host import CPU_SERVER_DEFAULTS, apply_cpu_server_defaults
from sglang_lynx.platform.cpu_boot import CPU_ENGINE_ENV, STUB_MODULE, boot
from sglang_lynx.platform.host import detect_platform


def test_detection_honours_override_and_device_node(tmp_path) -> None:
    ctl = tmp_path / "nvidiactl"
    assert detect_platform({}, nvidia_ctl=str(ctl)) == "cpu"
    ctl.write_text("")
    assert detect_platform({}, nvidia_ctl=str(ctl)) == "cuda"
    assert detect_platform({"CUDA_VISIBLE_DEVICES": ""}, nvidia_ctl=str(ctl)) == "cpu"
    assert detect_platform({"SGLANG_LYNX_PLATFORM": "cpu"}, nvidia_ctl=str(ctl)) == "cpu"
    with pytest.raises(ValueError, match="SGLANG_LYNX_PLATFORM"):
        detect_platform({"SGLANG_LYNX_PLATFORM": "tpu"})


def test_boot_is_inert_on_cuda_hosts() -> None:
    env = {"SGLANG_LYNX_PLATFORM": "cuda"}
    modules: dict[str, object] = {}
    assert boot(env, modules) is False
    assert modules == {} and CPU_ENGINE_ENV not in env


def test_boot_on_cpu_hosts_installs_stub_and_keeps_user_env() -> None:
    env = {"SGLANG_LYNX_PLATFORM": "cpu", CPU_ENGINE_ENV: "0"}
    modules: dict[str, object] = {}
    assert boot(env, modules) is True
    assert env[CPU_ENGINE_ENV] == "0"  # an explicit user value wins
    stub = modules[STUB_MODULE]
    assert stub._load_architecture_specific_ops() is None  # type: ignore[attr-defined]


def _fresh_python(code: str, platform: str) -> subprocess.CompletedProcess[str]:
    env = {"PATH": "/usr/bin:/bin", "SGLANG_LYNX_PLATFORM": platform, "HOME": "/root"}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)


def test_every_interpreter_of_the_venv_boots_the_shim() -> None:
    """The .pth file runs in a fresh interpreter: sgl_kernel (CUDA-only wheel) imports on the CPU."""
    proc = _fresh_python(
        "import os, sys; assert os.environ.get('SGLANG_USE_CPU_ENGINE') == '1'; "
        "import sgl_kernel; print('ok', getattr(sys.modules['sgl_kernel.load_utils'], 'LYNX_CPU_STUB', False))",
        "cpu",
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "ok True"


def test_shim_off_when_platform_is_cuda() -> None:
    proc = _fresh_python("import os, sys; print('sgl_kernel.load_utils' in sys.modules, "
                         "os.environ.get('SGLANG_USE_CPU_ENGINE'))", "cuda")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "False None"


def test_server_defaults_fill_only_unset_fields() -> None:
    args = SimpleNamespace(device=None, attention_backend="triton", cuda_graph_backend_decode=None,
                           cuda_graph_backend_prefill=None, sleep_on_idle=False, max_total_tokens=None,
                           disaggregation_mode="decode", disaggregation_decode_retraction_backup=None)
    changed = apply_cpu_server_defaults(args)
    assert args.device == "cpu" and args.attention_backend == "triton"  # explicit value kept
    assert args.disaggregation_decode_retraction_backup == "cpu_tensor"
    assert "attention_backend" not in changed and "device" in changed


def test_retraction_backup_only_on_decode() -> None:
    args = SimpleNamespace(**{name: None for name, _, _ in CPU_SERVER_DEFAULTS}, disaggregation_mode="prefill")
    apply_cpu_server_defaults(args)
    assert args.disaggregation_decode_retraction_backup is None
    assert args.device == "cpu" and args.max_total_tokens == 32768


def test_defaults_apply_to_a_real_server_args() -> None:
    from sglang.srt.server_args import ServerArgs

    args = ServerArgs(model_path="/nonexistent", disaggregation_mode="decode")
    apply_cpu_server_defaults(args)
    assert (args.device, args.attention_backend) == ("cpu", "torch_native")
    assert args.cuda_graph_backend_decode == "disabled" and args.sleep_on_idle is True


def test_model_parallel_groups_skip_cuda_communicators() -> None:
    """--tp-size 2 on the CPU: no PyNcclCommunicator ("Expected a cuda device, but got: cpu")."""
    import inspect

    from sglang_lynx.integration.hook_targets import TARGETS, resolve
    from sglang_lynx.integration.platform.cpu_host import CPU_GROUP_FLAGS_OFF, _before_init_model_parallel_group

    path = "sglang.srt.distributed.parallel_state.init_model_parallel_group"
    assert path in TARGETS
    params = list(inspect.signature(resolve(path)).parameters)
    assert params[:3] == ["group_ranks", "local_rank", "backend"]
    assert set(CPU_GROUP_FLAGS_OFF) <= set(params)
    args, kwargs = _before_init_model_parallel_group([[0, 1]], 0, "gloo", use_pynccl=True, group_name="tp")
    assert args == ([[0, 1]], 0, "gloo")
    assert kwargs == {"group_name": "tp", **{name: False for name in CPU_GROUP_FLAGS_OFF}}
    with pytest.raises(TypeError, match="by keyword"):
        _before_init_model_parallel_group([[0, 1]], 0, "gloo", True)


def test_a_multi_rank_server_gets_a_thread_binding_per_rank() -> None:
    """--tp-size 2 on a one-NUMA-node host needs SGLANG_CPU_OMP_THREADS_BIND (else SGLang stops)."""
    from sglang_lynx.integration.platform.cpu_host import (
        THREADS_BIND_ENV,
        apply_cpu_threads_binding,
        cpu_threads_binding,
    )

    assert cpu_threads_binding(2, [0, 1]) == "0|1"
    assert cpu_threads_binding(2, [4, 5, 6, 7, 8]) == "4,5,6|7,8"
    assert cpu_threads_binding(3, [0, 1]) == "0|1|0"
    env: dict[str, str] = {}
    assert apply_cpu_threads_binding(SimpleNamespace(tp_size=1), env) is None and env == {}
    assert apply_cpu_threads_binding(SimpleNamespace(tp_size=2), env) is not None
    assert len(env[THREADS_BIND_ENV].split("|")) == 2
    env = {THREADS_BIND_ENV: "0-1|0-1"}  # the user's value wins
    assert apply_cpu_threads_binding(SimpleNamespace(tp_size=2, pp_size=1, dp_size=1), env) is None
    assert env[THREADS_BIND_ENV] == "0-1|0-1"
