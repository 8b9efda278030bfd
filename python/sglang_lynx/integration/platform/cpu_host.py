"""SGLang on a host without CUDA: the server-side half of CPU support (inert on CUDA hosts).

The pre-import half (``sgl_kernel`` stub, ``SGLANG_USE_CPU_ENGINE``) is
``sglang_lynx.platform.cpu_boot``, run from a ``.pth`` file in every interpreter. This module,
installed by the plugin in every SGLang process, does the rest:

- server arguments the user left unset get CPU values before resolution: ``device=cpu``,
  ``attention_backend=torch_native`` (the x86 default needs the CPU build of sgl-kernel, which is
  not on PyPI), both CUDA-graph backends ``disabled``, ``sleep_on_idle`` on (idle PD schedulers
  busy-poll otherwise), and on a decode server ``disaggregation_decode_retraction_backup=cpu_tensor``
  (the host pool calls cudaHostRegister), and ``max_total_tokens=32768`` (SGLang would size the KV
  pool at ~72% of host RAM);
- the prefill path that sends a cached prefix early (torch.cuda.Event) is switched off through
  ``SGLANG_DISAGG_PREFILL_EARLY_SEND_CACHED_PREFIX=0``;
- the Mooncake sender's ``supports_host_tensor_indices`` is made False (pinned memory +
  torch.cuda.Event in ``prefill._send_kv_chunk``);
- every model-parallel group is built without its CUDA-only communicators (PyNccl, MSCCL++,
  custom and torch-symm-mem all-reduce): ``init_model_parallel_group`` builds a
  ``PyNcclCommunicator`` unless the platform is NPU/XPU/out-of-tree, and that raises "Expected a
  cuda device, but got: cpu" at ``--tp-size 2``. Without them a CPU tensor's all-reduce is
  ``torch.distributed.all_reduce`` on the group's gloo device group (SGLang's shared-memory
  all-reduce needs the CPU sgl-kernel build and AMX or arm64);
- at ``--tp-size N`` (N > 1) with ``SGLANG_CPU_OMP_THREADS_BIND`` unset, it is set to this process's
  CPUs split into N contiguous groups (``0|1`` on a 2-core host): SGLang otherwise wants one NUMA node
  per rank and stops ("the total number of ranks ... should be smaller than or equal to number of
  numa node on the machine 1").

An explicit user value always wins.
"""

from __future__ import annotations

import os
from typing import Any

from sglang_lynx.integration.hook_targets import register
from sglang_lynx.platform.host import is_cpu_host

#: (field, CPU value, only for this disaggregation mode or None for all)
CPU_SERVER_DEFAULTS: tuple[tuple[str, Any, str | None], ...] = (
    ("device", "cpu", None),
    ("attention_backend", "torch_native", None),
    ("cuda_graph_backend_decode", "disabled", None),
    ("cuda_graph_backend_prefill", "disabled", None),
    ("sleep_on_idle", True, None),
    ("disaggregation_decode_retraction_backup", "cpu_tensor", "decode"),
    # The KV pool would otherwise take ~72% of *host* RAM (SGLang sizes it from "available memory").
    ("max_total_tokens", 32768, None),
)

CPU_ENV_DEFAULTS: dict[str, str] = {
    "SGLANG_DISAGG_PREFILL_EARLY_SEND_CACHED_PREFIX": "0",
}


def apply_cpu_server_defaults(server_args: Any) -> list[str]:
    """Fill unset server arguments with CPU values; return the names changed."""
    changed = []
    mode = getattr(server_args, "disaggregation_mode", "null")
    for name, value, only_mode in CPU_SERVER_DEFAULTS:
        if only_mode is not None and mode != only_mode:
            continue
        current = getattr(server_args, name, None)
        if current is None or (value is True and current is False):
            setattr(server_args, name, value)
            changed.append(name)
    return changed


THREADS_BIND_ENV = "SGLANG_CPU_OMP_THREADS_BIND"


def cpu_threads_binding(ranks: int, cpus: list[int]) -> str:
    """``SGLANG_CPU_OMP_THREADS_BIND`` for ``ranks`` ranks over ``cpus``: contiguous groups, ``|``-separated
    (a rank shares a CPU when there are fewer CPUs than ranks)."""
    cpus = sorted(cpus)
    if ranks <= len(cpus):
        size, extra = divmod(len(cpus), ranks)
        groups, start = [], 0
        for rank in range(ranks):
            end = start + size + (1 if rank < extra else 0)
            groups.append(cpus[start:end])
            start = end
    else:
        groups = [[cpus[rank % len(cpus)]] for rank in range(ranks)]
    return "|".join(str(g[0]) if len(g) == 1 else ",".join(str(c) for c in g) for g in groups)


def apply_cpu_threads_binding(server_args: Any, environ: Any = None) -> str | None:
    """Set ``SGLANG_CPU_OMP_THREADS_BIND`` for a multi-rank server when unset; return what was set."""
    env = os.environ if environ is None else environ
    ranks = 1
    for field in ("tp_size", "pp_size", "dp_size"):
        ranks *= int(getattr(server_args, field, 1) or 1)
    if ranks <= 1 or env.get(THREADS_BIND_ENV):
        return None
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    env[THREADS_BIND_ENV] = cpu_threads_binding(ranks, cpus)
    return str(env[THREADS_BIND_ENV])


def _before_resolve_once(self: Any, *args: Any, **kwargs: Any) -> None:
    if not getattr(self, "_resolution_finished", False):
        apply_cpu_server_defaults(self)
        apply_cpu_threads_binding(self)


def _after_get_kv_class(result: Any, *args: Any, **kwargs: Any) -> Any:
    if isinstance(result, type) and getattr(result, "supports_host_tensor_indices", False):
        setattr(result, "supports_host_tensor_indices", False)  # noqa: B010
    return result


#: ``init_model_parallel_group`` flags that build CUDA-only communicators; all False on a CPU host.
CPU_GROUP_FLAGS_OFF: tuple[str, ...] = (
    "use_pynccl", "use_custom_allreduce", "use_mscclpp", "use_torch_symm_mem_allreduce",
)


def _before_init_model_parallel_group(*args: Any, **kwargs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    # Signature (0.5.23): (group_ranks, local_rank, backend, use_pynccl, use_custom_allreduce, ...);
    # every caller passes the flags by keyword, and positional ones beyond ``backend`` are cut off
    # here so a keyword never collides with them.
    if len(args) > 3:
        raise TypeError("init_model_parallel_group: sglang-lynx expects the communicator flags by keyword")
    for name in CPU_GROUP_FLAGS_OFF:
        kwargs[name] = False
    return args, kwargs


def install_cpu_host_hooks(environ: Any = None) -> bool:
    """Register the CPU hooks when this is a CPU host; return whether they were installed."""
    env = os.environ if environ is None else environ
    if not is_cpu_host(env):
        return False
    for key, value in CPU_ENV_DEFAULTS.items():
        env.setdefault(key, value)
    register("sglang.srt.server_args.ServerArgs.resolve_once", _before_resolve_once, "before")
    register("sglang.srt.disaggregation.utils.get_kv_class", _after_get_kv_class, "after")
    register("sglang.srt.distributed.parallel_state.init_model_parallel_group",
             _before_init_model_parallel_group, "before")
    return True
