"""The verify's ``rows`` GEMMs: all rows in one pass over the weights, each rounded as a 1-row GEMM.

:class:`RowKernel` serves :class:`~sglang_lynx.integration.decode.row_gemm.RowGemmPolicy` ``rows``
(one per policy object, so per decode scheduler). For a GEMM of ``n > 1`` bf16 rows by a weight it
returns ``kernels.lynx_rows_gemm.gemm`` (each row rounded as this host's 1-row GEMM, one pass over the
weight), or None, and the policy then runs the 1-row GEMMs as ``split`` does. It returns None:

- where the kernel is not available (not built, no AVX512-BF16), the tensors are not 2-D bf16 on the
  CPU, or K is odd;
- for a weight shape on which :func:`~sglang_lynx.kernels.lynx_rows_gemm.calibrate` finds no chunk length
  that reproduces the host's 1-row GEMM on adversarial inputs (once per shape and kind of GEMM);
- for a weight whose first use disagrees: the first time a weight is used, the kernel's rows are
  compared with the 1-row GEMMs SGLang's own code computes (``one_row_each`` of the caller's ``gemm``,
  the very computation a decode step runs); any difference, in a bit, the dtype or the shape (another
  code path, e.g. an fp32 LM head), and that weight keeps the 1-row GEMMs for good (logged once).

So the result is always a 1-row GEMM's: either computed as one, or by a kernel shown to agree with it for
that shape (adversarial inputs) and for that weight (rows through SGLang's own code). Packed weights are
kept per weight: a copy of each weight the verify multiplies, ~the model's bf16 size on the decode server.
:meth:`RowKernel.prepare` does all of it for a model's linear layers and LM head when the decode server's
Lynx state is created (random rows through SGLang's own ``apply`` / ``_compute_lm_head``), so no request's
verify pays it; a weight it did not see is admitted on its first use, with that use's rows.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from sglang_lynx.kernels import lynx_rows_gemm

logger = logging.getLogger("sglang_lynx.decode")

Gemm = Callable[[torch.Tensor], torch.Tensor]


def linear_one_row(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """What ``UnquantizedLinearMethod.apply`` computes on the CPU (no bias)."""
    return torch.nn.functional.linear(x, w)


def lm_head_one_row(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """What ``LogitsProcessor._compute_lm_head`` computes for a plain bf16 LM head."""
    return torch.matmul(x, w.T)


def split_rows(gemm: Gemm, x: torch.Tensor) -> torch.Tensor:
    """``gemm`` of every row of ``x`` as its own 1-row GEMM (policy ``split``; the reference ``rows`` is checked
    against)."""
    return torch.cat([gemm(x[i: i + 1]) for i in range(int(x.shape[0]))], dim=0)


def _applied(module: Any) -> Gemm:
    """``module``'s GEMM as SGLang computes it (``quant_method.apply``; the verify's hook passes through
    outside a verify)."""
    return lambda rows: module.quant_method.apply(module, rows)  # type: ignore[no-any-return]


class RowKernel:
    """Packed weights, per-shape calibrations and per-weight first-use checks of one verify GEMM policy."""

    def __init__(self) -> None:
        self.ready = lynx_rows_gemm.available()
        self._chunks: dict[tuple[int, int, str], int | None] = {}  # (N, K, kind) -> chunk or None
        # weight key (data pointer, N, K) -> (weight, packed, chunk): the weight is held so its key stays its own
        self._packed: dict[tuple[int, int, int], tuple[torch.Tensor, torch.Tensor, int]] = {}
        self._refused: set[tuple[int, int, int]] = set()  # weights kept on 1-row GEMMs
        self.packed_bytes = 0

    def prepare(self, model: Any) -> tuple[int, int]:
        """Admit every weight a verify of ``model`` multiplies (linear layers without bias, the LM head):
        returns (admitted, kept on 1-row GEMMs)."""
        if not self.ready:
            return 0, 0
        started = time.monotonic()
        g = torch.Generator().manual_seed(0)
        seen = 0
        for module in model.modules():
            method = getattr(module, "quant_method", None)
            weight = getattr(module, "weight", None)
            if type(method).__name__ != "UnquantizedLinearMethod" or getattr(module, "bias", None) is not None:
                continue
            if isinstance(weight, torch.Tensor) and weight.dim() == 2:
                x = torch.randn(2, int(weight.shape[1]), generator=g).to(weight.dtype)
                self.rows(_applied(module), x, weight, linear_one_row)
                seen += 1
        head, processor = getattr(model, "lm_head", None), getattr(model, "logits_processor", None)
        weight = getattr(head, "weight", None)
        if processor is not None and isinstance(weight, torch.Tensor) and weight.dim() == 2:
            x = torch.randn(2, int(weight.shape[1]), generator=g).to(weight.dtype)
            self.rows(lambda rows: processor._compute_lm_head(rows, head, None), x, weight, lm_head_one_row)
            seen += 1
        admitted = len(self._packed)  # an fp32 model's weights never fit: all of them stay on 1-row GEMMs
        logger.info("lynx: verify row GEMMs: %d of %d weights on the row kernel (%.0f MiB packed), %d on 1-row GEMMs "
                    "(%.2f s)", admitted, seen, self.packed_bytes / 2**20, seen - admitted, time.monotonic() - started)
        return admitted, seen - admitted

    def rows(self, gemm: Gemm, x: torch.Tensor, weight: Any,
             one_row: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor | None:
        """``gemm(x)`` row by row as 1-row GEMMs compute it, or None (the caller splits)."""
        if not self._fits(x, weight):
            return None
        key = (weight.data_ptr(), int(weight.shape[0]), int(weight.shape[1]))
        if key in self._refused:
            return None
        entry = self._packed.get(key)
        if entry is None:
            return self._first_use(key, gemm, x, weight, one_row)
        _, packed, chunk = entry
        return lynx_rows_gemm.gemm(x, packed, key[1], chunk)

    def _fits(self, x: torch.Tensor, weight: Any) -> bool:
        return (self.ready and isinstance(weight, torch.Tensor) and weight.dim() == 2 and x.dim() == 2
                and x.dtype == weight.dtype == torch.bfloat16 and x.device.type == weight.device.type == "cpu"
                and x.shape[1] == weight.shape[1] and weight.shape[1] % 2 == 0)  # fmt: skip

    def _chunk(self, n: int, k: int, one_row: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> int | None:
        shape = (n, k, one_row.__name__)
        if shape not in self._chunks:
            self._chunks[shape] = lynx_rows_gemm.calibrate(n, k, one_row)
            if self._chunks[shape] is None:
                logger.warning("lynx: verify GEMM %s [%d x %d]: no row kernel reproduces this host's 1-row GEMM; "
                               "this shape keeps one 1-row GEMM per row", one_row.__name__, n, k)
        return self._chunks[shape]

    def _first_use(self, key: tuple[int, int, int], gemm: Gemm, x: torch.Tensor, weight: torch.Tensor,
                   one_row: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor | None:
        """Admit ``weight`` (pack it; its rows from now on by the kernel) if the kernel's rows equal SGLang's
        1-row GEMMs of ``x``, and return them; else refuse it for good and return None (the caller splits)."""
        split = split_rows(gemm, x)
        try:
            chunk = self._chunk(key[1], key[2], one_row)
            if chunk is None:
                self._refused.add(key)
                return None
            packed = lynx_rows_gemm.pack(weight.detach())
            got = lynx_rows_gemm.gemm(x, packed, key[1], chunk)
        except (RuntimeError, ValueError):
            logger.exception("lynx: verify GEMM [%d x %d]: the row kernel failed; 1-row GEMMs kept", key[1], key[2])
            self._refused.add(key)
            return None
        if got.dtype != split.dtype or got.shape != split.shape or not torch.equal(
                got.view(torch.int16), split.view(torch.int16)):  # fmt: skip
            logger.warning("lynx: verify GEMM %s [%d x %d]: the row kernel differs from SGLang's 1-row GEMMs on "
                           "this weight's first rows; it keeps one 1-row GEMM per row", one_row.__name__, *key[1:])
            self._refused.add(key)
            return None
        self._packed[key] = (weight, packed, chunk)
        self.packed_bytes += packed.numel() * packed.element_size()
        return split
