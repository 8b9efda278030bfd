/* Many-row bf16 GEMM that rounds every row exactly as the host's 1-row GEMM does (kernels/lynx_rows_gemm.py
 * documents why and how it is checked). Built by lynx_rows_gemm.py with -O3 -march=native -ffp-contract=off.
 *
 * What the 1-row GEMM computes (oneDNN's brgemm for avx512_core_bf16, as torch 2.14 calls it for a bf16
 * F.linear of one row; established by lynx_rows_gemm.check_shape, never assumed): for every output n,
 *
 *     chunk_j = sum over the K-pairs p of chunk j, in order, of VDPBF16PS(x[2p..2p+1], w[n][2p..2p+1])
 *               (one fp32 accumulator starting at +0; the instruction adds the odd product, then the even)
 *     y[n]    = bf16_rne(((0 + chunk_0) + chunk_1) + ...)      (chunks of `chunk` K values, 512 there)
 *
 * This file computes exactly that for M rows at once, 16 outputs per vector, with the weights packed once
 * into pairs, block by block of 16 outputs ("VNNI": packed[b][p][i] = (w[16b + i][2p], w[16b + i][2p + 1])),
 * so a block's weights (K x 16 values) stay in cache while every row uses them and the weights stream from
 * memory once per call instead of once per row. Every operation is the instruction the 1-row kernel uses, in its
 * order: VDPBF16PS per pair, VADDPS per chunk, VCVTNEPS2BF16 at the end. */
#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define LYNX_ROWS_GEMM 1
#endif

#define ROWS 4 /* rows per pass over a block of 16 outputs (they share each weight load) */

int lynx_rows_gemm_available(void) {
#ifdef LYNX_ROWS_GEMM
    return 1;
#else
    return 0;
#endif
}

/* w [N][K] bf16 (K even) -> packed [n_pad / 16][K / 2][16][2], n_pad = N rounded up to 16, padding zero. */
void lynx_rows_pack(const uint16_t *w, int64_t N, int64_t K, uint16_t *packed) {
    int64_t n_pad = (N + 15) / 16 * 16;
    memset(packed, 0, (size_t)(n_pad * K) * sizeof(uint16_t));
    for (int64_t n = 0; n < N; n++) {
        uint16_t *dst = packed + (n / 16) * 16 * K + (n % 16) * 2;
        for (int64_t p = 0; p < K / 2; p++) {
            dst[p * 32] = w[n * K + 2 * p];
            dst[p * 32 + 1] = w[n * K + 2 * p + 1];
        }
    }
}

#ifdef LYNX_ROWS_GEMM
/* Rows m0 .. m0 + R - 1, outputs nb .. nb + 15 (`live` lanes stored). */
static inline __attribute__((always_inline)) void block(const uint16_t *x, int64_t K, const uint16_t *packed,
                                                        int64_t nb, int64_t chunk, uint16_t *out, int64_t N,
                                                        int64_t m0, int R, __mmask16 live) {
    const uint16_t *wb = packed + nb * K; /* this block's K / 2 pairs of 16 outputs */
    __m512 total[ROWS];
    for (int r = 0; r < ROWS; r++) total[r] = _mm512_setzero_ps();
    for (int64_t k0 = 0; k0 < K; k0 += chunk) {
        int64_t k1 = k0 + chunk < K ? k0 + chunk : K;
        __m512 acc[ROWS];
        for (int r = 0; r < ROWS; r++) acc[r] = _mm512_setzero_ps();
        for (int64_t p = k0 / 2; p < k1 / 2; p++) {
            __m512bh wv = (__m512bh)_mm512_loadu_si512(wb + p * 32);
            for (int r = 0; r < ROWS; r++) {
                if (r < R) {
                    int32_t pair;
                    memcpy(&pair, x + (m0 + r) * K + 2 * p, 4);
                    acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_set1_epi32(pair), wv);
                }
            }
        }
        for (int r = 0; r < ROWS; r++) total[r] = _mm512_add_ps(total[r], acc[r]);
    }
    for (int r = 0; r < R; r++) {
        __m256bh y = _mm512_cvtneps_pbh(total[r]);
        _mm256_mask_storeu_epi16(out + (m0 + r) * N + nb, live, (__m256i)y);
    }
}
#endif

/* out [M][N] bf16 = x [M][K] bf16 times the packed weights, each row as the 1-row kernel rounds it.
 * Returns 0, or 1 when this build has no AVX512-BF16 (the caller then keeps the 1-row GEMMs). */
int lynx_rows_gemm(const uint16_t *x, int64_t M, int64_t K, const uint16_t *packed, int64_t N, int64_t chunk,
                   uint16_t *out) {
#ifdef LYNX_ROWS_GEMM
    int64_t n_pad = (N + 15) / 16 * 16;
    for (int64_t nb = 0; nb < n_pad; nb += 16) {
        __mmask16 live = N - nb >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (N - nb)) - 1u);
        int64_t m0 = 0;
        for (; m0 + ROWS <= M; m0 += ROWS) block(x, K, packed, nb, chunk, out, N, m0, ROWS, live);
        if (m0 < M) block(x, K, packed, nb, chunk, out, N, m0, (int)(M - m0), live);
    }
    return 0;
#else
    (void)x, (void)M, (void)K, (void)packed, (void)N, (void)chunk, (void)out;
    return 1;
#endif
}
