"""The C fast path with ``lynx``'s layer trailer (``recent_tokens``); the Triton kernels' trailer test
is in ``test_lynx_triton.py`` (it needs the interpreter run of ``scripts/test.sh``)."""

from __future__ import annotations

import pytest
import torch
from kernel_inputs import TRAILER_PARAMS, check_kernel_module_with_trailer, outlier_kv
from sglang_lynx.kernels import lynx_cpu_fast


@pytest.mark.parametrize("params", TRAILER_PARAMS)
@pytest.mark.parametrize("kind", ["k", "v"])
@pytest.mark.parametrize("name", ["lynx", "lynx-int4"])
@pytest.mark.parametrize("tokens", [300, 30])
def test_cpu_fast_path_matches_the_reference_with_a_trailer(params, kind, name, tokens) -> None:  # noqa: ANN001
    x = outlier_kv(tokens, 3, 64, seed=tokens).to(torch.bfloat16)
    check_kernel_module_with_trailer(lynx_cpu_fast, x, kind, params, name)
