/* Decode attention of every input of a speculative chain in one pass over K/V, each output bit for bit what
 * this host's torch computes for that input alone (kernels/lynx_chain_sdpa.py documents why and how it is
 * checked). Built by lynx_chain_sdpa.py with -O3 -march=native -ffp-contract=off (no fused multiply-add
 * but the ones written here).
 *
 * What one decode step computes (torch 2.14 on this host, read from its machine code and checked against
 * it, never assumed): SDPA of one query row is cpu_flash_attention<bf16, q split 32, kv split 512>, so for
 * a query that sees kv keys, over blocks of 512 keys (the last one shorter; one block of kv when kv <= 512):
 *
 *   qk[j]   MKL's generic bf16 GEMV ("def" kernel; gemm(T, N) with n = 1): products k[j][d] * q[d] in fp32
 *           (exact), four partial sums a[l] = sum over d = l mod 4 in order from +0, then
 *           y = 0 + ((a[0] + a[2]) + (a[1] + a[3])), then the D mod 4 trailing products added in order
 *   s[j]    qk[j] * scale;  m = max(running max, max over the block)
 *   e[j]    exp(s[j] - m): for the first L - L mod 16 keys torch's vector fexp_u20 (below), summed in
 *           16 lanes: lanes A take the first 16 of every 32, lanes B the second 16, lanes C the one 16
 *           left before the tail; block sum = reduce((A + C) + B) (halves, quarters, pairs, neighbours);
 *           the L mod 16 tail keys: (float) glibc exp((double) x), added to the sum in order
 *   p[j]    e[j] rounded to bf16 (nearest even)
 *   sum     fmaf(expf(old max - m), sum, block sum);  dst *= expf(old max - m) on every block but the first
 *   dst[d]  MKL's generic GEMV (gemm(N, N), beta 0 on the first block, 1 after): for every 4 keys in order,
 *           dst += ((v0 p0 + v2 p2) + (v1 p1 + v3 p3)) (separate multiplies and adds); the L mod 4 last
 *           keys of the block then one at a time, LAST FIRST
 *   out[d]  bf16_rne(dst[d] * (1 / sum))
 *
 * This file does exactly that for n chain inputs at once (input i sees keys [0, S + i + 1)): the blocks of
 * 512 start at the same keys for every input, so each block of K and V is read once per KV head for all
 * the query heads of its group and all the inputs that see it. Work items (KV head, block of inputs) are
 * independent: the caller may run them on several threads. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define LYNX_CHAIN_SDPA 1
#endif

#define KV_SPLIT 512 /* torch's kv split size for a one-row query */
#define TILE 16      /* keys per tile of K or V converted to fp32 */
#define MAX_D 256

int lynx_chain_sdpa_available(void) {
#ifdef LYNX_CHAIN_SDPA
    return 1;
#else
    return 0;
#endif
}

/* A double exp the compiler cannot narrow to expf: torch's scalar tail calls glibc's double exp. */
double (*volatile lynx_chain_sdpa_exp)(double) = exp;

static inline float bf16_value(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* torch's scalar float -> bf16 (c10::BFloat16): nearest even, NaN -> 0x7fc0. */
static inline uint16_t bf16_round_scalar(float f) {
    if (f != f) return 0x7fc0;
    uint32_t u;
    memcpy(&u, &f, 4);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

#ifdef LYNX_CHAIN_SDPA
/* torch's vector float -> bf16: nearest even, NaN -> 0xffff; the 16 results in the low halves of the lanes. */
static inline __m512i bf16_round(__m512 x) {
    __m512i u = _mm512_castps_si512(x);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb), 16);
    __mmask16 ordered = _mm512_cmp_ps_mask(x, x, _CMP_ORD_Q);
    return _mm512_mask_mov_epi32(_mm512_set1_epi32(0xffff), ordered, r);
}

/* The value a bf16 rounding stands for, as fp32. */
static inline __m512 bf16_rounded_value(__m512 x) { return _mm512_castsi512_ps(_mm512_slli_epi32(bf16_round(x), 16)); }

static inline __m512 load_bf16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/* torch 2.14's Vectorized<float>::fexp_u20 as its AVX-512 build computes it (Schraudolph-style: 2^(x log2 e)
 * from a cubic correction of the fraction, written straight into the exponent bits). */
static inline __m512 fexp_u20(__m512 x) {
    const __m512 log2e = _mm512_castsi512_ps(_mm512_set1_epi32(0x3fb8aa3b));
    __mmask16 below = _mm512_cmp_ps_mask(x, _mm512_castsi512_ps(_mm512_set1_epi32((int)0xc2aeac50)), _CMP_LT_OS);
    __mmask16 above = _mm512_cmp_ps_mask(x, _mm512_castsi512_ps(_mm512_set1_epi32(0x42b17218)), _CMP_GT_OS);
    __m512 y = _mm512_mul_ps(x, log2e);
    __m512 frac = _mm512_sub_ps(y, _mm512_roundscale_ps(y, _MM_FROUND_TO_NEG_INF));
    __m512 c = _mm512_fmadd_ps(frac, _mm512_castsi512_ps(_mm512_set1_epi32((int)0xbda235d5)),
                               _mm512_castsi512_ps(_mm512_set1_epi32((int)0xbe65b8f5)));
    c = _mm512_fmadd_ps(c, frac, _mm512_castsi512_ps(_mm512_set1_epi32(0x3e9b69f0)));
    c = _mm512_fmadd_ps(frac, c, _mm512_castsi512_ps(_mm512_set1_epi32(0x38e077a1)));
    __m512 z = _mm512_fmadd_ps(_mm512_sub_ps(y, c), _mm512_set1_ps(8388608.0f), _mm512_set1_ps(1065353216.0f));
    __m512i bits = _mm512_cvttps_epi32(z);
    bits = _mm512_mask_mov_epi32(bits, below, _mm512_setzero_si512());
    bits = _mm512_mask_mov_epi32(bits, above, _mm512_set1_epi32(0x7f800000));
    return _mm512_castsi512_ps(bits);
}

/* torch's vec_reduce_all(+) of a float vector: halves, quarters, pairs, neighbours; lane 0. */
static inline float reduce_add(__m512 a) {
    a = _mm512_add_ps(a, _mm512_shuffle_f32x4(a, a, 0x4e));
    a = _mm512_add_ps(a, _mm512_shuffle_f32x4(a, a, 0xb1));
    a = _mm512_add_ps(a, _mm512_permute_ps(a, 0x4e));
    a = _mm512_add_ps(a, _mm512_permute_ps(a, 0xb1));
    return _mm512_cvtss_f32(a);
}

typedef struct {
    const uint16_t *q, *k, *v;
    uint16_t *out;
    float *lse; /* [n][H] or NULL */
    int64_t q_sn, q_sh, k_st, k_sh, v_st, v_sh, o_sn, o_sh;
    int64_t n, H, Hk, D, S, q_block;
    float scale;
} Problem;

typedef struct {
    float *q;    /* [rows][D] the queries in fp32 */
    float *s;    /* [rows][KV_SPLIT] scores of the block, then its p (bf16 values as fp32) */
    float *dst;  /* [rows][D] */
    float *max;  /* [rows] */
    float *sum;  /* [rows] */
    float *tile; /* [D][TILE] keys transposed, or [TILE][D] values */
} Scratch;

/* 16 x 16 fp32 transpose: rows a[0..15] -> columns. */
static inline void transpose16(__m512 a[16]) {
    __m512 b[16];
    for (int i = 0; i < 16; i += 2) {
        b[i] = _mm512_unpacklo_ps(a[i], a[i + 1]);
        b[i + 1] = _mm512_unpackhi_ps(a[i], a[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        a[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(b[i]), _mm512_castps_pd(b[i + 2])));
        a[i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(b[i]), _mm512_castps_pd(b[i + 2])));
        a[i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(b[i + 1]), _mm512_castps_pd(b[i + 3])));
        a[i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(b[i + 1]), _mm512_castps_pd(b[i + 3])));
    }
    for (int i = 0; i < 4; i++) {
        b[i] = _mm512_shuffle_f32x4(a[i], a[i + 4], 0x88);
        b[i + 4] = _mm512_shuffle_f32x4(a[i], a[i + 4], 0xdd);
        b[i + 8] = _mm512_shuffle_f32x4(a[i + 8], a[i + 12], 0x88);
        b[i + 12] = _mm512_shuffle_f32x4(a[i + 8], a[i + 12], 0xdd);
    }
    for (int i = 0; i < 4; i++) {
        a[i] = _mm512_shuffle_f32x4(b[i], b[i + 8], 0x88);
        a[i + 8] = _mm512_shuffle_f32x4(b[i], b[i + 8], 0xdd);
        a[i + 4] = _mm512_shuffle_f32x4(b[i + 4], b[i + 12], 0x88);
        a[i + 12] = _mm512_shuffle_f32x4(b[i + 4], b[i + 12], 0xdd);
    }
}

/* The tile of keys k[0 .. keys-1] (rows of D bf16, key stride st) as fp32 [D][TILE], missing keys zero. */
static void load_keys(Scratch *w, const uint16_t *k, int64_t st, int64_t keys, int64_t D) {
    for (int64_t d = 0; d < D; d += 16) {
        __m512 a[16];
        for (int t = 0; t < 16; t++) a[t] = t < keys ? load_bf16(k + t * st + d) : _mm512_setzero_ps();
        transpose16(a);
        for (int i = 0; i < 16; i++) _mm512_store_ps(w->tile + (d + i) * TILE, a[i]);
    }
}

/* Scores of keys j0 + t0 .. j0 + t0 + 15 for rows r0 .. r1 - 1 (the tile holds them transposed). */
static void tile_scores(const Problem *P, Scratch *w, int64_t r0, int64_t r1, int64_t t0, const int64_t *len) {
    const int64_t D = P->D;
    const __m512 scale = _mm512_set1_ps(P->scale);
    for (int64_t r = r0; r < r1; r++) {
        if (len[r] <= t0) continue;
        const float *q = w->q + r * D;
        __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (int64_t d = 0; d < D; d += 4) {
            a0 = _mm512_add_ps(a0, _mm512_mul_ps(_mm512_load_ps(w->tile + (d + 0) * TILE), _mm512_set1_ps(q[d + 0])));
            a1 = _mm512_add_ps(a1, _mm512_mul_ps(_mm512_load_ps(w->tile + (d + 1) * TILE), _mm512_set1_ps(q[d + 1])));
            a2 = _mm512_add_ps(a2, _mm512_mul_ps(_mm512_load_ps(w->tile + (d + 2) * TILE), _mm512_set1_ps(q[d + 2])));
            a3 = _mm512_add_ps(a3, _mm512_mul_ps(_mm512_load_ps(w->tile + (d + 3) * TILE), _mm512_set1_ps(q[d + 3])));
        }
        __m512 y = _mm512_add_ps(_mm512_setzero_ps(), _mm512_add_ps(_mm512_add_ps(a0, a2), _mm512_add_ps(a1, a3)));
        _mm512_storeu_ps(w->s + r * KV_SPLIT + t0, _mm512_mul_ps(y, scale));
    }
}

/* The block's softmax step for row r over its len keys: p into w->s, the running max and sum, dst rescaled. */
static void block_softmax(const Problem *P, Scratch *w, int64_t r, int64_t len, int first_block) {
    float *s = w->s + r * KV_SPLIT;
    /* the block's max (any order: it is exact; torch's NaN propagation is not reproduced, inputs are finite) */
    __m512 vmax = _mm512_set1_ps(-INFINITY);
    int64_t j = 0;
    for (; j + 16 <= len; j += 16) vmax = _mm512_max_ps(vmax, _mm512_loadu_ps(s + j));
    float m = _mm512_reduce_max_ps(vmax);
    for (; j < len; j++) m = s[j] > m ? s[j] : m;
    float old = w->max[r];
    float top = old > m ? old : m;
    if (top == -INFINITY) {
        memset(s, 0, (size_t)len * sizeof(float));
        return;
    }
    const __m512 vtop = _mm512_set1_ps(top);
    __m512 lanes_a = _mm512_setzero_ps(), lanes_b = lanes_a, lanes_c = lanes_a;
    int64_t n32 = len - len % 32, n16 = len - len % 16;
    for (j = 0; j < n32; j += 32) {
        __m512 ea = fexp_u20(_mm512_sub_ps(_mm512_loadu_ps(s + j), vtop));
        __m512 eb = fexp_u20(_mm512_sub_ps(_mm512_loadu_ps(s + j + 16), vtop));
        lanes_a = _mm512_add_ps(lanes_a, ea);
        lanes_b = _mm512_add_ps(lanes_b, eb);
        _mm512_storeu_ps(s + j, bf16_rounded_value(ea));
        _mm512_storeu_ps(s + j + 16, bf16_rounded_value(eb));
    }
    for (; j < n16; j += 16) {
        __m512 ec = fexp_u20(_mm512_sub_ps(_mm512_loadu_ps(s + j), vtop));
        lanes_c = _mm512_add_ps(lanes_c, ec);
        _mm512_storeu_ps(s + j, bf16_rounded_value(ec));
    }
    float sum = reduce_add(_mm512_add_ps(_mm512_add_ps(lanes_a, lanes_c), lanes_b));
    for (; j < len; j++) {
        float e = (float)lynx_chain_sdpa_exp((double)(s[j] - top));
        sum += e;
        s[j] = bf16_value(bf16_round_scalar(e));
    }
    float shrink = expf(old - top);
    w->sum[r] = fmaf(shrink, w->sum[r], sum);
    w->max[r] = top;
    if (!first_block) {
        const __m512 f = _mm512_set1_ps(shrink);
        float *dst = w->dst + r * P->D;
        for (int64_t d = 0; d < P->D; d += 16) _mm512_store_ps(dst + d, _mm512_mul_ps(_mm512_load_ps(dst + d), f));
    }
}

/* y[0 .. V-1] (V vectors of 16 outputs, from d) += the groups of 4 keys c .. c1 - 1 of the tile. */
#define GROUPS_OF_4(V)                                                                                   \
    for (int64_t c = 0; c < c1; c += 4) {                                                                \
        const float *v = w->tile + c * D + d;                                                            \
        const __m512 p0 = _mm512_set1_ps(p[c]), p1 = _mm512_set1_ps(p[c + 1]);                          \
        const __m512 p2 = _mm512_set1_ps(p[c + 2]), p3 = _mm512_set1_ps(p[c + 3]);                       \
        for (int u = 0; u < (V); u++) {                                                                  \
            __m512 x0 = _mm512_mul_ps(_mm512_load_ps(v + 16 * u), p0);                                   \
            __m512 x1 = _mm512_mul_ps(_mm512_load_ps(v + D + 16 * u), p1);                               \
            __m512 x2 = _mm512_mul_ps(_mm512_load_ps(v + 2 * D + 16 * u), p2);                           \
            __m512 x3 = _mm512_mul_ps(_mm512_load_ps(v + 3 * D + 16 * u), p3);                           \
            y[u] = _mm512_add_ps(y[u], _mm512_add_ps(_mm512_add_ps(x0, x2), _mm512_add_ps(x1, x3)));     \
        }                                                                                                \
    }

/* dst of rows r0 .. r1 - 1 += the groups of 4 keys of the tile (keys t0 .. t0 + 15 of the block) that lie
 * wholly inside each row's block; the tile holds the values in fp32, [TILE][D]. */
static void tile_values(const Problem *P, Scratch *w, int64_t r0, int64_t r1, int64_t t0, const int64_t *len) {
    const int64_t D = P->D;
    for (int64_t r = r0; r < r1; r++) {
        int64_t c1 = len[r] / 4 * 4 - t0; /* keys of the tile in whole groups of 4 for this row */
        if (c1 <= 0) continue;
        if (c1 > TILE) c1 = TILE;
        const float *p = w->s + r * KV_SPLIT + t0;
        float *dst = w->dst + r * D;
        int64_t d = 0;
        for (; d + 64 <= D; d += 64) {
            __m512 y[4] = {_mm512_load_ps(dst + d), _mm512_load_ps(dst + d + 16), _mm512_load_ps(dst + d + 32),
                           _mm512_load_ps(dst + d + 48)};
            GROUPS_OF_4(4)
            for (int u = 0; u < 4; u++) _mm512_store_ps(dst + d + 16 * u, y[u]);
        }
        for (; d < D; d += 16) {
            __m512 y[1] = {_mm512_load_ps(dst + d)};
            GROUPS_OF_4(1)
            _mm512_store_ps(dst + d, y[0]);
        }
    }
}

/* The keys of row r's block past its last whole group of 4, last first (values straight from bf16). */
static void block_value_tail(const Problem *P, Scratch *w, int64_t r, int64_t len, const uint16_t *v0) {
    const int64_t D = P->D;
    const float *p = w->s + r * KV_SPLIT;
    float *dst = w->dst + r * D;
    for (int64_t d = 0; d < D; d += 16) {
        __m512 y = _mm512_load_ps(dst + d);
        for (int64_t j = len - 1; j >= len / 4 * 4; j--)
            y = _mm512_add_ps(y, _mm512_mul_ps(load_bf16(v0 + j * P->v_st + d), _mm512_set1_ps(p[j])));
        _mm512_store_ps(dst + d, y);
    }
}

/* One work item: KV head g, inputs i0 .. i1 - 1, every query head of the group. Rows are input-major. */
static int run_item(const Problem *P, int64_t g, int64_t i0, int64_t i1) {
    const int64_t D = P->D, hq = P->H / P->Hk, rows = hq * (i1 - i0);
    size_t floats = (size_t)(rows * D * 2 + rows * KV_SPLIT + rows * 2 + TILE * D + 16);
    float *mem = aligned_alloc(64, (floats * sizeof(float) + 63) / 64 * 64);
    int64_t *len = malloc((size_t)rows * sizeof(int64_t));
    if (!mem || !len) {
        free(mem);
        free(len);
        return 3;
    }
    Scratch w = {mem, mem + rows * D, mem + rows * D + rows * KV_SPLIT, 0, 0, 0};
    w.max = w.dst + rows * D;
    w.sum = w.max + rows;
    w.tile = (float *)(((uintptr_t)(w.sum + rows) + 63) & ~(uintptr_t)63);
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *q = P->q + (i0 + r / hq) * P->q_sn + (g * hq + r % hq) * P->q_sh;
        for (int64_t d = 0; d < D; d++) w.q[r * D + d] = bf16_value(q[d]);
        memset(w.dst + r * D, 0, (size_t)D * sizeof(float));
        w.max[r] = -INFINITY;
        w.sum[r] = 0.0f;
    }
    const uint16_t *kg = P->k + g * P->k_sh, *vg = P->v + g * P->v_sh;
    for (int64_t j0 = 0; j0 < P->S + i1; j0 += KV_SPLIT) {
        /* inputs that see key j0: S + i + 1 > j0; their rows are the last ones */
        int64_t first = j0 - P->S > i0 ? j0 - P->S : i0, r0 = (first - i0) * hq, longest = 0;
        for (int64_t r = r0; r < rows; r++) {
            int64_t left = P->S + i0 + r / hq + 1 - j0;
            len[r] = left < KV_SPLIT ? left : KV_SPLIT;
            longest = len[r] > longest ? len[r] : longest;
        }
        for (int64_t t0 = 0; t0 < longest; t0 += TILE) {
            load_keys(&w, kg + (j0 + t0) * P->k_st, P->k_st, longest - t0 < TILE ? longest - t0 : TILE, D);
            tile_scores(P, &w, r0, rows, t0, len);
        }
        for (int64_t r = r0; r < rows; r++) block_softmax(P, &w, r, len[r], j0 == 0);
        for (int64_t t0 = 0; t0 < longest; t0 += TILE) {
            int64_t keys = longest - t0 < TILE ? longest - t0 : TILE;
            for (int64_t t = 0; t < keys; t++)
                for (int64_t d = 0; d < D; d += 16)
                    _mm512_store_ps(w.tile + t * D + d, load_bf16(vg + (j0 + t0 + t) * P->v_st + d));
            tile_values(P, &w, r0, rows, t0, len);
        }
        for (int64_t r = r0; r < rows; r++)
            if (len[r] % 4) block_value_tail(P, &w, r, len[r], vg + j0 * P->v_st);
    }
    for (int64_t r = 0; r < rows; r++) {
        float total = w.sum[r] == 0.0f ? 1.0f : w.sum[r];
        const __m512 f = _mm512_set1_ps(1.0f / total);
        int64_t i = i0 + r / hq, h = g * hq + r % hq;
        uint16_t *o = P->out + i * P->o_sn + h * P->o_sh;
        if (P->lse) P->lse[i * P->H + h] = (w.max[r] == -INFINITY ? 0.0f : w.max[r]) + logf(total);
        for (int64_t d = 0; d < D; d += 16)
            _mm256_storeu_si256((__m256i *)(o + d),
                                _mm512_cvtepi32_epi16(bf16_round(_mm512_mul_ps(_mm512_load_ps(w.dst + r * D + d), f))));
    }
    free(mem);
    free(len);
    return 0;
}
#endif

/* out[i][h] = attention of q[i][h] over keys / values [0, S + i + 1) of KV head h / (H / Hk), for the work
 * items item0 .. item1 - 1 (item = KV head * blocks + block of q_block inputs). Strides in elements; the
 * head dimension D is contiguous everywhere. lse (NULL, or [n][H] contiguous) gets torch's logsumexp,
 * max + logf(sum): the self-check compares it too (it shows the sums' order, which the bf16 outputs rarely
 * do). Returns 0; 1 without AVX-512; 2 for bad sizes; 3 out of memory. */
int lynx_chain_sdpa(const uint16_t *q, int64_t q_sn, int64_t q_sh, const uint16_t *k, int64_t k_st, int64_t k_sh,
                    const uint16_t *v, int64_t v_st, int64_t v_sh, uint16_t *out, int64_t o_sn, int64_t o_sh,
                    float *lse, int64_t n, int64_t H, int64_t Hk, int64_t D, int64_t S, float scale, int64_t q_block,
                    int64_t item0, int64_t item1) {
#ifdef LYNX_CHAIN_SDPA
    if (n < 1 || Hk < 1 || H % Hk || D < 16 || D > MAX_D || D % 16 || S < 0 || q_block < 1) return 2;
    Problem P = {q, k, v, out, lse, q_sn, q_sh, k_st, k_sh, v_st, v_sh, o_sn, o_sh, n, H, Hk, D, S, q_block, scale};
    int64_t blocks = (n + q_block - 1) / q_block;
    for (int64_t item = item0; item < item1; item++) {
        int64_t g = item / blocks, i0 = item % blocks * q_block, i1 = i0 + q_block < n ? i0 + q_block : n;
        if (g >= Hk) return 2;
        int rc = run_item(&P, g, i0, i1);
        if (rc) return rc;
    }
    return 0;
#else
    (void)q, (void)q_sn, (void)q_sh, (void)k, (void)k_st, (void)k_sh, (void)v, (void)v_st, (void)v_sh, (void)out;
    (void)o_sn, (void)o_sh, (void)lse, (void)n, (void)H, (void)Hk, (void)D, (void)S, (void)scale, (void)q_block;
    (void)item0, (void)item1;
    return 1;
#endif
}
