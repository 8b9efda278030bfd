/* CPU fast path of the lynx-exact stream's transform (python/sglang_lynx/codec/exact_bins.py and
 * lynx_exact.py document it): the bin (L, n) of every value from a layer's lynx anchor + residual, the
 * ranks split into the rank classes (encode), and the BF16 bits back from bins + ranks (decode). zstd
 * stays in Python (the zstandard package). Built by lynx_exact_cpu.py with -O3 -march=native
 * -ffp-contract=off -fno-trapping-math (no FMA contraction, no flush-to-zero); tested against the reference.
 *
 * One pass per layer and direction, row by row (a row: one token's heads x dim values), so the bins never
 * leave the L1 cache: encode = bins + rank + class + per-class compaction of the ranks (then bit packing,
 * lynx_exact_pack_bits); decode = bit unpacking (lynx_exact_unpack_bits), then bins + class + per-class
 * expansion of the ranks. With AVX-512 the compaction / expansion runs 16 values at a time (compress /
 * expand per class, no per-value cursor in memory); without it, the same order value by value.
 *
 * Threads (the `threads` argument, pthreads, the same output for any count): encode gives each worker a run of
 * rows (its ranks and escapes written apart, joined in row order after); in decode each worker takes the next
 * chunk of rows, computes its bins into a buffer while the chunk before is expanded, then expands its own from
 * where that one's ranks end (see decode_worker).
 *
 * Each bin boundary lower(c) comes from a float guess checked by error bounds and one evaluation of the
 * encoder's own float32 code (fast_lower: its proof there); where the bounds cannot decide (about 0.1% of the
 * boundaries of real KV, codes outside 1..225, rng <= 0) the window search decides: it compares without
 * dividing (see threshold), the same outcome as the reference's float32 `(v - mn) / rs < th`, exactly, and
 * probes 3 ordinals of each 5-ordinal window (see lower_bound); lynx_exact_fallbacks counts those. Built with
 * -DLYNX_EXACT_SCALAR, the library takes the value-by-value path (the tests compare both with the reference). */
#include <float.h>
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__) && defined(__AVX512DQ__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    !defined(LYNX_EXACT_SCALAR)
#include <immintrin.h>
#define LYNX_EXACT_VECTOR 1
#endif

#define WINDOW 2
#define ORD_MIN_FINITE 0x0080
#define ORD_MAX_FINITE 0xFF7F
#define MAX_CLASSES 16
#define LANES 16 /* values per vector */
#define SLACK 32 /* rank / escape arrays must hold this many entries past their last one (32 ranks per store) */
#define SLACK8 64 /* the decode's rank arrays: entries readable past their last one (64 byte ranks per load) */
#define CODE_LO (-8) /* codes a corrupt residual can spell: 15 a + r - 7 with a, r in 0..15 */
#define CODE_HI 241
#define CODES (CODE_HI - CODE_LO + 1)

int lynx_exact_vector(void) {
#ifdef LYNX_EXACT_VECTOR
    return 1;
#else
    return 0;
#endif
}

static inline float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF, bits;
    if (exp == 0) {
        float v = (float)man * 5.9604644775390625e-08f; /* 2^-24: subnormal (exact) */
        memcpy(&bits, &v, 4);
        bits |= sign;
    } else if (exp == 31) {
        bits = sign | 0x7F800000u | (man << 13);
    } else {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    }
    float out;
    memcpy(&out, &bits, 4);
    return out;
}

static inline int32_t ord_of(uint32_t b) { return b < 0x8000 ? (int32_t)b + 0x8000 : 0xFFFF - (int32_t)b; }
static inline uint32_t bits_of(int32_t o) { return o >= 0x8000 ? (uint32_t)(o - 0x8000) : (uint32_t)(0xFFFF - o); }

static inline __attribute__((always_inline)) float val_of(int32_t o) {
    o = o < ORD_MIN_FINITE ? ORD_MIN_FINITE : (o > ORD_MAX_FINITE ? ORD_MAX_FINITE : o);
    uint32_t b = bits_of(o) << 16;
    float f;
    memcpy(&f, &b, 4);
    return f;
}

static inline __attribute__((always_inline)) int32_t nearest_ord(double t) {
    float f = (float)t;
    f = f < -3.0e38f ? -3.0e38f : (f > 3.0e38f ? 3.0e38f : f);
    uint32_t b;
    memcpy(&b, &f, 4);
    return ord_of((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16);
}

/* The lynx full code of a value v of a group (mn, rng), as the reference's exact_bins.code_of computes it in
 * float32, is code_of_u(clamp((v - mn) / rs, 0, 1)) with rs = rng > 0 ? rng : 1. */
static inline int32_t code_of_u(float u) {
    float a = ceilf(u * 15.0f - 0.5f);
    a = a < 0.0f ? 0.0f : (a > 15.0f ? 15.0f : a);
    float f = ceilf(u * 225.0f - 0.5f);
    f = f < 0.0f ? 0.0f : (f > 225.0f ? 225.0f : f);
    float d = f - a * 15.0f;
    d = d < -7.0f ? -7.0f : (d > 7.0f ? 7.0f : d);
    return (int32_t)(d + a * 15.0f);
}

/* Per code c (index c - CODE_LO; a valid stream holds 0..225 and asks for c + 1 too):
 * UTH[c] = the least float u in [0, 1] with code_of_u(u) >= c (FLT_MAX when none). code_of_u is
 * non-decreasing in u (a and f are, and 15 a + clamp(f - 15 a, -7, 7) = clamp(f, 15 a - 7, 15 a + 7) grows
 * with both), so for c >= 1 "the code of v < c" is exactly "q < UTH[c]" with q = (v - mn) / rs unclamped: q < 0
 * gives u = 0 and code 0 < c, and q > 1 gives code 225 >= c when c <= 225 (then UTH[c] <= 1 < q). Only
 * c >= 1 is asked where the result is used (lower(0) is replaced by cap_lo). Non-negative floats are
 * ordered as their bit patterns, so a binary search over the patterns of [0, 1] finds each UTH[c].
 * The reference's estimate uses (c - 0.5) / 225.0 in double; (c - 0.5) * (1 / 225.0) rounds the same for
 * every code except a few, which init_tables finds (EXC_*) and t225 substitutes: no division per value. */
#define T225_EXCEPTIONS 4

/* "code_of_u(clamp(u, 0, 1)) < c" for c in 1..225 and any float u, in one multiply: float32 (u * 225) <= B[c], with
 * B[c] = c - 0.5 except for the codes in B_CODE (init_tables finds them: one, c = 8, where the anchor clamp of
 * code_of_u decides at u = 0x1.111112p-5; there B[c] = float32 (u' * 225) for u' the float just below UTH[c]).
 * Both sides are non-decreasing in u; on [0, 1] they switch at the same float for every such c (init_tables
 * checks it against UTH: the self-check fails otherwise), below 0 both are true (u * 225 <= 0 < B[c]) and above 1
 * both false (u * 225 >= 225 > B[c], and code_of_u(1) = 225 >= c). */
#define B_EXCEPTIONS 1
static int32_t B_CODE[B_EXCEPTIONS] = {INT32_MIN};
static float B_VALUE[B_EXCEPTIONS];

static inline __attribute__((always_inline)) float b225_of(int32_t c) {
    float b = (float)c - 0.5f;
#pragma GCC unroll 1
    for (int k = 0; k < B_EXCEPTIONS; k++) b = c == B_CODE[k] ? B_VALUE[k] : b;
    return b;
}

static inline __attribute__((always_inline)) int below225(float u, int32_t c) { return u * 225.0f <= b225_of(c); }

/* The least float in [0, 1] where below225(., c) is false (0x3F800001 when none). */
static uint32_t below225_switch(int32_t c) {
    uint32_t lo = 0, hi = 0x3F800001u;
    while (lo < hi) {
        uint32_t mid = lo + (hi - lo) / 2;
        float u;
        memcpy(&u, &mid, 4);
        if (!below225(u, c)) hi = mid; else lo = mid + 1;
    }
    return lo;
}
static int32_t EXC_CODE[T225_EXCEPTIONS];
static double EXC_T225[T225_EXCEPTIONS];
#define UTH_CHUNKS ((CODES + 31) / 32)
static float UTH[32 * UTH_CHUNKS]; /* CODES entries, zero padded to whole 32-entry chunks (the vector permutes) */
static float UTH_OFF; /* >= max over codes 1..225 of |UTH[c] - (c - 0.5) / 225| (fast_lower's error bound) */
static int tables_ready, tables_ok;

static inline __attribute__((always_inline)) double t225_of(int32_t c) {
    double t = ((double)c - 0.5) * (1.0 / 225.0);
#pragma GCC unroll 4
    for (int k = 0; k < T225_EXCEPTIONS; k++) t = c == EXC_CODE[k] ? EXC_T225[k] : t;
    return t;
}

static void init_tables(void) {
    if (tables_ready) return;
    int found = 0;
    for (int k = 0; k < T225_EXCEPTIONS; k++) EXC_CODE[k] = INT32_MIN, EXC_T225[k] = 0.0;
    for (int i = 0; i < CODES; i++) {
        int c = i + CODE_LO;
        uint32_t lo = 0, hi = 0x3F800000u; /* 0.0f .. 1.0f */
        float one = 1.0f, th;
        if (code_of_u(one) < c) {
            th = FLT_MAX;
        } else {
            while (lo < hi) { /* least pattern in [lo, hi] whose code is >= c */
                uint32_t mid = lo + (hi - lo) / 2;
                float u;
                memcpy(&u, &mid, 4);
                if (code_of_u(u) >= c) hi = mid; else lo = mid + 1;
            }
            memcpy(&th, &lo, 4);
        }
        UTH[i] = th;
        double quotient = ((double)c - 0.5) / 225.0;
        if (((double)c - 0.5) * (1.0 / 225.0) == quotient) continue;
        if (found < T225_EXCEPTIONS) EXC_CODE[found] = c, EXC_T225[found] = quotient;
        found++;
    }
    int b_found = 0; /* fast_lower's test (below225): the same switch as code_of_u for every code 1..225 */
    for (int k = 0; k < B_EXCEPTIONS; k++) B_CODE[k] = INT32_MIN;
    for (int c = 1; c <= 225 && found <= T225_EXCEPTIONS; c++) {
        uint32_t th_bits;
        memcpy(&th_bits, &UTH[c - CODE_LO], 4);
        if (below225_switch(c) == th_bits) continue;
        if (b_found == B_EXCEPTIONS || th_bits == 0u) {
            found = T225_EXCEPTIONS + 1; /* the self-check fails */
            break;
        }
        uint32_t prev_bits = th_bits - 1u;
        float prev;
        memcpy(&prev, &prev_bits, 4);
        B_CODE[b_found] = c, B_VALUE[b_found] = prev * 225.0f;
        b_found++;
        if (below225_switch(c) != th_bits) found = T225_EXCEPTIONS + 1;
    }
    double off = 0.0;
    for (int c = 1; c <= 225; c++) off = fmax(off, fabs((double)UTH[c - CODE_LO] - ((double)c - 0.5) / 225.0));
    UTH_OFF = (float)(off * 1.001) + 0x1p-40f; /* rounded up */
    tables_ok = found <= T225_EXCEPTIONS;
    tables_ready = 1; /* idempotent: a race writes the same values */
}

/* 1 when the tables hold (the loader refuses the library otherwise): every code's t225 equals the
 * reference's quotient. */
int lynx_exact_self_check(void) {
    init_tables();
    for (int c = CODE_LO; tables_ok && c <= CODE_HI; c++) tables_ok = t225_of(c) == ((double)c - 0.5) / 225.0;
    return tables_ok;
}

/* "float32 ((v - mn) / rs) < th" without the division, exactly: with z = x / rs (x = v - mn, a float) taken
 * exactly, the float quotient RN(z) is < th iff RN(z) <= p, p the float just below th, iff z < m = (p + th) / 2,
 * or z == m and the tie rounds to p (p's significand even). z < m iff x < m rs (rs > 0), and m rs is exact
 * in double (m has at most 26 significant bits, rs 11: it is an fp16). x is a float, so "x < m rs" is
 * "x < the least float >= m rs", and "x <= m rs" (the tie) is "x < the least float > m rs": threshold()
 * returns that float Q, and each probe of the window is one float subtraction and one comparison. */
static inline __attribute__((always_inline)) float threshold(float th, double rs) {
    uint32_t tb;
    memcpy(&tb, &th, 4);
    uint32_t pb = tb == 0u ? 0x80000001u : tb - 1u; /* p, the float just below th (th >= 0) */
    float p;
    memcpy(&p, &pb, 4);
    double m_rs = ((double)p * 0.5 + (double)th * 0.5) * rs; /* both products exact */
    float f = (float)m_rs;
    double fd = (double)f;
    int32_t up = (pb & 1u) == 0u ? fd <= m_rs : fd < m_rs;
    uint32_t b;
    memcpy(&b, &f, 4);
    b = b == 0x80000000u ? 0u : b; /* -0: its successor is the least positive float */
    b += up ? (f >= 0.0f ? 1u : 0xFFFFFFFFu) : 0u;
    memcpy(&f, &b, 4);
    return f;
}

static inline __attribute__((always_inline)) int32_t below_boundary(float v, float mn, float q) { return (v - mn) < q; }

/* lower(f): est - WINDOW + (ordinals of the window est - WINDOW .. est + WINDOW whose code is < f). The code
 * is non-decreasing in the ordinal, so the window's "below" flags are a run of ones then zeros: est tells on
 * which side the boundary lies, and two more ordinals on that side give the same count. */
static inline __attribute__((always_inline)) int32_t lower_bound(int32_t code, float mn, float rng, double rs) {
    int32_t c = code < CODE_LO ? CODE_LO : (code > CODE_HI ? CODE_HI : code);
    int32_t est = nearest_ord((double)mn + (double)rng * t225_of(c));
    float q = threshold(UTH[c - CODE_LO], rs);
    int32_t b0 = below_boundary(val_of(est), mn, q);
    int32_t o1 = b0 ? est + 1 : est - 1, o2 = b0 ? est + 2 : est - 2;
    int32_t b1 = below_boundary(val_of(o1), mn, q), b2 = below_boundary(val_of(o2), mn, q);
    int32_t below = b0 ? 3 + b1 + (b1 & b2) : (b1 ? 2 : b2);
    return est - WINDOW + below;
}

/* lower(c) without the threshold: the fast path of every bound, the window search (lower_bound) its fallback.
 *
 * For c in 1..225 and rng > 0 (so rs = rng), "below" (the code of v is < c) is "q(v) < T" with
 * q(v) = fl(fl(v - mn) / rs) and T = UTH[c] in (0, 1] (see UTH). Let b = mn + rs T (real). With a relative error
 * of at most 2^-24 per float operation (fl(v - mn) is exact where subnormal; q is normal near T >= 1 / 450):
 *   v <= b - rs T 2^-22  =>  q < T (below),   v >= b + rs T 2^-21  =>  q >= T (not below).
 * The float guess e = fl(mn + y), y = fl(rng * t), t = fl(fl(c - 0.5) * fl(1 / 225)), is within
 * rs t_c 2^-22 + 2^-24 |e| of mn + rs t_c (t_c = (c - 0.5) / 225), and b within rs UTH_OFF of that. So every
 * float v <= e - eps is below and every v >= e + eps is not, for
 *   eps = rs (1.01 UTH_OFF + 2^-20 t) + 2^-23 |e|
 * (T <= t_c + UTH_OFF; the float rounding of eps and t stays inside the margins). The pass compares with
 * lo = fl(e - 2 eps) and hi = fl(e + 2 eps), which round by at most 2^-24 (|e| + 2 eps) < eps: lo < e - eps,
 * hi > e + eps. est = the bf16 nearest e; p, v0, n = the values of est - 1, est, est + 1. When p <= lo and
 * hi <= n, est - 1 is below and est + 1 is not, so the first ordinal that is not below is B = est + below(est),
 * and below(est) is decided exactly by the encoder's own float32 arithmetic (code_of_u of the clamped
 * quotient < c: the reference's code_of; e often falls on a bf16 value, mn and rng being fp16 and
 * (c - 0.5) / 225 often a short fraction). The reference's estimate e' (double, within eps of e) lies in
 * (p, n), so its nearest bf16 est' is within one of est (the two zeros included: +0 has p = -0 <= lo < e, so
 * e > 0 and est' is +0 or n), B lies in its window est' - 2 .. est' + 3 and the window search returns B too.
 * Anything else (a bf16 neighbour within 2 eps of e, a code outside 1..225, rng <= 0): *ok = 0, the caller
 * runs lower_bound. group_eps2 is the rs part of 2 eps that does not depend on the code. */
static inline float group_eps2(float rng) { return 2.02f * rng * UTH_OFF; }

static inline __attribute__((always_inline)) int32_t fast_lower(int32_t c, float mn, float rng, float eps2_g, int *ok) {
    float y = rng * (((float)c - 0.5f) * (1.0f / 225.0f)), e = mn + y;
    float eps2 = eps2_g + y * 0x1p-19f + fabsf(e) * 0x1p-22f;
    uint32_t b;
    memcpy(&b, &e, 4);
    int32_t est = ord_of(((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16) & 0xFFFFu);
    float p = val_of(est - 1), v0 = val_of(est), n = val_of(est + 1), rs = rng > 0.0f ? rng : 1.0f;
    *ok = c >= 1 && c <= 225 && rng > 0.0f && p <= e - eps2 && e + eps2 <= n;
    return est + below225((v0 - mn) / rs, c); /* below(est): code_of_u of the clamped quotient < c, see below225 */
}

/* Fallbacks to the window search, summed over every call (lynx_exact_fallbacks): the tests and the benchmark
 * read it; a run's count is added once at its end. */
static int64_t fallbacks_total;

int64_t lynx_exact_fallbacks(void) { return __atomic_load_n(&fallbacks_total, __ATOMIC_RELAXED); }

/* (cap_lo, cap_hi) of a group: first ordinal whose value is >= mn, last whose value is <= mn + rng. */
static inline void group_caps(float mn, float rng, int32_t *cap_lo_out, int32_t *cap_hi_out) {
    double lo = (double)mn, hi = (double)mn + (double)rng;
    int32_t elo = nearest_ord(lo), ehi = nearest_ord(hi), cap_lo = elo - WINDOW, cap_hi = ehi - WINDOW;
    for (int k = -WINDOW; k <= WINDOW; k++) {
        cap_lo += (double)val_of(elo + k) < lo;
        cap_hi += (double)val_of(ehi + k) <= hi;
    }
    *cap_lo_out = cap_lo;
    *cap_hi_out = cap_hi - 1;
}

#ifdef LYNX_EXACT_VECTOR
/* The bin search of 16 values at a time: every step of lower_bound / threshold / val_of / nearest_ord above,
 * lane by lane, with the same roundings (double halves of 8 lanes where the scalar code computes in double;
 * separate multiply and add, no FMA) and the same outcome for NaN and Inf metadata (ordered comparisons, the
 * clamps written so that a NaN passes through as in the scalar ternaries). No gathers (slow on some cores):
 * t225 as t225_of computes it (the multiply, the exception codes blended in), UTH by register permutes. */
typedef struct {
    __m512d lo, hi;
} Doubles16;

static inline __attribute__((always_inline)) Doubles16 widen16(__m512 x) {
    return (Doubles16){_mm512_cvtps_pd(_mm512_castps512_ps256(x)), _mm512_cvtps_pd(_mm512_extractf32x8_ps(x, 1))};
}

static inline __attribute__((always_inline)) __m512 narrow16(Doubles16 x) {
    return _mm512_insertf32x8(_mm512_castps256_ps512(_mm512_cvtpd_ps(x.lo)), _mm512_cvtpd_ps(x.hi), 1);
}

static inline __attribute__((always_inline)) __mmask16 join_masks(__mmask8 lo, __mmask8 hi) {
    return (__mmask16)((unsigned)lo | ((unsigned)hi << 8));
}

static inline __attribute__((always_inline)) __m512i ord_of16(__m512i b) {
    __mmask16 low = _mm512_cmplt_epu32_mask(b, _mm512_set1_epi32(0x8000));
    return _mm512_mask_blend_epi32(low, _mm512_sub_epi32(_mm512_set1_epi32(0xFFFF), b),
                                   _mm512_add_epi32(b, _mm512_set1_epi32(0x8000)));
}

static inline __attribute__((always_inline)) __m512i bits_of16(__m512i o) {
    __mmask16 high = _mm512_cmpge_epi32_mask(o, _mm512_set1_epi32(0x8000));
    return _mm512_mask_blend_epi32(high, _mm512_sub_epi32(_mm512_set1_epi32(0xFFFF), o),
                                   _mm512_sub_epi32(o, _mm512_set1_epi32(0x8000)));
}

static inline __attribute__((always_inline)) __m512 val_of16(__m512i o) {
    o = _mm512_min_epi32(_mm512_max_epi32(o, _mm512_set1_epi32(ORD_MIN_FINITE)), _mm512_set1_epi32(ORD_MAX_FINITE));
    return _mm512_castsi512_ps(_mm512_slli_epi32(bits_of16(o), 16));
}

static inline __attribute__((always_inline)) __m512i nearest_ord16(Doubles16 t) {
    /* constant first: max_ps / min_ps return their second operand for a NaN, as the scalar ternaries do */
    __m512 f = _mm512_min_ps(_mm512_set1_ps(3.0e38f), _mm512_max_ps(_mm512_set1_ps(-3.0e38f), narrow16(t)));
    __m512i b = _mm512_castps_si512(f);
    __m512i odd = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
    return ord_of16(_mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(b, _mm512_set1_epi32(0x7FFF)), odd), 16));
}

static inline __attribute__((always_inline)) __m512 threshold16(__m512 th, Doubles16 rs) {
    __m512i tb = _mm512_castps_si512(th);
    __m512i pb = _mm512_mask_blend_epi32(_mm512_cmpeq_epi32_mask(tb, _mm512_setzero_si512()),
                                         _mm512_sub_epi32(tb, _mm512_set1_epi32(1)), _mm512_set1_epi32((int32_t)0x80000001u));
    Doubles16 p = widen16(_mm512_castsi512_ps(pb)), t = widen16(th), m_rs;
    const __m512d half = _mm512_set1_pd(0.5);
    m_rs.lo = _mm512_mul_pd(_mm512_add_pd(_mm512_mul_pd(p.lo, half), _mm512_mul_pd(t.lo, half)), rs.lo);
    m_rs.hi = _mm512_mul_pd(_mm512_add_pd(_mm512_mul_pd(p.hi, half), _mm512_mul_pd(t.hi, half)), rs.hi);
    __m512 f = narrow16(m_rs);
    Doubles16 fd = widen16(f);
    __mmask16 le = join_masks(_mm512_cmp_pd_mask(fd.lo, m_rs.lo, _CMP_LE_OQ), _mm512_cmp_pd_mask(fd.hi, m_rs.hi, _CMP_LE_OQ));
    __mmask16 lt = join_masks(_mm512_cmp_pd_mask(fd.lo, m_rs.lo, _CMP_LT_OQ), _mm512_cmp_pd_mask(fd.hi, m_rs.hi, _CMP_LT_OQ));
    __mmask16 even = _mm512_testn_epi32_mask(pb, _mm512_set1_epi32(1));
    __mmask16 up = (__mmask16)((even & le) | (~even & lt));
    __m512i b = _mm512_castps_si512(f);
    b = _mm512_mask_mov_epi32(b, _mm512_cmpeq_epi32_mask(b, _mm512_set1_epi32((int32_t)0x80000000u)), _mm512_setzero_si512());
    __m512i step = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(f, _mm512_setzero_ps(), _CMP_GE_OQ), _mm512_set1_epi32(-1),
                                           _mm512_set1_epi32(1));
    return _mm512_castsi512_ps(_mm512_mask_add_epi32(b, up, b, step));
}

/* UTH[idx] for 16 lanes from register permutes (a gather costs more on some cores): 32 entries per permute. */
static inline __attribute__((always_inline)) __m512 uth16(__m512i idx) {
    __m512 r = _mm512_permutex2var_ps(_mm512_loadu_ps(UTH), idx, _mm512_loadu_ps(UTH + 16));
    __m512i chunk = _mm512_srli_epi32(idx, 5);
#pragma GCC unroll 8
    for (int k = 1; k < UTH_CHUNKS; k++)
        r = _mm512_mask_mov_ps(r, _mm512_cmpeq_epi32_mask(chunk, _mm512_set1_epi32(k)),
                               _mm512_permutex2var_ps(_mm512_loadu_ps(UTH + 32 * k), idx,
                                                      _mm512_loadu_ps(UTH + 32 * k + 16)));
    return r;
}

static inline __attribute__((always_inline)) __mmask16 below16(__m512i o, __m512 mn, __m512 q) {
    return _mm512_cmp_ps_mask(_mm512_sub_ps(val_of16(o), mn), q, _CMP_LT_OQ);
}

static inline __attribute__((always_inline)) __m512i lower_bound16(__m512i code, __m512 mn, Doubles16 mnd, Doubles16 rngd,
                                                                   Doubles16 rs) {
    __m512i c = _mm512_min_epi32(_mm512_max_epi32(code, _mm512_set1_epi32(CODE_LO)), _mm512_set1_epi32(CODE_HI));
    __m512i idx = _mm512_sub_epi32(c, _mm512_set1_epi32(CODE_LO));
    const __m512d half = _mm512_set1_pd(0.5), inv = _mm512_set1_pd(1.0 / 225.0);
    Doubles16 t = {_mm512_mul_pd(_mm512_sub_pd(_mm512_cvtepi32_pd(_mm512_castsi512_si256(c)), half), inv),
                   _mm512_mul_pd(_mm512_sub_pd(_mm512_cvtepi32_pd(_mm512_extracti32x8_epi32(c, 1)), half), inv)};
#pragma GCC unroll 4
    for (int k = 0; k < T225_EXCEPTIONS; k++) {
        __mmask16 hit = _mm512_cmpeq_epi32_mask(c, _mm512_set1_epi32(EXC_CODE[k]));
        t.lo = _mm512_mask_mov_pd(t.lo, (__mmask8)hit, _mm512_set1_pd(EXC_T225[k]));
        t.hi = _mm512_mask_mov_pd(t.hi, (__mmask8)(hit >> 8), _mm512_set1_pd(EXC_T225[k]));
    }
    Doubles16 e = {_mm512_add_pd(mnd.lo, _mm512_mul_pd(rngd.lo, t.lo)), _mm512_add_pd(mnd.hi, _mm512_mul_pd(rngd.hi, t.hi))};
    __m512i est = nearest_ord16(e);
    __m512 q = threshold16(uth16(idx), rs);
    const __m512i one = _mm512_set1_epi32(1), two = _mm512_set1_epi32(2);
    __mmask16 b0 = below16(est, mn, q);
    __m512i o1 = _mm512_mask_blend_epi32(b0, _mm512_sub_epi32(est, one), _mm512_add_epi32(est, one));
    __m512i o2 = _mm512_mask_blend_epi32(b0, _mm512_sub_epi32(est, two), _mm512_add_epi32(est, two));
    __mmask16 b1 = below16(o1, mn, q), b2 = below16(o2, mn, q);
    __m512i if_below = _mm512_add_epi32(_mm512_set1_epi32(3), _mm512_add_epi32(_mm512_maskz_mov_epi32(b1, one),
                                                                                _mm512_maskz_mov_epi32(b1 & b2, one)));
    __m512i if_not = _mm512_mask_mov_epi32(_mm512_maskz_mov_epi32(b2, one), b1, two);
    __m512i below = _mm512_mask_blend_epi32(b0, if_not, if_below);
    return _mm512_add_epi32(_mm512_sub_epi32(est, _mm512_set1_epi32(WINDOW)), below);
}

/* fast_lower for 16 lanes, of the codes c given as cm = c - 0.5 (a float, exact): the bound, and in *fail the lanes
 * it leaves to lower_bound16 (every lane outside `ok`, the lanes the caller found with c in 1..225 and rng > 0;
 * rs = rng there). */
static inline __attribute__((always_inline)) __m512i fast_lower16(__m512 cm, __m512 mn, __m512 rng, __m512 rs, __m512 eps2,
                                                                  __mmask16 ok, __mmask16 *fail) {
    __m512 t = _mm512_mul_ps(cm, _mm512_set1_ps(1.0f / 225.0f));
    __m512 y = _mm512_mul_ps(rng, t), e = _mm512_add_ps(mn, y);
    eps2 = _mm512_add_ps(_mm512_add_ps(eps2, _mm512_mul_ps(y, _mm512_set1_ps(0x1p-19f))),
                         _mm512_mul_ps(_mm512_abs_ps(e), _mm512_set1_ps(0x1p-22f)));
    __m512i b = _mm512_castps_si512(e);
    __m512i odd = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
    __m512i v0b = _mm512_and_si512(_mm512_add_epi32(_mm512_add_epi32(b, _mm512_set1_epi32(0x7FFF)), odd),
                                   _mm512_set1_epi32((int32_t)0xFFFF0000u)); /* the bf16 nearest e, as a float */
    __m512i est = ord_of16(_mm512_srli_epi32(v0b, 16));
    /* its neighbours in value order: one bf16 step up or down in magnitude by the sign (|e| < 2^18 where the
     * lane is valid, so no neighbour is Inf; a zero v0, whose step would cross into a NaN pattern, fails) */
    __m512i step = _mm512_mask_blend_epi32(_mm512_movepi32_mask(b), _mm512_set1_epi32(0x10000), _mm512_set1_epi32(-0x10000));
    __m512 v0 = _mm512_castsi512_ps(v0b), p = _mm512_castsi512_ps(_mm512_sub_epi32(v0b, step));
    __m512 n = _mm512_castsi512_ps(_mm512_add_epi32(v0b, step));
    __mmask16 valid = ok & _mm512_test_epi32_mask(v0b, _mm512_set1_epi32(0x7FFFFFFF));
    __m512 u = _mm512_div_ps(_mm512_sub_ps(v0, mn), rs);
    __m512 b225 = cm; /* below(est), as below225 */
#pragma GCC unroll 2
    for (int k = 0; k < B_EXCEPTIONS; k++)
        b225 = _mm512_mask_mov_ps(b225, _mm512_cmp_ps_mask(cm, _mm512_set1_ps((float)B_CODE[k] - 0.5f), _CMP_EQ_OQ),
                                  _mm512_set1_ps(B_VALUE[k]));
    __mmask16 up = _mm512_cmp_ps_mask(_mm512_mul_ps(u, _mm512_set1_ps(225.0f)), b225, _CMP_LE_OQ);
    *fail = (__mmask16)~(valid & _mm512_cmp_ps_mask(p, _mm512_sub_ps(e, eps2), _CMP_LE_OQ) &
                         _mm512_cmp_ps_mask(_mm512_add_ps(e, eps2), n, _CMP_LE_OQ));
    return _mm512_mask_add_epi32(est, up, est, _mm512_set1_epi32(1));
}

/* The lanes of codes c in 1..225 (as cm = c - 0.5) with rng > 0, and rs (rng > 0 ? rng : 1). */
static inline __attribute__((always_inline)) __mmask16 fast_ok16(__m512i c, __m512 rng, __m512 *rs) {
    __mmask16 positive = _mm512_cmp_ps_mask(rng, _mm512_setzero_ps(), _CMP_GT_OQ);
    *rs = _mm512_mask_blend_ps(positive, _mm512_set1_ps(1.0f), rng);
    return positive & _mm512_cmpge_epi32_mask(c, _mm512_set1_epi32(1)) & _mm512_cmple_epi32_mask(c, _mm512_set1_epi32(225));
}

/* (L, n) of the row's values j0 .. j0 + 15 (the lanes in `live`), as the scalar loop in walk_row; returns the
 * bounds left to the window search. */
static inline __attribute__((always_inline)) int bins16_of(const int32_t *code, __m512 mn, __m512 rng, __m512 eps2,
                                                           __m512i cap_lo, __m512i cap_end, int32_t *L, int32_t *N,
                                                           int64_t j0, __mmask16 live) {
    __m512i cd = _mm512_maskz_loadu_epi32(live, code + j0);
    const __m512i one = _mm512_set1_epi32(1);
    __mmask16 has_below = live & _mm512_cmpgt_epi32_mask(cd, _mm512_setzero_si512());
    __mmask16 has_above = live & _mm512_cmplt_epi32_mask(cd, _mm512_set1_epi32(225));
    __mmask16 fail_below, fail_above;
    __m512 rs16;
    __mmask16 positive = _mm512_cmp_ps_mask(rng, _mm512_setzero_ps(), _CMP_GT_OQ);
    rs16 = _mm512_mask_blend_ps(positive, _mm512_set1_ps(1.0f), rng);
    /* codes 1..225 for the lower bound (c), and for the upper one (c + 1) */
    __mmask16 ok_below = positive & _mm512_cmple_epi32_mask(cd, _mm512_set1_epi32(225));
    __mmask16 ok_above = positive & _mm512_cmpge_epi32_mask(cd, _mm512_setzero_si512());
    __m512 cm = _mm512_sub_ps(_mm512_cvtepi32_ps(cd), _mm512_set1_ps(0.5f)); /* exact: |c| < 2^24 */
    __m512i below = fast_lower16(cm, mn, rng, rs16, eps2, ok_below, &fail_below);
    __m512i above = fast_lower16(_mm512_add_ps(cm, _mm512_set1_ps(1.0f)), mn, rng, rs16, eps2, ok_above, &fail_above);
    fail_below &= has_below;
    fail_above &= has_above;
    if (__builtin_expect(fail_below | fail_above, 0)) {
        Doubles16 mnd = widen16(mn), rngd = widen16(rng), rs = widen16(rs16);
        if (fail_below) below = _mm512_mask_mov_epi32(below, fail_below, lower_bound16(cd, mn, mnd, rngd, rs));
        if (fail_above)
            above = _mm512_mask_mov_epi32(above, fail_above, lower_bound16(_mm512_add_epi32(cd, one), mn, mnd, rngd, rs));
    }
    /* first = max(lower(c), cap_lo) (cap_lo for c <= 0), end = min(lower(c + 1), cap_end) (cap_end for c >= 225) */
    __m512i first = _mm512_mask_max_epi32(cap_lo, has_below, below, cap_lo);
    __m512i end = _mm512_mask_min_epi32(cap_end, has_above, above, cap_end);
    _mm512_mask_storeu_epi32(L + j0, live, first);
    _mm512_mask_storeu_epi32(N + j0, live, _mm512_sub_epi32(end, first));
    return __builtin_popcount(fail_below) + __builtin_popcount(fail_above);
}

/* bins16_of with each value's group statistics from the row arrays. */
static inline int bins16(const int32_t *code, const float *mn_row, const float *rng_row, const float *eps2_row,
                         const int32_t *cap_lo_row, const int32_t *cap_hi_row, int32_t *L, int32_t *N, int64_t j0,
                         __mmask16 live) {
    return bins16_of(code, _mm512_maskz_loadu_ps(live, mn_row + j0), _mm512_maskz_loadu_ps(live, rng_row + j0),
                     _mm512_maskz_loadu_ps(live, eps2_row + j0), _mm512_maskz_loadu_epi32(live, cap_lo_row + j0),
                     _mm512_maskz_loadu_epi32(live, cap_hi_row + j0), L, N, j0, live);
}

/* The statistics of 16 groups (fp16 mn and rng at mn_b / rng_b, the lanes in `live`) as walk_row's scalar
 * loop computes them (half_to_float: the conversion is exact, as vcvtph2ps; group_caps; group_eps2, the same
 * float operations in the same order). Returns 1 when a live group's mn or rng is NaN or Inf (then the
 * values of that lane differ from the scalar ones, and mean nothing either way). */
typedef struct {
    __m512 mn, rng, eps2;
    __m512i cap_lo, cap_hi;
} GroupStats16;

static inline int group_stats16(const uint8_t *mn_b, const uint8_t *rng_b, __mmask16 live, GroupStats16 *out) {
    __m256i mh = _mm256_maskz_loadu_epi16(live, mn_b), rh = _mm256_maskz_loadu_epi16(live, rng_b);
    const __m256i exp_mask = _mm256_set1_epi16(0x7C00);
    __mmask16 bad = _mm256_cmpeq_epi16_mask(_mm256_and_si256(mh, exp_mask), exp_mask) |
                    _mm256_cmpeq_epi16_mask(_mm256_and_si256(rh, exp_mask), exp_mask);
    __m512 mn = _mm512_cvtph_ps(mh), rng = _mm512_cvtph_ps(rh);
    Doubles16 lo = widen16(mn), rngd = widen16(rng);
    Doubles16 hi = {_mm512_add_pd(lo.lo, rngd.lo), _mm512_add_pd(lo.hi, rngd.hi)};
    __m512i elo = nearest_ord16(lo), ehi = nearest_ord16(hi);
    const __m512i one = _mm512_set1_epi32(1);
    __m512i cap_lo = _mm512_sub_epi32(elo, _mm512_set1_epi32(WINDOW)), cap_hi = _mm512_sub_epi32(ehi, _mm512_set1_epi32(WINDOW));
#pragma GCC unroll 5
    for (int k = -WINDOW; k <= WINDOW; k++) {
        __m512 vl = val_of16(_mm512_add_epi32(elo, _mm512_set1_epi32(k))); /* (double) vl < (double) mn, in float */
        cap_lo = _mm512_mask_add_epi32(cap_lo, _mm512_cmp_ps_mask(vl, mn, _CMP_LT_OQ), cap_lo, one);
        Doubles16 vh = widen16(val_of16(_mm512_add_epi32(ehi, _mm512_set1_epi32(k))));
        __mmask16 le = join_masks(_mm512_cmp_pd_mask(vh.lo, hi.lo, _CMP_LE_OQ), _mm512_cmp_pd_mask(vh.hi, hi.hi, _CMP_LE_OQ));
        cap_hi = _mm512_mask_add_epi32(cap_hi, le, cap_hi, one);
    }
    out->mn = mn, out->rng = rng;
    out->eps2 = _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(2.02f), rng), _mm512_set1_ps(UTH_OFF));
    out->cap_lo = cap_lo, out->cap_hi = cap_hi; /* cap_hi + 1: the vector walk's row arrays hold that (bins16_of) */
    return (live & bad) != 0;
}
#endif

/* For the tests: lower(code) of n (code, mn, rng) triples by the fast path (fast[i], ok[i] = 1 where it decided;
 * 16 at a time where the build has AVX-512) and by the window search (search[i]). */
void lynx_exact_lower_pairs(int64_t n, const int32_t *code, const float *mn, const float *rng, int32_t *fast,
                            int32_t *ok, int32_t *search) {
    init_tables();
    int64_t i = 0;
#ifdef LYNX_EXACT_VECTOR
    for (; i < n; i += LANES) {
        __mmask16 live = n - i >= LANES ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - i)) - 1u), fail;
        __m512 m = _mm512_maskz_loadu_ps(live, mn + i), r = _mm512_maskz_loadu_ps(live, rng + i);
        __m512 eps2 = _mm512_mul_ps(_mm512_set1_ps(2.02f * UTH_OFF), r); /* group_eps2, 16 lanes */
        __m512i c = _mm512_maskz_loadu_epi32(live, code + i);
        __m512 rs;
        __mmask16 in_range = fast_ok16(c, r, &rs);
        __m512i b = fast_lower16(_mm512_sub_ps(_mm512_cvtepi32_ps(c), _mm512_set1_ps(0.5f)), m, r, rs, eps2, in_range, &fail);
        _mm512_mask_storeu_epi32(fast + i, live, b);
        _mm512_mask_storeu_epi32(ok + i, live, _mm512_maskz_mov_epi32((__mmask16)~fail, _mm512_set1_epi32(1)));
    }
#else
    for (; i < n; i++) {
        int good;
        fast[i] = fast_lower(code[i], mn[i], rng[i], group_eps2(rng[i]), &good);
        ok[i] = good;
    }
#endif
    for (i = 0; i < n; i++) search[i] = lower_bound(code[i], mn[i], rng[i], rng[i] > 0.0f ? (double)rng[i] : 1.0);
}

/* Walks a layer's lynx streams (lynx_format.py's layout) token by token: for each row, every value's
 * group statistics (refreshed once per key chunk, keys: one group per channel and chunk, or per token,
 * values: hd / G groups), full code and bin (L, n). The row arrays are the caller's scratch (hd each). */
typedef struct {
    const uint8_t *block, *res, *mn_b, *rng_b, *codes;
    int64_t T, hd, P, C, G, start, n_p, t, stop; /* stop: the row after the last one walked */
    int is_key, not_finite; /* not_finite: a group's mn or rng is NaN or Inf (a corrupt anchor) */
    int64_t fallbacks; /* bounds the fast path left to the window search */
    float *mn, *rng, *eps2;
    int32_t *code, *cap_lo, *cap_hi, *L, *N;
} Walk;

static void walk_page(Walk *w) {
    int64_t n_p = w->T - w->start < w->P ? w->T - w->start : w->P;
    int64_t groups = w->is_key ? ((n_p + w->C - 1) / w->C) * w->hd : n_p * (w->hd / w->G);
    w->n_p = n_p;
    w->t = 0;
    w->mn_b = w->block;
    w->rng_b = w->block + 2 * groups;
    w->codes = w->block + 4 * groups;
}

/* Fills the row of token `start + t` and advances; returns 0 after the last token. */
static int walk_row(Walk *w) {
    if (w->start + w->t >= w->stop) return 0;
    int64_t t = w->t, hd = w->hd;
    if (!w->is_key || t % w->C == 0) {
        int64_t per = w->is_key ? 1 : w->G, first_group = w->is_key ? (t / w->C) * hd : t * (hd / w->G);
#ifdef LYNX_EXACT_VECTOR
        for (int64_t g0 = 0; g0 < hd / per; g0 += LANES) { /* 16 groups at a time */
            int64_t n = hd / per - g0 < LANES ? hd / per - g0 : LANES;
            __mmask16 live = (__mmask16)((1u << n) - 1u);
            GroupStats16 gs;
            w->not_finite |= group_stats16(w->mn_b + 2 * (first_group + g0), w->rng_b + 2 * (first_group + g0), live, &gs);
            if (per == 1 || per % LANES == 0) { /* keys: per value; value groups of whole vectors: per group */
                _mm512_mask_storeu_ps(w->mn + g0, live, gs.mn);
                _mm512_mask_storeu_ps(w->rng + g0, live, gs.rng);
                _mm512_mask_storeu_ps(w->eps2 + g0, live, gs.eps2);
                _mm512_mask_storeu_epi32(w->cap_lo + g0, live, gs.cap_lo);
                _mm512_mask_storeu_epi32(w->cap_hi + g0, live, gs.cap_hi);
                continue;
            }
            float mn[LANES], rng[LANES], eps2[LANES];
            int32_t cap_lo[LANES], cap_hi[LANES];
            _mm512_storeu_ps(mn, gs.mn), _mm512_storeu_ps(rng, gs.rng), _mm512_storeu_ps(eps2, gs.eps2);
            _mm512_storeu_si512(cap_lo, gs.cap_lo), _mm512_storeu_si512(cap_hi, gs.cap_hi);
            for (int64_t k = 0; k < n; k++)
                for (int64_t j = (g0 + k) * per; j < (g0 + k + 1) * per; j++) {
                    w->mn[j] = mn[k];
                    w->rng[j] = rng[k];
                    w->eps2[j] = eps2[k];
                    w->cap_lo[j] = cap_lo[k];
                    w->cap_hi[j] = cap_hi[k];
                }
        }
#else
        for (int64_t j0 = 0; j0 < hd; j0 += per) {
            uint16_t m, r;
            int64_t g = first_group + j0 / per;
            memcpy(&m, w->mn_b + 2 * g, 2);
            memcpy(&r, w->rng_b + 2 * g, 2);
            float mn = half_to_float(m), rng = half_to_float(r);
            w->not_finite |= (m & 0x7C00) == 0x7C00 || (r & 0x7C00) == 0x7C00; /* fp16 exponent all ones */
            int32_t cap_lo, cap_hi;
            group_caps(mn, rng, &cap_lo, &cap_hi);
            float eps2 = group_eps2(rng);
            for (int64_t j = j0; j < j0 + per; j++) {
                w->mn[j] = mn;
                w->rng[j] = rng;
                w->eps2[j] = eps2;
                w->cap_lo[j] = cap_lo;
                w->cap_hi[j] = cap_hi;
            }
        }
#endif
    }
    const uint8_t *a_row = w->codes + t * hd / 2, *r_row = w->res + t * hd / 2;
    int32_t *restrict code = w->code;
    int64_t i = 0;
#ifdef LYNX_EXACT_VECTOR
    const __m512i even = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    const __m512i odd = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
    const __m512i nibble = _mm512_set1_epi32(0xF), levels = _mm512_set1_epi32(15), bias = _mm512_set1_epi32(7);
    for (; i + 16 <= hd / 2; i += 16) { /* 32 codes from 16 anchor and 16 residual bytes */
        __m512i a = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(a_row + i)));
        __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(r_row + i)));
        __m512i lo = _mm512_sub_epi32(_mm512_add_epi32(_mm512_mullo_epi32(_mm512_and_si512(a, nibble), levels),
                                                       _mm512_and_si512(q, nibble)), bias);
        __m512i hi = _mm512_sub_epi32(_mm512_add_epi32(_mm512_mullo_epi32(_mm512_srli_epi32(a, 4), levels),
                                                       _mm512_srli_epi32(q, 4)), bias);
        _mm512_storeu_si512(code + 2 * i, _mm512_permutex2var_epi32(lo, even, hi));
        _mm512_storeu_si512(code + 2 * i + 16, _mm512_permutex2var_epi32(lo, odd, hi));
    }
#endif
    for (; i < hd / 2; i++) {
        int32_t a2 = a_row[i], q2 = r_row[i];
        code[2 * i] = (a2 & 0xF) * 15 + (q2 & 0xF) - 7;
        code[2 * i + 1] = (a2 >> 4) * 15 + (q2 >> 4) - 7;
    }
    const float *restrict mn_row = w->mn, *restrict rng_row = w->rng, *restrict eps2_row = w->eps2;
    const int32_t *restrict cap_lo_row = w->cap_lo, *restrict cap_hi_row = w->cap_hi;
    int32_t *restrict Lr = w->L, *restrict Nr = w->N;
#ifdef LYNX_EXACT_VECTOR
    if (!w->is_key && w->G % LANES == 0) { /* value groups of whole vectors: the statistics broadcast per group */
        for (int64_t g = 0, j = 0; j < hd; g++)
            for (int64_t stop = j + w->G; j < stop; j += LANES)
                w->fallbacks += bins16_of(code, _mm512_set1_ps(mn_row[g]), _mm512_set1_ps(rng_row[g]),
                                          _mm512_set1_ps(eps2_row[g]), _mm512_set1_epi32(cap_lo_row[g]),
                                          _mm512_set1_epi32(cap_hi_row[g]), Lr, Nr, j, (__mmask16)0xFFFF);
    } else {
        for (int64_t j = 0; j < hd; j += LANES)
            w->fallbacks += bins16(code, mn_row, rng_row, eps2_row, cap_lo_row, cap_hi_row, Lr, Nr, j,
                                   hd - j >= LANES ? (__mmask16)0xFFFF : (__mmask16)((1u << (hd - j)) - 1u));
    }
#else
    for (int64_t j = 0; j < hd; j++) {
        float mn = mn_row[j], rng = rng_row[j];
        double rs = rng > 0.0f ? (double)rng : 1.0;
        int32_t cd = code[j], cap_lo = cap_lo_row[j], cap_hi = cap_hi_row[j];
        int ok_below, ok_above;
        int32_t below = fast_lower(cd, mn, rng, eps2_row[j], &ok_below);
        int32_t above = fast_lower(cd + 1, mn, rng, eps2_row[j], &ok_above);
        if (cd > 0 && !ok_below) below = lower_bound(cd, mn, rng, rs), w->fallbacks++;
        if (cd < 225 && !ok_above) above = lower_bound(cd + 1, mn, rng, rs), w->fallbacks++;
        int32_t first = cd > 0 ? below : cap_lo;
        int32_t after = cd < 225 ? above : cap_hi + 1;
        first = first > cap_lo ? first : cap_lo;
        int32_t last = after - 1 < cap_hi ? after - 1 : cap_hi;
        Lr[j] = first;
        Nr[j] = last - first + 1;
    }
#endif
    if (++w->t == w->n_p) {
        w->block = w->codes + w->n_p * hd / 2; /* past the page's metadata and anchor codes */
        w->res += w->n_p * hd / 2;
        w->start += w->n_p;
        if (w->start < w->T) walk_page(w);
    }
    return 1;
}

static void walk_done(Walk *w) { __atomic_fetch_add(&fallbacks_total, w->fallbacks, __ATOMIC_RELAXED); }

static void walk_init(Walk *w, const uint8_t *anchor, const uint8_t *residual, int64_t T, int64_t hd, int is_key,
                      int64_t P, int64_t C, int64_t G, int64_t n_sink, float *f_scratch, int32_t *i_scratch) {
    init_tables();
    w->block = anchor + n_sink * hd * 2;
    w->res = residual;
    w->T = T, w->hd = hd, w->P = P, w->C = C, w->G = G, w->start = 0, w->is_key = is_key, w->not_finite = 0;
    w->mn = f_scratch, w->rng = f_scratch + hd, w->eps2 = f_scratch + 2 * hd, w->fallbacks = 0;
    w->code = i_scratch, w->cap_lo = i_scratch + hd, w->cap_hi = i_scratch + 2 * hd;
    w->L = i_scratch + 3 * hd, w->N = i_scratch + 4 * hd, w->stop = T, w->t = 0, w->n_p = 0;
    if (T > 0) walk_page(w);
}

/* walk_init for rows [row0, stop) only (0 <= row0 < stop <= T; keys: row0 a multiple of the chunk C, so the
 * first row refreshes its groups): past the blocks of the pages before row0's. Scratch as walk_init. */
static void walk_init_rows(Walk *w, const uint8_t *anchor, const uint8_t *residual, int64_t T, int64_t hd, int is_key,
                           int64_t P, int64_t C, int64_t G, int64_t n_sink, float *f_scratch, int32_t *i_scratch,
                           int64_t row0, int64_t stop) {
    walk_init(w, anchor, residual, T, hd, is_key, P, C, G, n_sink, f_scratch, i_scratch);
    w->stop = stop;
    while (T > 0 && w->start + w->n_p <= row0) {
        w->block = w->codes + w->n_p * hd / 2;
        w->res += w->n_p * hd / 2;
        w->start += w->n_p;
        walk_page(w);
    }
    w->t = row0 - w->start;
}

/* (L, n) of every value of one layer's K (is_key) or V. Scratch: 3 hd floats, 5 hd int32. Returns 0; 4 when
 * a group's mn or rng is NaN or Inf (then the bins mean nothing). */
int lynx_exact_bins(const uint8_t *anchor, const uint8_t *residual, int64_t T, int64_t hd, int is_key, int64_t P,
                     int64_t C, int64_t G, int64_t n_sink, int32_t *L, int32_t *N, float *f_scratch,
                     int32_t *i_scratch) {
    Walk w;
    walk_init(&w, anchor, residual, T, hd, is_key, P, C, G, n_sink, f_scratch, i_scratch);
    for (int64_t row = 0; walk_row(&w); row++) {
        memcpy(L + row * hd, w.L, hd * sizeof(int32_t));
        memcpy(N + row * hd, w.N, hd * sizeof(int32_t));
    }
    walk_done(&w);
    return w.not_finite ? 4 : 0;
}

/* The rank class of each bin size: lut[n] = k + 1 for n = 2..256 in class k, 0 for none; lut[257] the one
 * class that holds every n in 257..65536 (a bin holds at most 65536 ordinals). Returns 0 when the classes
 * do not have that shape or are not consecutive ranges from n = 2 up (which class16 relies on: the class of n
 * is the count of classes whose lo is <= n). */
static int class_lut(const int32_t *lo, const int32_t *hi, int num_classes, int32_t *lut) {
    if (num_classes < 1 || num_classes > MAX_CLASSES || lo[0] != 2) return 0;
    for (int k = 1; k < num_classes; k++)
        if (lo[k] != hi[k - 1] + 1) return 0;
    for (int n = 0; n <= 257; n++) {
        lut[n] = 0;
        for (int k = 0; k < num_classes; k++)
            if (n >= 2 && n >= lo[k] && n <= hi[k]) lut[n] = k + 1;
        if (n >= 2 && lut[n] == 0) return 0;
    }
    int top = lut[257];
    return hi[top - 1] >= 65536;
}

static inline int32_t class_of(const int32_t *lut, int32_t n) { return lut[n < 0 ? 0 : (n > 257 ? 257 : n)]; }

#ifdef LYNX_EXACT_VECTOR
/* The 16-bit ranks of the lanes in m (of 32), stored packed at dst (32 entries written), and the inverse: the
 * next popcount(m) ranks at src spread to the lanes in m (32 entries read), zero elsewhere. VBMI2 does each in
 * one instruction; other AVX-512 CPUs take two 16-lane halves of 32 bits. */
static inline __attribute__((always_inline)) void compress_store16(uint16_t *dst, __mmask32 m, __m512i r16) {
#ifdef __AVX512VBMI2__
    _mm512_storeu_si512(dst, _mm512_maskz_compress_epi16(m, r16));
#else
    __m512i lo = _mm512_cvtepu16_epi32(_mm512_castsi512_si256(r16)), hi = _mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(r16, 1));
    _mm256_storeu_si256((__m256i *)dst, _mm512_cvtepi32_epi16(_mm512_maskz_compress_epi32((__mmask16)m, lo)));
    _mm256_storeu_si256((__m256i *)(dst + __builtin_popcount((uint16_t)m)),
                        _mm512_cvtepi32_epi16(_mm512_maskz_compress_epi32((__mmask16)(m >> 16), hi)));
#endif
}

/* The byte form: the bytes of the lanes in m (of 64) stored packed at dst (64 bytes written). */
static inline __attribute__((always_inline)) void compress_store8(uint8_t *dst, __mmask64 m, __m512i r8) {
#ifdef __AVX512VBMI2__
    _mm512_storeu_si512(dst, _mm512_maskz_compress_epi8(m, r8));
#else
    for (int q = 0; q < 4; q++) {
        __mmask16 mq = (__mmask16)(m >> (16 * q));
        __m512i v = _mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32(r8, q));
        _mm_storeu_si128((__m128i *)dst, _mm512_cvtepi32_epi8(_mm512_maskz_compress_epi32(mq, v)));
        dst += __builtin_popcount(mq);
    }
#endif
}

static inline __attribute__((always_inline)) __m512i expand_load16(__mmask32 m, const uint16_t *src) {
#ifdef __AVX512VBMI2__
    return _mm512_maskz_expand_epi16(m, _mm512_loadu_si512(src));
#else
    __m512i lo = _mm512_maskz_expand_epi32((__mmask16)m, _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)src)));
    __m512i hi = _mm512_maskz_expand_epi32((__mmask16)(m >> 16), _mm512_cvtepu16_epi32(_mm256_loadu_si256(
                                               (const __m256i *)(src + __builtin_popcount((uint16_t)m)))));
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi32_epi16(lo)), _mm512_cvtepi32_epi16(hi), 1);
#endif
}

/* The byte form: the next popcount(m) bytes at src spread to the lanes in m (of 64; 64 bytes read). */
static inline __attribute__((always_inline)) __m512i expand_load8(__mmask64 m, const uint8_t *src) {
#ifdef __AVX512VBMI2__
    return _mm512_maskz_expand_epi8(m, _mm512_loadu_si512(src));
#else
    __m128i out[4];
    for (int q = 0; q < 4; q++) {
        __mmask16 mq = (__mmask16)(m >> (16 * q));
        out[q] = _mm512_cvtepi32_epi8(_mm512_maskz_expand_epi32(mq, _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)src))));
        src += __builtin_popcount(mq);
    }
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_inserti128_si256(_mm256_castsi128_si256(out[0]), out[1], 1)),
                              _mm256_inserti128_si256(_mm256_castsi128_si256(out[2]), out[3], 1), 1);
#endif
}

/* class_of by the bit length b of n - 1 (0 for n = 1, 32 for n <= 0): classes[b] the class of the bucket's
 * first size, split[b] the size in the bucket where the next class starts (INT32_MAX for none). Entries 17..31
 * never occur (n <= 65536) and 32 wraps to entry 0 in the permutes. Returns 0 when a bucket holds more than
 * one class start (class16 then counts the class starts). */
typedef struct {
    int ok;
    __m512i classes[2], split[2];
} ClassBuckets;

static ClassBuckets class_buckets(const int32_t *lut) {
    int32_t classes[32] = {0}, split[32];
    ClassBuckets out = {.ok = 1};
    for (int b = 0; b < 32; b++) split[b] = INT32_MAX;
    for (int b = 1; b <= 16; b++) {
        int32_t first = (1 << (b - 1)) + 1, last = 1 << b;
        classes[b] = lut[first > 257 ? 257 : first];
        for (int32_t n = first + 1; n <= last && n <= 257; n++) {
            if (lut[n] == lut[n - 1]) continue;
            out.ok &= split[b] == INT32_MAX && lut[n] == classes[b] + 1;
            split[b] = n;
        }
    }
    for (int h = 0; h < 2; h++) out.classes[h] = _mm512_loadu_si512(classes + 16 * h), out.split[h] = _mm512_loadu_si512(split + 16 * h);
    return out;
}

/* class_of for 16 sizes: by bucket (one lzcnt and two permutes), or the count of classes that start at or
 * below n (class_lut checked the shape). */
static inline __m512i class16(__m512i n, const ClassBuckets *cb, const int32_t *lo, int num_classes) {
    if (cb->ok) {
        __m512i b = _mm512_sub_epi32(_mm512_set1_epi32(32), _mm512_lzcnt_epi32(_mm512_sub_epi32(n, _mm512_set1_epi32(1))));
        __m512i cls = _mm512_permutex2var_epi32(cb->classes[0], b, cb->classes[1]);
        __mmask16 next = _mm512_cmpge_epi32_mask(n, _mm512_permutex2var_epi32(cb->split[0], b, cb->split[1]));
        return _mm512_mask_add_epi32(cls, next, cls, _mm512_set1_epi32(1));
    }
    __m512i cls = _mm512_setzero_si512();
    for (int k = 0; k < num_classes; k++)
        cls = _mm512_mask_add_epi32(cls, _mm512_cmpge_epi32_mask(n, _mm512_set1_epi32(lo[k])), cls, _mm512_set1_epi32(1));
    return cls;
}

#endif

/* The layer's arguments every pass shares (the walk's, and the rank class table). */
typedef struct {
    const uint8_t *anchor, *residual;
    int64_t T, hd, P, C, G, n_sink;
    int is_key, num_classes, byte_classes; /* byte_classes: the classes 1.. whose ranks are bytes (hi <= 256) */
    const int32_t *lo;
    int32_t lut[258];
#ifdef LYNX_EXACT_VECTOR
    ClassBuckets cb;
#endif
} Layer;

static int layer_init(Layer *y, const uint8_t *anchor, const uint8_t *residual, int64_t T, int64_t hd, int is_key,
                      int64_t P, int64_t C, int64_t G, int64_t n_sink, const int32_t *lo, const int32_t *hi,
                      int num_classes) {
    /* the class tables of the last table seen on this thread, reused while it is the same (every call of a
     * process passes lynx_exact's one table: ~2 us a call saved) */
    static __thread int32_t last_lo[MAX_CLASSES], last_hi[MAX_CLASSES];
    static __thread int last_classes;
    static __thread Layer last;
    int same = num_classes == last_classes && num_classes >= 1 && num_classes <= MAX_CLASSES &&
               !memcmp(lo, last_lo, num_classes * sizeof(int32_t)) && !memcmp(hi, last_hi, num_classes * sizeof(int32_t));
    if (!same) {
        last_classes = 0;
        if (!class_lut(lo, hi, num_classes, last.lut)) return 0;
        last.byte_classes = 0;
        while (last.byte_classes < num_classes && hi[last.byte_classes] <= 256) last.byte_classes++;
#ifdef LYNX_EXACT_VECTOR
        last.cb = class_buckets(last.lut);
#endif
        memcpy(last_lo, lo, num_classes * sizeof(int32_t));
        memcpy(last_hi, hi, num_classes * sizeof(int32_t));
        last_classes = num_classes;
    }
    *y = last;
    y->anchor = anchor, y->residual = residual, y->T = T, y->hd = hd, y->P = P, y->C = C, y->G = G;
    y->n_sink = n_sink, y->is_key = is_key, y->num_classes = num_classes, y->lo = lo;
    return 1;
}

static void layer_walk(const Layer *y, Walk *w, float *f_scratch, int32_t *i_scratch, int64_t row0, int64_t stop) {
    walk_init_rows(w, y->anchor, y->residual, y->T, y->hd, y->is_key, y->P, y->C, y->G, y->n_sink, f_scratch,
                   i_scratch, row0, stop);
}

/* Rows split for `threads` workers: a multiple of the key chunk (a worker's first row refreshes its groups). */
static int64_t part_rows(const Layer *y, int64_t parts) {
    int64_t rows = (y->T + parts - 1) / parts, c = y->C > 0 ? y->C : 1;
    return ((rows + c - 1) / c) * c;
}

/* The encode of rows [row0, stop): appends to ranks[k] from cur[k + 1] and to the escapes from *escapes. */
static void encode_rows(const Layer *y, Walk *w, const uint16_t *x, void *const *ranks, int64_t *cur,
                        int32_t *escape_index, uint16_t *escape_bits, int64_t *escapes_io) {
    const int64_t hd = y->hd;
    const int num_classes = y->num_classes;
    int64_t escapes = *escapes_io;
    for (int64_t base = (w->start + w->t) * hd; walk_row(w); base += hd) {
        const uint16_t *xr = x + base;
        if (base < y->n_sink * hd) continue; /* the layer header restores the sink */
#ifdef LYNX_EXACT_VECTOR
        const int byte_classes = y->byte_classes;
        for (int64_t j = 0; j < hd; j += 4 * LANES) { /* 64 values: four quarters of 16 for the bins */
            __m128i r8q[4], cls8q[4];
            __m256i r16q[4];
            __mmask64 coded = 0;
#pragma GCC unroll 4
            for (int q = 0; q < 4; q++) {
                int64_t at = j + q * LANES, left = hd - at;
                __mmask16 live = left >= LANES ? (__mmask16)0xFFFF : (left > 0 ? (__mmask16)((1u << left) - 1u) : 0);
                __m512i b = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(live, xr + at));
                __m512i n = _mm512_maskz_loadu_epi32(live, w->N + at);
                __m512i r = _mm512_sub_epi32(ord_of16(b), _mm512_maskz_loadu_epi32(live, w->L + at));
                __m512i cls = class16(n, &y->cb, y->lo, num_classes);
                __mmask16 esc = live & (_mm512_cmplt_epi32_mask(r, _mm512_setzero_si512()) | _mm512_cmpge_epi32_mask(r, n));
                if (esc) {
                    __m512i idx = _mm512_add_epi32(_mm512_set1_epi32((int32_t)(base + at)),
                                                   _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
                    _mm512_storeu_si512(escape_index + escapes, _mm512_maskz_compress_epi32(esc, idx));
                    _mm256_storeu_si256((__m256i *)(escape_bits + escapes), _mm512_cvtepi32_epi16(_mm512_maskz_compress_epi32(esc, b)));
                    escapes += __builtin_popcount(esc);
                }
                coded |= (__mmask64)(uint16_t)(live & ~esc) << (16 * q);
                r8q[q] = _mm512_cvtepi32_epi8(r); /* a byte class's ranks are < 256; other lanes are not stored */
                r16q[q] = _mm512_cvtepi32_epi16(r);
                cls8q[q] = _mm512_cvtepi32_epi8(cls);
            }
            __m512i r8 = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_inserti128_si256(_mm256_castsi128_si256(r8q[0]), r8q[1], 1)),
                                            _mm256_inserti128_si256(_mm256_castsi128_si256(r8q[2]), r8q[3], 1), 1);
            __m512i cls8 = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_inserti128_si256(_mm256_castsi128_si256(cls8q[0]), cls8q[1], 1)),
                                              _mm256_inserti128_si256(_mm256_castsi128_si256(cls8q[2]), cls8q[3], 1), 1);
#pragma GCC unroll 16
            for (int k = 1; k <= MAX_CLASSES; k++) { /* every class, fixed order (an absent one stores past its end) */
                if (k > num_classes) break;
                __mmask64 m = coded & _mm512_cmpeq_epi8_mask(cls8, _mm512_set1_epi8((char)k));
                if (k <= byte_classes) {
                    compress_store8((uint8_t *)ranks[k - 1] + cur[k], m, r8);
                    cur[k] += __builtin_popcountll(m);
                } else {
                    for (int h = 0; h < 2; h++) {
                        __mmask32 mh = (__mmask32)(m >> (32 * h));
                        compress_store16((uint16_t *)ranks[k - 1] + cur[k], mh,
                                         _mm512_inserti64x4(_mm512_castsi256_si512(r16q[2 * h]), r16q[2 * h + 1], 1));
                        cur[k] += __builtin_popcount(mh);
                    }
                }
            }
        }
#else
        for (int64_t j = 0; j < hd; j++) {
            int32_t n = w->N[j], r = ord_of(xr[j]) - w->L[j], c = class_of(y->lut, n);
            if (r < 0 || r >= n) {
                escape_index[escapes] = (int32_t)(base + j);
                escape_bits[escapes++] = xr[j];
            } else if (c && c <= y->byte_classes) {
                ((uint8_t *)ranks[c - 1])[cur[c]++] = (uint8_t)r;
            } else if (c) {
                ((uint16_t *)ranks[c - 1])[cur[c]++] = (uint16_t)r;
            }
        }
#endif
    }
    *escapes_io = escapes;
}

/* One worker's share of a threaded encode: rows [row0, stop), its ranks and escapes written from index
 * row0 * hd + part * SLACK8 of every array (the parts before can append at most row0 * hd, and write SLACK8
 * entries past their last), moved down after the join. */
typedef struct {
    const Layer *y;
    const uint16_t *x;
    void *const *ranks;
    int32_t *escape_index;
    uint16_t *escape_bits;
    int64_t row0, stop, first, cur[MAX_CLASSES + 1], escapes; /* first: where its output starts */
    int nonfinite, not_finite;
    float *f_scratch;
    int32_t *i_scratch;
} EncodePart;

static void *encode_part(void *arg) {
    EncodePart *p = arg;
    const Layer *y = p->y;
    int64_t first = p->row0 * y->hd, end = p->stop * y->hd, nonfinite = 0;
    for (int64_t i = first; i < end; i++) nonfinite |= (p->x[i] & 0x7F80) == 0x7F80;
    first = p->first;
    p->nonfinite = (int)nonfinite;
    for (int k = 0; k <= MAX_CLASSES; k++) p->cur[k] = first;
    p->escapes = first;
    if (nonfinite) return NULL;
    Walk w;
    layer_walk(y, &w, p->f_scratch, p->i_scratch, p->row0, p->stop);
    encode_rows(y, &w, p->x, p->ranks, p->cur, p->escape_index, p->escape_bits, &p->escapes);
    walk_done(&w);
    p->not_finite = w.not_finite;
    return NULL;
}

#define MAX_THREADS 8

/* Runs fn over parts[0 .. n) (stride `size` bytes), part 0 on the calling thread; a part whose thread could not
 * start runs here after (the same result, later; a decode worker that runs late finds no chunk left). */
static void run_parts(void *(*fn)(void *), void *parts, size_t size, int n) {
    pthread_t ids[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    for (int i = 1; i < n; i++) started[i] = pthread_create(&ids[i], NULL, fn, (char *)parts + i * size) == 0;
    fn(parts);
    for (int i = 1; i < n; i++) {
        if (started[i]) pthread_join(ids[i], NULL);
        else fn((char *)parts + i * size);
    }
}

/* Encode: the exact stream's content before bit packing. For every value past the sink: its bin, rank
 * r = ordinal(x) - L and class (by the bin's n); a value outside its bin is an escape (index and bits),
 * a value of a one-value bin carries nothing, every other value appends its rank to its class's array
 * ranks[k] (bytes for the classes of bins of at most 256 values, Layer.byte_classes, else 16-bit; capacity: the
 * layer's values + SLACK8). counts[k] = ranks appended. Returns the number of escapes (escape arrays: capacity
 * values + SLACK8), -1 when a value is NaN or Inf, -2 for a class table the pass cannot hold, -3 when a group's
 * mn or rng is NaN or Inf. Scratch: 3 hd floats, 5 hd int32 per thread. `threads` (1..MAX_THREADS) workers take
 * consecutive runs of rows (then every rank and escape array needs SLACK8 * threads entries past the layer's
 * values); the result is the same for any. */
int64_t lynx_exact_encode(const uint8_t *anchor, const uint8_t *residual, int64_t T, int64_t hd, int is_key,
                          int64_t P, int64_t C, int64_t G, int64_t n_sink, const uint16_t *x, const int32_t *lo,
                          const int32_t *hi, int num_classes, void *const *ranks, int64_t *counts, int32_t *escape_index,
                          uint16_t *escape_bits, float *f_scratch, int32_t *i_scratch, int threads) {
    Layer y;
    if (!layer_init(&y, anchor, residual, T, hd, is_key, P, C, G, n_sink, lo, hi, num_classes)) return -2;
    init_tables();
    threads = threads < 1 ? 1 : (threads > MAX_THREADS ? MAX_THREADS : threads);
    int64_t rows = part_rows(&y, threads);
    EncodePart parts[MAX_THREADS];
    int n = 0;
    for (int64_t row0 = 0; n == 0 || row0 < T; row0 += rows, n++)
        parts[n] = (EncodePart){.y = &y, .x = x, .ranks = ranks, .escape_index = escape_index,
                                .escape_bits = escape_bits, .row0 = row0, .stop = row0 + rows < T ? row0 + rows : T,
                                .first = row0 * hd + n * SLACK8,
                                .f_scratch = f_scratch + 3 * hd * n, .i_scratch = i_scratch + 5 * hd * n};
    run_parts(encode_part, parts, sizeof(EncodePart), n);
    int nonfinite = 0, not_finite = 0;
    for (int i = 0; i < n; i++) nonfinite |= parts[i].nonfinite, not_finite |= parts[i].not_finite;
    if (nonfinite) return -1;
    if (not_finite) return -3;
    int64_t escapes = parts[0].escapes;
    for (int k = 1; k <= num_classes; k++) counts[k - 1] = parts[0].cur[k];
    for (int i = 1; i < n; i++) { /* part i's output after the parts before it */
        int64_t first = parts[i].first;
        memmove(escape_index + escapes, escape_index + first, (parts[i].escapes - first) * sizeof(int32_t));
        memmove(escape_bits + escapes, escape_bits + first, (parts[i].escapes - first) * sizeof(uint16_t));
        escapes += parts[i].escapes - first;
        for (int k = 1; k <= num_classes; k++) {
            size_t width = k <= y.byte_classes ? 1 : 2;
            memmove((uint8_t *)ranks[k - 1] + width * counts[k - 1], (uint8_t *)ranks[k - 1] + width * first,
                    (parts[i].cur[k] - first) * width);
            counts[k - 1] += parts[i].cur[k] - first;
        }
    }
    return escapes;
}

/* The scalar part of a pack: ranks [first, n) (first a multiple of per = 8 / bits) into plane bytes, low bits
   first, the last byte partial; `ranks` of either width (16-bit ranks or the encode's byte ranks). */
#define PACK_BITS_TAIL(ranks, n, bits, per, first, plane)                                                   \
    do {                                                                                                   \
        int64_t whole_ = (n) / (per);                                                                      \
        for (int64_t i_ = (first) / (per); i_ <= whole_ && i_ * (per) < (n); i_++) {                        \
            uint32_t byte_ = 0;                                                                            \
            for (int64_t s_ = 0; s_ < (per) && i_ * (per) + s_ < (n); s_++)                                \
                byte_ |= (uint32_t)(ranks)[i_ * (per) + s_] << (s_ * (bits));                              \
            (plane)[i_] = (uint8_t)byte_;                                                                  \
        }                                                                                                  \
    } while (0)

/* Bit packing of one class's ranks: bits 1, 2, 4 (LSB first inside a byte, zero padded) or 8 into `plane`;
 * 16: low bytes into `plane`, high bytes into `high`. With AVX-512, 1, 2 and 4 bits go 32 ranks at a time
 * (a bit mask per rank bit, PDEP to interleave; nibble pairs by a multiply-add), the rest one by one. */
void lynx_exact_pack_bits(const uint16_t *ranks, int64_t n, int bits, uint8_t *plane, uint8_t *high) {
    if (bits == 16) {
        for (int64_t i = 0; i < n; i++) plane[i] = (uint8_t)(ranks[i] & 0xFF), high[i] = (uint8_t)(ranks[i] >> 8);
        return;
    }
    if (bits == 8) {
        for (int64_t i = 0; i < n; i++) plane[i] = (uint8_t)ranks[i];
        return;
    }
    int per = 8 / bits;
    int64_t first = 0; /* the first rank the scalar loop packs */
#ifdef LYNX_EXACT_VECTOR
    for (; first + 32 <= n; first += 32) {
        __m512i v = _mm512_loadu_si512(ranks + first);
        uint8_t *dst = plane + first / per;
        if (bits == 1) {
            uint32_t m = _mm512_test_epi16_mask(v, _mm512_set1_epi16(1));
            memcpy(dst, &m, 4);
        } else if (bits == 2) {
            uint64_t w = _pdep_u64(_mm512_test_epi16_mask(v, _mm512_set1_epi16(1)), 0x5555555555555555ull) |
                         _pdep_u64(_mm512_test_epi16_mask(v, _mm512_set1_epi16(2)), 0xAAAAAAAAAAAAAAAAull);
            memcpy(dst, &w, 8);
        } else {
            __m256i bytes = _mm512_cvtepi16_epi8(_mm512_and_si512(v, _mm512_set1_epi16(0xF)));
            __m256i pairs = _mm256_maddubs_epi16(bytes, _mm256_set1_epi16(0x1001)); /* b0 + 16 b1 */
            _mm_storeu_si128((__m128i *)dst, _mm256_cvtepi16_epi8(pairs));
        }
    }
#endif
    PACK_BITS_TAIL(ranks, n, bits, per, first, plane);
}

/* lynx_exact_pack_bits of byte ranks (bits 1, 2, 4 or 8: the encode's byte classes). */
void lynx_exact_pack_bits8(const uint8_t *ranks, int64_t n, int bits, uint8_t *plane) {
    if (bits == 8) {
        memcpy(plane, ranks, (size_t)n);
        return;
    }
    int per = 8 / bits;
    int64_t first = 0;
#ifdef LYNX_EXACT_VECTOR
    for (; first + 64 <= n; first += 64) {
        __m512i v = _mm512_loadu_si512(ranks + first);
        uint8_t *dst = plane + first / per;
        if (bits == 1) {
            uint64_t m = _mm512_test_epi8_mask(v, _mm512_set1_epi8(1));
            memcpy(dst, &m, 8);
        } else if (bits == 2) {
            uint64_t low = _mm512_test_epi8_mask(v, _mm512_set1_epi8(1)), high = _mm512_test_epi8_mask(v, _mm512_set1_epi8(2));
            uint64_t w[2] = {_pdep_u64(low, 0x5555555555555555ull) | _pdep_u64(high, 0xAAAAAAAAAAAAAAAAull),
                             _pdep_u64(low >> 32, 0x5555555555555555ull) | _pdep_u64(high >> 32, 0xAAAAAAAAAAAAAAAAull)};
            memcpy(dst, w, 16);
        } else { /* 16-bit lane (b0 | b1 << 8) -> byte b0 + 16 b1 */
            __m512i pairs = _mm512_or_si512(_mm512_and_si512(v, _mm512_set1_epi16(0xF)),
                                            _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi16(0xF0)));
            _mm256_storeu_si256((__m256i *)dst, _mm512_cvtepi16_epi8(pairs));
        }
    }
#endif
    PACK_BITS_TAIL(ranks, n, bits, per, first, plane);
}

/* Inverse of lynx_exact_pack_bits: `n` ranks (the ranks array holds n + SLACK entries). */
void lynx_exact_unpack_bits(const uint8_t *plane, const uint8_t *high, int64_t n, int bits, uint16_t *ranks) {
    if (bits == 16) {
        for (int64_t i = 0; i < n; i++) ranks[i] = (uint16_t)(plane[i] | (high[i] << 8));
        return;
    }
    if (bits == 8) {
        for (int64_t i = 0; i < n; i++) ranks[i] = plane[i];
        return;
    }
    int per = 8 / bits;
    uint32_t mask = (1u << bits) - 1u;
    int64_t first = 0;
#ifdef LYNX_EXACT_VECTOR
    for (; first + 32 <= n; first += 32) { /* 32 ranks from 4, 8 or 16 whole bytes of the plane */
        const uint8_t *src = plane + first / per;
        __m512i v;
        if (bits == 1) {
            uint32_t m;
            memcpy(&m, src, 4);
            v = _mm512_maskz_mov_epi16(m, _mm512_set1_epi16(1));
        } else if (bits == 2) {
            uint64_t w;
            memcpy(&w, src, 8);
            v = _mm512_or_si512(_mm512_maskz_mov_epi16(_pext_u64(w, 0x5555555555555555ull), _mm512_set1_epi16(1)),
                                _mm512_maskz_mov_epi16(_pext_u64(w, 0xAAAAAAAAAAAAAAAAull), _mm512_set1_epi16(2)));
        } else { /* byte b -> 32-bit lane (b & 15) | (b >> 4) << 16: two 16-bit ranks in order */
            __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)src));
            v = _mm512_or_si512(_mm512_and_si512(b, _mm512_set1_epi32(0xF)),
                                _mm512_slli_epi32(_mm512_and_si512(b, _mm512_set1_epi32(0xF0)), 12));
        }
        _mm512_storeu_si512(ranks + first, v);
    }
#endif
    int64_t whole = n / per;
    for (int64_t i = first / per; i < whole; i++)
        for (int s = 0; s < per; s++) ranks[i * per + s] = (uint16_t)((plane[i] >> (s * bits)) & mask);
    for (int64_t s = 0; s < n % per; s++) ranks[whole * per + s] = (uint16_t)((plane[whole] >> (s * bits)) & mask);
}

/* lynx_exact_unpack_bits into bytes, for bits 1, 2, 4 and 8 (the decode's byte classes): `n` ranks. */
void lynx_exact_unpack_bits8(const uint8_t *plane, int64_t n, int bits, uint8_t *ranks) {
    if (bits == 8) {
        memcpy(ranks, plane, (size_t)n);
        return;
    }
    int per = 8 / bits;
    uint32_t mask = (1u << bits) - 1u;
    int64_t first = 0;
#ifdef LYNX_EXACT_VECTOR
    for (; first + 64 <= n; first += 64) { /* 64 ranks from 8, 16 or 32 whole bytes of the plane */
        const uint8_t *src = plane + first / per;
        __m512i v;
        if (bits == 1) {
            uint64_t m;
            memcpy(&m, src, 8);
            v = _mm512_maskz_mov_epi8(m, _mm512_set1_epi8(1));
        } else if (bits == 2) {
            uint64_t w[2];
            memcpy(w, src, 16);
            uint64_t low = _pext_u64(w[0], 0x5555555555555555ull) | _pext_u64(w[1], 0x5555555555555555ull) << 32;
            uint64_t high = _pext_u64(w[0], 0xAAAAAAAAAAAAAAAAull) | _pext_u64(w[1], 0xAAAAAAAAAAAAAAAAull) << 32;
            v = _mm512_or_si512(_mm512_maskz_mov_epi8(low, _mm512_set1_epi8(1)), _mm512_maskz_mov_epi8(high, _mm512_set1_epi8(2)));
        } else { /* byte b -> 16-bit lane (b & 15) | (b >> 4) << 8: two byte ranks in order */
            __m512i b = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)src));
            v = _mm512_or_si512(_mm512_and_si512(b, _mm512_set1_epi16(0xF)),
                                _mm512_slli_epi16(_mm512_and_si512(b, _mm512_set1_epi16(0xF0)), 4));
        }
        _mm512_storeu_si512(ranks + first, v);
    }
#endif
    int64_t whole = n / per;
    for (int64_t i = first / per; i < whole; i++)
        for (int s = 0; s < per; s++) ranks[i * per + s] = (uint8_t)((plane[i] >> (s * bits)) & mask);
    for (int64_t s = 0; s < n % per; s++) ranks[whole * per + s] = (uint8_t)((plane[whole] >> (s * bits)) & mask);
}

/* Every class's rank array for the decode in one call: class k's ranks (available[k], from its low plane and, for
 * 16 bits, its high one) unpacked into buffer (bytes for the first byte_classes classes, then 16-bit ranks at even
 * addresses), each followed by `slack` entries; rank_ptrs[k] = where class k's ranks start. The buffer holds
 * sum over k of (available[k] + slack) entries of 1 or 2 bytes, plus num_classes. */
void lynx_exact_unpack_classes(int num_classes, int byte_classes, const int32_t *bits, const uint8_t *const *low,
                               const uint8_t *const *high, const int64_t *available, int64_t slack, uint8_t *buffer,
                               uint64_t *rank_ptrs) {
    uint8_t *at = buffer;
    for (int k = 0; k < num_classes; k++) {
        int bytes = k < byte_classes ? 1 : 2;
        at += bytes == 2 ? ((uintptr_t)at & 1u) : 0u;
        rank_ptrs[k] = (uint64_t)(uintptr_t)at;
        if (available[k] && bytes == 1) lynx_exact_unpack_bits8(low[k], available[k], bits[k], at);
        else if (available[k]) lynx_exact_unpack_bits(low[k], high[k], available[k], bits[k], (uint16_t *)at);
        at += bytes * (available[k] + slack);
    }
}

/* A decode error's code, unless a later group's statistics are NaN or Inf: then 4, as the reference, which
 * checks every statistic before it decodes anything. */
static int finish_walk(Walk *w, int err) {
    while (!w->not_finite && walk_row(w)) continue;
    walk_done(w);
    return w->not_finite ? 4 : err;
}

/* The decode's sources: ranks[k] (available[k] ranks, plus SLACK8 + hd readable entries), the escapes. The ranks
 * of a class whose bins hold at most 256 values (all < 256: Layer.byte_classes) are bytes, the others 16-bit. */
typedef struct {
    const void *const *ranks;
    const int64_t *available;
    const int32_t *escape_index;
    const uint16_t *escape_bits;
    int64_t escapes;
    uint16_t *out;
} DecodeSource;

static inline int overflowed(const int64_t *cur, const int64_t *available, int num_classes) {
    int bad = 0;
    for (int k = 1; k <= num_classes; k++) bad |= cur[k] > available[k - 1];
    return bad;
}

/* The BF16 bits of the row of values [base, base + hd) from its bins (Lr, Nr): the next escape is *e_io,
 * the next rank of class k cur[k]. Returns 0, or the error code of lynx_exact_decode (1 or 2). */
static inline int expand_row(const Layer *y, const DecodeSource *d, const int32_t *Lr, const int32_t *Nr, int64_t base,
                             int64_t *e_io, int64_t *cur) {
    const int64_t hd = y->hd, escapes = d->escapes;
    const int32_t *escape_index = d->escape_index;
    const int num_classes = y->num_classes;
    uint16_t *outr = d->out + base;
    int64_t e = *e_io;
#ifdef LYNX_EXACT_VECTOR
    /* the class cursors are checked against `available` once per row (the arrays hold SLACK8 + hd readable
     * entries past it), before an error 2 and at the row's end: a stream with too few ranks gives 1 unless a
     * value of an empty bin comes first (in a corrupt stream with both, the code may differ from the value by
     * value build's; both are errors, and the same for any thread count). 64 values at a time: the byte classes
     * expanded 64 ranks per instruction, the 16-bit ones 32. */
#define OVERFLOWED(cur) overflowed(cur, d->available, num_classes)
    const __m512i one = _mm512_set1_epi32(1);
    const int byte_classes = y->byte_classes;
    for (int64_t j = 0; j < hd; j += 4 * LANES) {
        __mmask64 live = hd - j >= 4 * LANES ? ~(__mmask64)0 : (((__mmask64)1 << (hd - j)) - 1u), esc = 0;
        int64_t e0 = e;
        int64_t end = base + (hd - j >= 4 * LANES ? j + 4 * LANES : hd);
        while (e < escapes && escape_index[e] < end) esc |= (__mmask64)1 << (escape_index[e++] - base - j);
        __mmask64 coded = live & ~esc;
        __m512i n[4];
        __m128i cls[4];
        int empty = 0;
#pragma GCC unroll 4
        for (int q = 0; q < 4; q++) {
            n[q] = _mm512_maskz_loadu_epi32((__mmask16)(live >> (16 * q)), Nr + j + 16 * q);
            empty |= ((__mmask16)(coded >> (16 * q)) & _mm512_cmplt_epi32_mask(n[q], one)) != 0;
            cls[q] = _mm512_cvtepi32_epi8(class16(n[q], &y->cb, y->lo, num_classes));
        }
        if (empty) return OVERFLOWED(cur) ? 1 : 2;
        __m512i cls8 = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_inserti128_si256(_mm256_castsi128_si256(cls[0]), cls[1], 1)),
                                          _mm256_inserti128_si256(_mm256_castsi128_si256(cls[2]), cls[3], 1), 1);
        __m512i r8 = _mm512_setzero_si512(), r16[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};
#pragma GCC unroll 16
        for (int k = 1; k <= MAX_CLASSES; k++) { /* every class, fixed order: no branch on the data */
            if (k > num_classes) break;
            __mmask64 m = coded & _mm512_cmpeq_epi8_mask(cls8, _mm512_set1_epi8((char)k));
            if (k <= byte_classes) {
                r8 = _mm512_or_si512(r8, expand_load8(m, (const uint8_t *)d->ranks[k - 1] + cur[k])); /* no chain */
                cur[k] += __builtin_popcountll(m);
            } else {
                for (int h = 0; h < 2; h++) {
                    __mmask32 mh = (__mmask32)(m >> (32 * h));
                    r16[h] = _mm512_or_si512(r16[h], expand_load16(mh, (const uint16_t *)d->ranks[k - 1] + cur[k]));
                    cur[k] += __builtin_popcount(mh);
                }
            }
        }
#pragma GCC unroll 4
        for (int q = 0; q < 4; q++) {
            __mmask16 live_q = (__mmask16)(live >> (16 * q)), coded_q = (__mmask16)(coded >> (16 * q));
            __m512i r = _mm512_or_si512(_mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32(r8, q)),
                                        _mm512_cvtepu16_epi32(q & 1 ? _mm512_extracti64x4_epi64(r16[q >> 1], 1)
                                                                    : _mm512_castsi512_si256(r16[q >> 1])));
            if (coded_q & _mm512_cmpge_epi32_mask(r, n[q])) return 1;
            __m512i b = bits_of16(_mm512_add_epi32(_mm512_maskz_loadu_epi32(live_q, Lr + j + 16 * q), r));
            _mm256_mask_storeu_epi16(outr + j + 16 * q, live_q, _mm512_cvtepi32_epi16(b));
        }
        for (; e0 < e; e0++) d->out[escape_index[e0]] = d->escape_bits[e0];
    }
    if (OVERFLOWED(cur)) return 1;
#undef OVERFLOWED
#else
    for (int64_t j = 0; j < hd; j++) {
        if (e < escapes && escape_index[e] == base + j) {
            outr[j] = d->escape_bits[e++];
            continue;
        }
        int32_t n = Nr[j], c = class_of(y->lut, n), r = 0;
        if (n < 1) return 2;
        if (c) {
            if (cur[c] >= d->available[c - 1]) return 1;
            r = c <= y->byte_classes ? ((const uint8_t *)d->ranks[c - 1])[cur[c]] : ((const uint16_t *)d->ranks[c - 1])[cur[c]];
            cur[c]++;
        }
        if (r >= n) return 1;
        outr[j] = (uint16_t)bits_of(Lr[j] + r);
    }
#endif
    *e_io = e;
    return 0;
}

/* The threaded decode: each worker takes the next chunk of rows (in order: a worker that never started, or
 * runs late, holds none the others wait for), computes its bins into its buffer, waits for the chunk before to
 * publish where its ranks end (state 1; 2: it or one before failed), then expands its own from there and
 * publishes. The expansions follow value order as in one thread, and overlap the other workers' bins. Every
 * chunk's bins are computed (a NaN / Inf statistic anywhere gives 4). */
typedef struct {
    const Layer *y;
    const DecodeSource *d;
    int64_t chunk_rows, chunks, next; /* next: the first chunk no worker has taken */
    int64_t (*ends)[MAX_CLASSES + 1]; /* per chunk: the class cursors after it */
    int *state, *err; /* per chunk */
} DecodeJob;

typedef struct {
    DecodeJob *job;
    int32_t *L, *N; /* chunk_rows x hd each */
    float *f_scratch;
    int32_t *i_scratch;
    int not_finite;
} DecodeWorker;

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

static int64_t first_escape_at(const DecodeSource *d, int64_t index) { /* the first escape >= index */
    int64_t lo = 0, hi = d->escapes;
    while (lo < hi) {
        int64_t mid = lo + (hi - lo) / 2;
        if (d->escape_index[mid] < index) lo = mid + 1; else hi = mid;
    }
    return lo;
}

static void *decode_worker(void *arg) {
    DecodeWorker *me = arg;
    DecodeJob *job = me->job;
    const Layer *y = job->y;
    const int64_t hd = y->hd;
    for (;;) {
        int64_t k = __atomic_fetch_add(&job->next, 1, __ATOMIC_RELAXED);
        if (k >= job->chunks) break;
        int64_t row0 = k * job->chunk_rows, stop = row0 + job->chunk_rows < y->T ? row0 + job->chunk_rows : y->T;
        Walk w;
        layer_walk(y, &w, me->f_scratch, me->i_scratch, row0, stop);
        for (int64_t row = 0; w.L = me->L + row * hd, w.N = me->N + row * hd, walk_row(&w); row++) continue;
        walk_done(&w);
        me->not_finite |= w.not_finite;
        int64_t cur[MAX_CLASSES + 1] = {0};
        int failed = 0;
        if (k > 0) {
            for (int spins = 0; __atomic_load_n(&job->state[k - 1], __ATOMIC_ACQUIRE) == 0; spins++)
                if (spins > 64) sched_yield(); else cpu_relax();
            failed = job->state[k - 1] == 2;
            memcpy(cur, job->ends[k - 1], sizeof(cur));
        }
        int err = 0;
        if (!failed) {
            int64_t e = first_escape_at(job->d, row0 * hd);
            for (int64_t row = row0; row < stop && !err; row++)
                if (row >= y->n_sink) err = expand_row(y, job->d, me->L + (row - row0) * hd, me->N + (row - row0) * hd,
                                                       row * hd, &e, cur);
        }
        job->err[k] = err;
        memcpy(job->ends[k], cur, sizeof(cur));
        __atomic_store_n(&job->state[k], failed || err ? 2 : 1, __ATOMIC_RELEASE);
    }
    return NULL;
}

/* Decode: BF16 bits of every value past the sink from its bin and either its escape (escape_index
 * ascending, every index past the sink: the caller checks) or the next rank of its class (ranks[k]:
 * available[k] ranks, plus SLACK8 + hd readable entries; bytes for the classes whose bins hold at most 256 values,
 * Layer.byte_classes, else 16-bit). cursor[k] = ranks read. Returns 0; 1 when a rank lies
 * outside its bin or a class holds too few ranks; 2 for an empty bin that was not escaped; 3 for a class
 * table the pass cannot hold; 4 when a group's mn or rng is NaN or Inf (a corrupt anchor). The values before
 * the sink's end are the anchor's first n_sink * hd BF16 values (the layer header). Scratch: 3 hd floats, 5 hd int32 per thread; `threads` > 1 also
 * `bins_scratch` (2 * threads * DECODE_CHUNK_VALUES int32, see lynx_exact_decode_chunk_rows): the same result. */
#define DECODE_CHUNK_VALUES 16384

int64_t lynx_exact_decode_chunk_rows(int64_t hd, int64_t C) {
    int64_t c = C > 0 ? C : 1, rows = (DECODE_CHUNK_VALUES / (hd > 0 ? hd : 1)) / c * c;
    return rows > 0 ? rows : c;
}

int lynx_exact_decode(const uint8_t *anchor, const uint8_t *residual, int64_t T, int64_t hd, int is_key, int64_t P,
                      int64_t C, int64_t G, int64_t n_sink, const int32_t *lo, const int32_t *hi, int num_classes,
                      const void *const *ranks, const int64_t *available, const int32_t *escape_index,
                      const uint16_t *escape_bits, int64_t escapes, uint16_t *out, int64_t *cursor, float *f_scratch,
                      int32_t *i_scratch, int threads, int32_t *bins_scratch) {
    Layer y;
    if (!layer_init(&y, anchor, residual, T, hd, is_key, P, C, G, n_sink, lo, hi, num_classes)) return 3;
    init_tables();
    memcpy(out, anchor, (size_t)(n_sink * hd) * sizeof(uint16_t)); /* the sink, from the layer header */
    const DecodeSource d = {ranks, available, escape_index, escape_bits, escapes, out};
    threads = threads < 1 ? 1 : (threads > MAX_THREADS ? MAX_THREADS : threads);
    int64_t chunk_rows = lynx_exact_decode_chunk_rows(hd, C), chunks = (T + chunk_rows - 1) / chunk_rows;
    if (threads > 1 && chunks > 1 && bins_scratch) {
        int64_t workers = threads < chunks ? threads : chunks;
        int64_t (*ends)[MAX_CLASSES + 1] = malloc(chunks * sizeof(*ends));
        int *state = calloc(2 * chunks, sizeof(int));
        if (ends && state) {
            DecodeJob job = {&y, &d, chunk_rows, chunks, 0, ends, state, state + chunks};
            DecodeWorker ws[MAX_THREADS];
            for (int i = 0; i < workers; i++)
                ws[i] = (DecodeWorker){&job, bins_scratch + 2 * i * chunk_rows * hd,
                                       bins_scratch + (2 * i + 1) * chunk_rows * hd, f_scratch + 3 * hd * i,
                                       i_scratch + 5 * hd * i, 0};
            run_parts(decode_worker, ws, sizeof(DecodeWorker), (int)workers);
            int not_finite = 0, err = 0;
            for (int i = 0; i < workers; i++) not_finite |= ws[i].not_finite;
            for (int64_t k = 0; k < chunks && !err; k++) err = job.err[k];
            if (!not_finite && !err)
                for (int k = 0; k < num_classes; k++) cursor[k] = ends[chunks - 1][k + 1];
            free(ends);
            free(state);
            return not_finite ? 4 : err;
        }
        free(ends);
        free(state);
    }
    int64_t cur[MAX_CLASSES + 1] = {0}, e = 0;
    Walk w;
    layer_walk(&y, &w, f_scratch, i_scratch, 0, T);
    for (int64_t base = 0; walk_row(&w); base += hd) {
        if (base < n_sink * hd) continue; /* the layer header restores the sink */
        int err = expand_row(&y, &d, w.L, w.N, base, &e, cur);
        if (err) return finish_walk(&w, err);
    }
    walk_done(&w);
    if (w.not_finite) return 4;
    for (int k = 0; k < num_classes; k++) cursor[k] = cur[k + 1];
    return 0;
}
