"""The verify's chain attention: every input's decode attention in one pass over the row's K/V.

:class:`ChainAttentionKernel` serves ``LynxConfig.verify_attention = "kernel"`` (one per decode scheduler,
owned by its ``DecodeLynxState``). Inside a chain verify on SGLang's CPU backend
(``chain_attention.chain_sdpa_decode``) it computes the ``n`` inputs' attention with
``kernels.lynx_chain_sdpa`` (each K/V block read once for all inputs) instead of one SDPA call per input,
or declines and makes the caller's per-input calls. It declines:

- where the kernel is not built or this CPU lacks its instructions (``lynx_chain_sdpa.available``);
- where its start-up self-check failed (:meth:`prepare`: ``lynx_chain_sdpa.matches_torch``, random and
  adversarial inputs at every block boundary, outputs and logsumexp bit for bit against the per-input
  SDPA calls under this process's torch threads), for good;
- for a call it does not cover: not bf16 CPU tensors, a head dim it does not take, query heads that are
  not a multiple of the KV heads, or KV heads that differ from the query heads without ``enable_gqa``
  (the per-input call then raises as it always did);
- for an attention shape (heads, KV heads, head dim, scale, GQA) whose first use disagrees: the first
  call of each shape computes both the kernel and the per-input calls on the real K/V and compares them
  bit for bit; any difference and that shape keeps the per-input calls for good (logged once).

So what it returns is always what the per-input calls return: computed by them, or by a kernel shown to
agree with them on inputs built to expose another order of operations and on that shape's first real
verify. ``calls`` counts the chains each way took.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from sglang_lynx.kernels import lynx_chain_sdpa

logger = logging.getLogger("sglang_lynx.decode")

PerInput = Callable[[], torch.Tensor]
Shape = tuple[int, int, int, float, bool]  # heads, kv heads, head dim, scale, enable_gqa


class ChainAttentionKernel:
    """Readiness, the self-check and the per-shape first-use checks of the chain attention kernel."""

    def __init__(self) -> None:
        self.ready = lynx_chain_sdpa.available()
        self.checked = False  # the self-check ran (prepare or first use)
        self._shapes: dict[Shape, bool] = {}  # shape -> admitted after its first use
        self.calls = {"kernel": 0, "per-input": 0}

    def prepare(self) -> bool:
        """Run the self-check once (about a second; at the decode server's start, before any request);
        returns whether the kernel serves verifies."""
        if not self.ready or self.checked:
            return self.ready
        started = time.monotonic()
        self.checked = True
        self.ready = lynx_chain_sdpa.matches_torch(threads=torch.get_num_threads())
        if self.ready:
            logger.info("lynx: verify chain attention: kernel checked against this host's SDPA (%.2f s)",
                        time.monotonic() - started)
        else:
            logger.warning("lynx: verify chain attention: the kernel differs from this host's SDPA on its "
                           "self-check; the verify makes one SDPA call per input")
        return self.ready

    def attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, prefix_len: int,
               scale: float | None, enable_gqa: bool, per_input: PerInput) -> torch.Tensor:
        """The chain's attention ``[n, H, D]`` for ``q`` ``[n, H, D]`` over ``keys``/``values``
        ``[S + n, Hk, D]`` (input i sees the first ``S + i + 1``): the kernel's, or ``per_input()``'s (the
        per-input SDPA calls, which the kernel's equals; module docstring)."""
        shape = self._shape(q, keys, values, scale, enable_gqa) if self.prepare() else None
        admitted = None if shape is None else self._shapes.get(shape)
        if shape is None or admitted is False:
            self.calls["per-input"] += 1
            return per_input()
        try:
            got = lynx_chain_sdpa.chain_sdpa(q, keys, values, prefix_len, scale, threads=torch.get_num_threads())
        except (RuntimeError, ValueError):
            logger.exception("lynx: verify chain attention %s: the kernel failed; one SDPA call per input kept",
                             shape)
            self._shapes[shape] = False
            self.calls["per-input"] += 1
            return per_input()
        if admitted is None:
            want = per_input()
            self.calls["per-input"] += 1
            same = got.dtype == want.dtype and got.shape == want.shape and torch.equal(
                got.view(torch.int16), want.view(torch.int16))
            self._shapes[shape] = same
            if not same:
                logger.warning("lynx: verify chain attention %s: the kernel differs from the per-input SDPA on "
                               "its first verify; this shape keeps one SDPA call per input", shape)
            return want
        self.calls["kernel"] += 1
        return got

    @staticmethod
    def _shape(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float | None,
               enable_gqa: bool) -> Shape | None:
        tensors = (q, keys, values)
        if any(t.dtype != torch.bfloat16 or t.device.type != "cpu" or t.dim() != 3 for t in tensors):
            return None
        heads, kv_heads, dim = int(q.shape[1]), int(keys.shape[1]), int(q.shape[2])
        if dim % 16 or not 16 <= dim <= lynx_chain_sdpa.MAX_HEAD_DIM or heads % kv_heads:
            return None
        if kv_heads != heads and not enable_gqa:
            return None
        value = lynx_chain_sdpa.default_scale(dim) if scale is None else float(scale)
        return heads, kv_heads, dim, value, bool(enable_gqa)
