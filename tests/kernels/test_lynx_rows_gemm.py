"""The verify's row GEMM kernel (``kernels/lynx_rows_gemm``) against this host's own 1-row GEMM.

Every row of the kernel's product equals torch's 1-row bf16 GEMM of that row bit for bit (``F.linear`` as
SGLang's linear layers call it, ``x @ w.T`` as its LM head does), for the default model's weight shapes
and odd ones, random and adversarial inputs, 2..64 rows; :func:`calibrate` finds a chunk length for each
and the adversarial inputs really tell chunk lengths apart (so a calibration that passes means something).
On a CPU without AVX512-BF16 the kernel is unavailable and these tests are skipped with that reason; the
verify then keeps its 1-row GEMMs (``tests/decode/test_row_gemm.py``).
"""

from __future__ import annotations

import pytest
import torch
from sglang_lynx.kernels import lynx_rows_gemm as rg

pytestmark = pytest.mark.kernels

# SmolLM2-135M: qkv (fused), o, gate_up (fused), down, the tied LM head; then odd sizes (N not a multiple of 16,
# K not a multiple of the chunk; small shapes such as [17 x 96] run another oneDNN kernel that calibrate
# does not reproduce: they keep the 1-row GEMMs)
MODEL_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)]
ODD_SHAPES = [(37, 1536), (100, 576), (1, 1030)]


@pytest.fixture(scope="module", autouse=True)
def kernel() -> None:
    rg.build()
    if not rg.available():
        pytest.skip("this CPU build has no AVX512-BF16: the verify keeps its 1-row GEMMs")


def _linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.linear(x, w)


def _matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.matmul(x, w.T)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)


@pytest.mark.parametrize("n,k,threads", [(*s, t) for s in MODEL_SHAPES for t in (1, 2)] + [(*s, 1) for s in ODD_SHAPES])
def test_every_row_equals_the_one_row_gemm(n: int, k: int, threads: int) -> None:
    """The 1-row GEMM under 1 and 2 torch threads (a decode server here runs 2)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        _check_rows(n, k)
    finally:
        torch.set_num_threads(before)


def _check_rows(n: int, k: int) -> None:
    chunk = rg.calibrate(n, k, _linear)
    assert chunk is not None, f"no chunk length reproduces the 1-row GEMM for [{n} x {k}]"
    g = torch.Generator().manual_seed(n * 7 + k)
    for m, kind in ((2, "random"), (16, "random"), (5, "adversarial"), (64, "random")):
        if kind == "random":
            x = torch.randn(m, k, generator=g).bfloat16()
            w = (torch.randn(n, k, generator=g) / k**0.5).bfloat16()
        else:
            x, w = rg.adversarial_inputs(n, k, seed=m)
        got = rg.gemm(x, rg.pack(w), n, chunk)
        for one_row in (_linear, _matmul):
            want = rg.one_row_each(one_row, x, w)
            assert torch.equal(_bits(got), _bits(want)), (n, k, m, kind, one_row.__name__)


@pytest.mark.parametrize("n,k", [(576, 1536), (960, 576)])
def test_the_adversarial_inputs_tell_chunk_lengths_apart(n: int, k: int) -> None:
    """Only the calibrated chunk length reproduces the 1-row GEMM there: every other candidate differs on
    a large share of outputs (so calibrating on these inputs cannot pass by luck)."""
    chunk = rg.calibrate(n, k, _linear)
    x, w = rg.adversarial_inputs(n, k)
    want, packed = rg.one_row_each(_linear, x, w), rg.pack(w)
    for other in rg.CANDIDATE_CHUNKS:
        if other == chunk or (other and other >= k):
            continue
        same = (_bits(rg.gemm(x, packed, n, other)) == _bits(want)).float().mean().item()
        assert same < 0.9, (other, same)


def test_calibrate_says_none_where_nothing_reproduces_the_gemm() -> None:
    def rounded_differently(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return (x.double() @ w.double().T).bfloat16()  # exact sums, one rounding: no chunk order gives that

    def fp32_out(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.matmul(x.float(), w.float().T)

    assert rg.calibrate(576, 1536, rounded_differently) is None
    assert rg.calibrate(96, 64, fp32_out) is None
    assert rg.calibrate(16, 7, _linear) is None  # odd K


def test_bad_inputs_are_refused() -> None:
    w = torch.randn(32, 64).bfloat16()
    with pytest.raises(ValueError, match="bf16"):
        rg.pack(w.float())
    with pytest.raises(ValueError, match="even K"):
        rg.pack(torch.randn(32, 63).bfloat16())
    packed = rg.pack(w)
    with pytest.raises(ValueError, match="rows"):
        rg.gemm(torch.randn(4, 64), packed, 32, 512)
    with pytest.raises(ValueError, match="does not fit"):
        rg.gemm(torch.randn(4, 64).bfloat16(), packed, 48, 512)
