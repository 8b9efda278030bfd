"""In-process SGLang ModelRunner on the CPU for verify-path tests and measurements.

Built the way ``sglang.benchmark.one_batch`` builds it (no scheduler, no HTTP): prefill with an
EXTEND batch, then single-token DECODE steps, exactly the kernels the decode server runs. One
runner per process (SGLang's runtime globals allow one); reuse it across tests.
"""

from __future__ import annotations

import os
from array import array
from typing import Any

import torch


def load_runner(model_dir: str, dtype: str = "float32", max_total_tokens: int = 8192) -> tuple[Any, Any]:
    """(raw ModelRunner, bench wrapper with .extend(reqs) / .decode(ids, batch))."""
    os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
    from sglang.benchmark.one_batch import _init_process_global_configs, load_model
    from sglang.srt.entrypoints.engine import _set_envs_and_config
    from sglang.srt.runtime_context import SpawnRanks, publish, spawn_world_rank
    from sglang.srt.server_args import PortArgs, ServerArgs

    server_args = ServerArgs(
        model_path=model_dir,
        device="cpu",
        attention_backend="torch_native",
        dtype=dtype,
        max_total_tokens=max_total_tokens,
        cuda_graph_backend_decode="disabled",
        cuda_graph_backend_prefill="disabled",
        disable_overlap_schedule=True,
        random_seed=0,
    )
    server_args.resolve_once()
    _set_envs_and_config(server_args)
    port_args = PortArgs.init_new(server_args)
    ranks = SpawnRanks(world_rank=spawn_world_rank(server_args, tp_rank=0, pp_rank=0), gpu_id=0)
    publish(server_args, role="scheduler", ranks=ranks)
    _init_process_global_configs()
    wrapper, _tokenizer = load_model(server_args, port_args, 0, 0)
    return wrapper.torch_runner, wrapper


def make_req(rid: int, input_ids: list[int], max_new_tokens: int = 128) -> Any:
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_new_tokens=max_new_tokens)
    req = Req(rid=rid, origin_input_text="", origin_input_ids=array("q", input_ids), sampling_params=params)
    req.full_untruncated_fill_ids = req.origin_input_ids
    req.logprob_start_len = -1
    req.extend_end = len(req.origin_input_ids)
    return req


def prefill(wrapper: Any, input_ids: list[int]) -> tuple[int, Any, torch.Tensor]:
    """Prefill one request; returns (first token, batch, its logits)."""
    wrapper.clear()
    next_ids, logits, batch = wrapper.extend([make_req(0, input_ids)])
    return int(next_ids[0]), batch, logits[0].float()


def decode_steps(wrapper: Any, batch: Any, first_token: int, steps: int) -> tuple[list[int], torch.Tensor]:
    """Greedy decode ``steps`` tokens after ``first_token``; returns tokens and their logits [steps, V]."""
    tokens, rows, last = [], [], first_token
    for _ in range(steps):
        next_ids, logits = wrapper.decode(torch.tensor([last]), batch)
        last = int(next_ids[0])
        tokens.append(last)
        rows.append(logits[0].float())
    return tokens, torch.stack(rows)
