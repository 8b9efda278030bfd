/* Row helpers of lynx_cpu_fast.c: exact dtype conversions, fp16 floor, min / max, code computation.
 * Written so gcc vectorises them (plain loops over rows), and with F16C + AVX2 intrinsics where gcc 12
 * does not vectorise (float <-> fp16 conversions); the scalar fallback computes the same bits.
 * fp16 streams are little-endian bytes (the stream format), read and written through byte pointers. */
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__F16C__) && defined(__AVX2__)
#include <immintrin.h>
#define LYNX_F16C 1
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__)
#define LYNX_AVX512 1
#endif

enum { DT_F32 = 0, DT_BF16 = 1, DT_F16 = 2 };

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even (finite inputs) */
    uint32_t u;
    memcpy(&u, &f, 4);
    u += ((u >> 16) & 1u) + 0x7FFFu;
    return (uint16_t)(u >> 16);
}

static inline uint16_t h_bits(_Float16 h) {
    uint16_t b;
    memcpy(&b, &h, 2);
    return b;
}

static inline _Float16 h_from_bits(uint16_t b) {
    _Float16 h;
    memcpy(&h, &b, 2);
    return h;
}

static inline uint16_t get_u16(const uint8_t *p, int64_t i) { return (uint16_t)(p[2 * i] | (p[2 * i + 1] << 8)); }

static inline void put_u16(uint8_t *p, int64_t i, uint16_t b) {
    p[2 * i] = (uint8_t)(b & 0xFF);
    p[2 * i + 1] = (uint8_t)(b >> 8);
}

/* out[i] = float of the fp16 bits at src (exact) */
static void f16_to_f32_row(const uint8_t *restrict src, float *restrict out, int64_t n) {
    int64_t i = 0;
#ifdef LYNX_F16C
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128((const void *)(src + 2 * i))));
#endif
    for (; i < n; i++) out[i] = (float)h_from_bits(get_u16(src, i));
}

/* fp16 bits of x rounded to nearest even, to dst */
static void f32_to_f16_row(const float *restrict x, uint8_t *restrict dst, int64_t n) {
    int64_t i = 0;
#ifdef LYNX_F16C
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((void *)(dst + 2 * i), _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT));
#endif
    for (; i < n; i++) put_u16(dst, i, h_bits((_Float16)x[i]));
}

/* bits of the largest fp16 <= x (quant_math.fp16_floor: the nearest fp16, one step down when above x) */
static inline uint16_t fp16_floor_bits(float x) {
    _Float16 h = (_Float16)x;
    uint16_t b = h_bits(h);
    uint16_t down = (b & 0x7FFFu) == 0 ? 0x8001u : (uint16_t)(b & 0x8000u ? b + 1u : b - 1u);
    return (float)h > x ? down : b;
}

/* fp16_floor of x[0..n): bits to dst, their float values to val */
static void fp16_floor_row(const float *restrict x, int64_t n, uint8_t *restrict dst, float *restrict val) {
    int64_t i = 0;
#ifdef LYNX_F16C
    const __m128i one = _mm_set1_epi16(1), mag = _mm_set1_epi16(0x7FFF), tiny = _mm_set1_epi16((short)0x8001);
    for (; i + 8 <= n; i += 8) {
        __m256 xv = _mm256_loadu_ps(x + i);
        __m128i b = _mm256_cvtps_ph(xv, _MM_FROUND_TO_NEAREST_INT);
        __m256i gt = _mm256_castps_si256(_mm256_cmp_ps(_mm256_cvtph_ps(b), xv, _CMP_GT_OQ));
        __m128i above = _mm_packs_epi32(_mm256_castsi256_si128(gt), _mm256_extracti128_si256(gt, 1));
        __m128i sign = _mm_srai_epi16(b, 15); /* -1 when negative: one step down is b + 1, else b - 1 */
        __m128i down = _mm_sub_epi16(_mm_sub_epi16(_mm_sub_epi16(b, one), sign), sign);
        down = _mm_blendv_epi8(down, tiny, _mm_cmpeq_epi16(_mm_and_si128(b, mag), _mm_setzero_si128()));
        b = _mm_blendv_epi8(b, down, above);
        _mm_storeu_si128((void *)(dst + 2 * i), b);
        _mm256_storeu_ps(val + i, _mm256_cvtph_ps(b));
    }
#endif
    for (; i < n; i++) {
        uint16_t b = fp16_floor_bits(x[i]);
        put_u16(dst, i, b);
        val[i] = (float)h_from_bits(b);
    }
}

/* n groups with statistics lo, hi: mn = fp16_floor(lo) and rng = fp16_ceil(hi - mn) bits to mn_b /
 * rng_b, float mn to mn, the safe range (rng, or 1 when rng == 0) to rs; d is n floats of scratch */
static void group_meta(const float *restrict lo, const float *restrict hi, int64_t n, uint8_t *restrict mn_b,
                       uint8_t *restrict rng_b, float *restrict mn, float *restrict rs, float *restrict d) {
    fp16_floor_row(lo, n, mn_b, mn);
    for (int64_t j = 0; j < n; j++) d[j] = -(hi[j] - mn[j]);
    fp16_floor_row(d, n, rng_b, rs); /* fp16_ceil(y) = -fp16_floor(-y): flip the sign bit */
    for (int64_t j = 0; j < n; j++) rng_b[2 * j + 1] ^= 0x80u;
    for (int64_t j = 0; j < n; j++) rs[j] = -rs[j] > 0.0f ? -rs[j] : 1.0f;
}

typedef float f8 __attribute__((vector_size(32)));
typedef int32_t i8 __attribute__((vector_size(32)));

static inline f8 vsel(i8 m, f8 a, f8 b) { return (f8)(((i8)a & m) | ((i8)b & ~m)); }

/* Min and max of x[0..n) exactly as the sequential `v < l ? v : l` scan gives them. The lanes below
 * visit the values in another order, which yields the same number; only the sign of a zero result can
 * depend on the order (-0 == +0), so a zero result is recomputed by the sequential scan. */
static inline void minmax(const float *restrict x, int64_t n, float *lo, float *hi) {
    float l = x[0], h = x[0];
#ifdef LYNX_AVX512
    if (n % 16 == 0) {
        __m512 lv = _mm512_loadu_ps(x), hv = lv;
        for (int64_t k = 16; k < n; k += 16) {
            __m512 v = _mm512_loadu_ps(x + k);
            lv = _mm512_min_ps(v, lv), hv = _mm512_max_ps(v, hv);
        }
        l = _mm512_reduce_min_ps(lv), h = _mm512_reduce_max_ps(hv);
        if (l != 0.0f && h != 0.0f) {
            *lo = l, *hi = h;
            return;
        }
        l = h = x[0];
    }
#endif
    if (n % 8 == 0) {
        f8 lv, hv, v;
        memcpy(&lv, x, sizeof lv);
        hv = lv;
        for (int64_t k = 8; k < n; k += 8) {
            memcpy(&v, x + k, sizeof v);
            lv = vsel(v < lv, v, lv), hv = vsel(v > hv, v, hv);
        }
        for (int q = 0; q < 8; q++) {
            l = lv[q] < l ? lv[q] : l;
            h = hv[q] > h ? hv[q] : h;
        }
        if (l != 0.0f && h != 0.0f) {
            *lo = l, *hi = h;
            return;
        }
        l = h = x[0];
    }
    for (int64_t k = 1; k < n; k++) {
        l = x[k] < l ? x[k] : l;
        h = x[k] > h ? x[k] : h;
    }
    *lo = l, *hi = h;
}

/* anchor and biased residual nibbles of a row of n values with per-value fp16 min and safe range.
 * u is in [0, 1] (x finite, rs > 0), so ceil(15 u - 0.5) is in [0, 15] and ceil(225 u - 0.5) in
 * [0, 225] already: the reference's clamps of a and f change nothing and are left out. */
static void code_row(const float *restrict x, const float *restrict mn, const float *restrict rs, int64_t n,
                     uint8_t *restrict a_out, uint8_t *restrict r_out) {
    int64_t j0 = 0;
#ifdef LYNX_AVX512 /* the loop below, 16 values at a time: max(0, u) is `u < 0 ? 0 : u` exactly, etc. */
    const __m512 zero = _mm512_setzero_ps(), one = _mm512_set1_ps(1.0f), half = _mm512_set1_ps(0.5f);
    const __m512 l15 = _mm512_set1_ps(15.0f), l225 = _mm512_set1_ps(225.0f), b7 = _mm512_set1_ps(7.0f);
    const __m512 m7 = _mm512_set1_ps(-7.0f);
    for (; j0 + 16 <= n; j0 += 16) {
        __m512 u = _mm512_div_ps(_mm512_sub_ps(_mm512_loadu_ps(x + j0), _mm512_loadu_ps(mn + j0)),
                                 _mm512_loadu_ps(rs + j0));
        u = _mm512_min_ps(one, _mm512_max_ps(zero, u));
        __m512 a = _mm512_roundscale_ps(_mm512_sub_ps(_mm512_mul_ps(u, l15), half), _MM_FROUND_TO_POS_INF);
        __m512 f = _mm512_roundscale_ps(_mm512_sub_ps(_mm512_mul_ps(u, l225), half), _MM_FROUND_TO_POS_INF);
        __m512 r = _mm512_min_ps(b7, _mm512_max_ps(m7, _mm512_sub_ps(f, _mm512_mul_ps(a, l15))));
        __m512i ai = _mm512_cvttps_epi32(a), ri = _mm512_cvttps_epi32(_mm512_add_ps(r, b7));
        /* value 2i + 1 sits in the high half of 64-bit lane i: the lane's low byte becomes code 2i | 2i+1 << 4 */
        ai = _mm512_or_si512(ai, _mm512_srli_epi64(ai, 28)), ri = _mm512_or_si512(ri, _mm512_srli_epi64(ri, 28));
        _mm_storel_epi64((void *)(a_out + j0 / 2), _mm512_cvtepi64_epi8(ai));
        _mm_storel_epi64((void *)(r_out + j0 / 2), _mm512_cvtepi64_epi8(ri));
    }
#endif
    int32_t ta[n], tr[n];
    for (int64_t j = j0; j < n; j++) {
        float u = (x[j] - mn[j]) / rs[j];
        u = u < 0.0f ? 0.0f : u;
        u = u > 1.0f ? 1.0f : u;
        float a = ceilf(u * 15.0f - 0.5f);
        float f = ceilf(u * 225.0f - 0.5f);
        float r = f - a * 15.0f;
        r = r < -7.0f ? -7.0f : r;
        r = r > 7.0f ? 7.0f : r;
        ta[j] = (int32_t)a;
        tr[j] = (int32_t)(r + 7.0f);
    }
    for (int64_t i = j0 / 2; i < n / 2; i++) {
        a_out[i] = (uint8_t)(ta[2 * i] | (ta[2 * i + 1] << 4));
        r_out[i] = (uint8_t)(tr[2 * i] | (tr[2 * i + 1] << 4));
    }
}

/* float32 copy of n values of x (dtype); returns 0 when all are finite, 1 otherwise */
static int load_values(const void *x, int dtype, int64_t n, float *restrict out) {
    uint32_t bad = 0;
    if (dtype == DT_F32) {
        const uint32_t *bits = (const uint32_t *)out;
        memcpy(out, x, (size_t)n * 4);
        for (int64_t i = 0; i < n; i++) bad |= (bits[i] & 0x7F800000u) == 0x7F800000u;
    } else if (dtype == DT_BF16) {
        const uint16_t *src = (const uint16_t *)x;
        uint32_t *bits = (uint32_t *)out;
        for (int64_t i = 0; i < n; i++) bits[i] = (uint32_t)src[i] << 16;
        for (int64_t i = 0; i < n; i++) bad |= (src[i] & 0x7F80u) == 0x7F80u;
    } else {
        const uint16_t *src = (const uint16_t *)x;
        f16_to_f32_row((const uint8_t *)x, out, n);
        for (int64_t i = 0; i < n; i++) bad |= (src[i] & 0x7C00u) == 0x7C00u;
    }
    return bad ? 1 : 0;
}
