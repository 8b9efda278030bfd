"""The chain verify's contract with each attention backend it is written for (issue 17).

``hook_targets.VERIFY_ATTENTION_BACKENDS`` says which backends; this reads their source in the
pinned SGLang: every ``forward_batch.<field>`` that ``init_forward_metadata``, ``forward_decode`` and
``forward_extend`` read must be a field the verify sets (the keywords of its ``ForwardBatch(...)``
calls in ``decode/verify.py``, plus what ``bind_kv_plan`` binds) or one left at a default that SGLang's
own plain batch has (``VERIFY_BATCH_DEFAULTS``). An SGLang upgrade whose backend reads something new
fails here, before a GPU server verifies with a field missing. (No GPU ran these backends here.)
"""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import pytest

from sglang_lynx.integration import hook_targets
from sglang_lynx.integration.decode import verify as decode_verify

METHODS = ("init_forward_metadata", "forward_decode", "forward_extend")
BOUND_BY_PLAN = {"kv_loc_plan", "kv_loc_cols", "out_cache_loc", "out_cache_loc_virtual", "out_cache_loc_is_physical"}


def verify_batch_fields() -> set[str]:
    tree = ast.parse(Path(decode_verify.__file__).read_text())
    fields: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "ForwardBatch":
            fields |= {kw.arg for kw in node.keywords if kw.arg}
    return fields


def test_the_verify_builds_its_batches_with_the_documented_fields() -> None:
    fields = verify_batch_fields()
    for field in ("forward_mode", "batch_size", "input_ids", "req_pool_indices", "seq_lens", "seq_lens_cpu",
                  "out_cache_loc", "seq_lens_sum", "positions", "extend_seq_lens_cpu"):
        assert field in fields


@pytest.mark.parametrize("backend", hook_targets.VERIFY_ATTENTION_BACKENDS, ids=lambda b: b.name)
def test_each_backend_reads_only_what_the_verify_provides(backend: hook_targets.VerifyBackend) -> None:
    cls = hook_targets.resolve(backend.path)
    read: set[str] = set()
    for name in METHODS:
        method = getattr(cls, name, None)
        if method is not None:
            read |= set(re.findall(r"forward_batch\.(\w+)", inspect.getsource(method)))
    assert read, f"{backend.name}: no forward_batch field read (the source changed shape)"
    provided = verify_batch_fields() | BOUND_BY_PLAN | set(hook_targets.VERIFY_BATCH_DEFAULTS)
    missing = sorted(read - provided)
    assert missing == [], f"{backend.name} reads {missing}: not set by the verify nor documented as defaulted"
