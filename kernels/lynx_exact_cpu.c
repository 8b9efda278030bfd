/* CPU fast path of the lynx-exact stream's transform (python/sglang_lynx/codec/exact_bins.py and
 * lynx_exact.py document it): the bin (L, n) of every value from a layer's lynx anchor + residual,
 * the ranks split into the rank classes (encode), and the BF16 bits back from bins + ranks (decode).
 * zstd stays in Python (the zstandard package). Built by lynx_exact_cpu.py with -O3 -march=native
 * -ffp-contract=off -fno-trapping-math: every float / double operation is the reference's, in its order
 * (no FMA contraction), so (L, n) are identical; tested against the reference. */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#define WINDOW 2
#define ORD_MIN_FINITE 0x0080
#define ORD_MAX_FINITE 0xFF7F

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

/* T225[c] = ((double)c - 0.5) / 225.0 for c = 0..226: the same double operations as the reference's
 * ((code - 0.5) / FULL_LEVELS), done once. */
static double T225[227];

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

/* UTH[c] = the least float u in [0, 1] with code_of_u(u) >= c (FLT_MAX when none: c = 226). code_of_u is
 * non-decreasing in u (a and f are, and 15 a + clamp(f - 15 a, -7, 7) = clamp(f, 15 a - 7, 15 a + 7) grows
 * with both), so for c >= 1 "the code of v < c" is exactly "q < UTH[c]" with q = (v - mn) / rs unclamped: q < 0
 * gives u = 0 and code 0 < c, and q > 1 gives code 225 >= c when c <= 225 (then UTH[c] <= 1 < q). Only
 * c >= 1 is asked where the result is used (lower(0) is replaced by cap_lo). Non-negative floats are
 * ordered as their bit patterns, so a binary search over the patterns of [0, 1] finds each UTH[c]. */
static float UTH[227];
static int tables_ready;

static void init_tables(void) {
    if (tables_ready) return;
    for (int c = 0; c < 227; c++) T225[c] = ((double)c - 0.5) / 225.0;
    for (int c = 0; c < 227; c++) {
        uint32_t lo = 0, hi = 0x3F800000u; /* 0.0f .. 1.0f */
        float one = 1.0f;
        if (code_of_u(one) < c) {
            UTH[c] = FLT_MAX;
            continue;
        }
        while (lo < hi) { /* least pattern in [lo, hi] whose code is >= c */
            uint32_t mid = lo + (hi - lo) / 2;
            float u;
            memcpy(&u, &mid, 4);
            if (code_of_u(u) >= c) hi = mid; else lo = mid + 1;
        }
        memcpy(&UTH[c], &lo, 4);
    }
    tables_ready = 1; /* idempotent: a race writes the same values */
}

/* lower(f): est - WINDOW + (ordinals of the window est - WINDOW .. est + WINDOW whose code is < f), the
 * code compared through UTH (init_tables) instead of recomputed: the same count for every f >= 1. */
static inline int32_t lower_bound(int32_t code, float mn, float rng) {
    double target = (double)mn + (double)rng * T225[code];
    int32_t est = nearest_ord(target), below = 0;
    float rs = rng > 0.0f ? rng : 1.0f, th = UTH[code];
#pragma GCC unroll 8
    for (int j = -WINDOW; j <= WINDOW; j++) below += (val_of(est + j) - mn) / rs < th;
    return est - WINDOW + below;
}

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

/* (L, n) of every value of one layer's K (is_key) or V: the lynx streams' layout (lynx_format.py).
 * Row scratch (hd each): the group's mn / rng / caps of every channel, refreshed once per key chunk
 * (keys: one group per channel and chunk) or per token (values: hd / G groups), and the codes. */
void lynx_exact_bins(const uint8_t *anchor, const uint8_t *residual, int64_t T, int64_t hd, int is_key, int64_t P,
                     int64_t C, int64_t G, int64_t n_sink, int32_t *L, int32_t *N, float *mn_row, float *rng_row,
                     int32_t *code_row, int32_t *cap_lo_row, int32_t *cap_hi_row) {
    init_tables();
    const uint8_t *block = anchor + n_sink * hd * 2, *res = residual;
    for (int64_t start = 0; start < T; start += P) {
        int64_t n_p = T - start < P ? T - start : P;
        int64_t groups = is_key ? ((n_p + C - 1) / C) * hd : n_p * (hd / G);
        const uint8_t *mn_b = block, *rng_b = block + 2 * groups, *codes = block + 4 * groups;
        for (int64_t t = 0; t < n_p; t++) {
            if (!is_key || t % C == 0) {
                int64_t per = is_key ? 1 : G, first_group = is_key ? (t / C) * hd : t * (hd / G);
                for (int64_t j0 = 0; j0 < hd; j0 += per) {
                    uint16_t m, r;
                    int64_t g = first_group + j0 / per;
                    memcpy(&m, mn_b + 2 * g, 2);
                    memcpy(&r, rng_b + 2 * g, 2);
                    float mn = half_to_float(m), rng = half_to_float(r);
                    int32_t cap_lo, cap_hi;
                    group_caps(mn, rng, &cap_lo, &cap_hi);
                    for (int64_t j = j0; j < j0 + per; j++) {
                        mn_row[j] = mn;
                        rng_row[j] = rng;
                        cap_lo_row[j] = cap_lo;
                        cap_hi_row[j] = cap_hi;
                    }
                }
            }
            const uint8_t *a_row = codes + t * hd / 2, *r_row = res + t * hd / 2;
            for (int64_t j = 0; j < hd; j += 2) {
                uint8_t a2 = a_row[j >> 1], q2 = r_row[j >> 1];
                code_row[j] = (a2 & 0xF) * 15 + (q2 & 0xF) - 7;
                code_row[j + 1] = (a2 >> 4) * 15 + (q2 >> 4) - 7;
            }
            int32_t *Lr = L + (start + t) * hd, *Nr = N + (start + t) * hd;
            for (int64_t j = 0; j < hd; j++) {
                float mn = mn_row[j], rng = rng_row[j];
                int32_t code = code_row[j], cap_lo = cap_lo_row[j], cap_hi = cap_hi_row[j];
                int32_t below = lower_bound(code, mn, rng), above = lower_bound(code + 1, mn, rng); /* branch-free */
                int32_t first = code > 0 ? below : cap_lo;
                int32_t after = code < 225 ? above : cap_hi + 1;
                first = first > cap_lo ? first : cap_lo;
                int32_t last = after - 1 < cap_hi ? after - 1 : cap_hi;
                Lr[j] = first;
                Nr[j] = last - first + 1;
            }
        }
        block += 4 * groups + n_p * hd / 2;
        res += n_p * hd / 2;
    }
}

/* The rank class of each bin size n = 0..256 (lut[n] = k + 1, 0: none) from the classes' [lo, hi]. */
static void class_lut(const int32_t *lo, const int32_t *hi, int num_classes, uint8_t *lut) {
    for (int n = 0; n <= 256; n++) {
        lut[n] = 0;
        for (int k = 0; k < num_classes; k++)
            if (n >= 2 && n >= lo[k] && n <= hi[k]) lut[n] = (uint8_t)(k + 1);
    }
}

static inline uint8_t class_of(const uint8_t *lut, int32_t n, const int32_t *lo, const int32_t *hi, int num_classes) {
    if (n <= 256) return lut[n < 0 ? 0 : n];
    for (int k = 0; k < num_classes; k++)
        if (n >= lo[k] && n <= hi[k]) return (uint8_t)(k + 1);
    return 0;
}

/* Per-class tables with a dummy class in front (index 0: nothing coded, n == 1, or the sink): index
 * k + 1 is class k, so the hot loops read and write without branching on the class. log2(8 / bits) for
 * bits 1, 2, 4, 8 (16-bit classes take their own, rare, branch). */
#define MAX_CLASSES 16
static inline int lg_of(int b) { return b == 1 ? 3 : (b == 2 ? 2 : (b == 4 ? 1 : 0)); }

/* Encode pass 1: rank and class of every value (cls 0: nothing to send, 255: escape, k + 1: class k);
 * counts[k] += values of class k. Returns the number of escapes, or -1 when a value is NaN or Inf. */
int64_t lynx_exact_classify(const uint16_t *x, const int32_t *L, const int32_t *N, int64_t count, int64_t skip,
                            const int32_t *lo, const int32_t *hi, int num_classes, uint8_t *cls, uint16_t *rank,
                            int64_t *counts) {
    uint8_t lut[257];
    int64_t tally[MAX_CLASSES + 1] = {0};
    if (num_classes > MAX_CLASSES) return -2;
    class_lut(lo, hi, num_classes, lut);
    int64_t escapes = 0, nonfinite = 0;
    for (int64_t i = 0; i < count; i++) nonfinite |= (x[i] & 0x7F80) == 0x7F80;
    if (nonfinite) return -1;
    for (int64_t i = 0; i < skip && i < count; i++) {
        cls[i] = 0;
        rank[i] = 0;
    }
    for (int64_t i = skip; i < count; i++) {
        int32_t r = ord_of(x[i]) - L[i], n = N[i];
        uint8_t c = n <= 256 ? lut[n < 0 ? 0 : n] : class_of(lut, n, lo, hi, num_classes);
        int escaped = (r < 0) | (r >= n);
        c = escaped ? 255 : c;
        escapes += escaped;
        tally[escaped ? 0 : c]++;
        cls[i] = c;
        rank[i] = (uint16_t)(r < 0 ? 0 : r);
    }
    for (int k = 0; k < num_classes; k++) counts[k] += tally[k + 1];
    return escapes;
}

/* Encode pass 2: pack the ranks of each class into its planes (plane[2k], and plane[2k + 1] for 16-bit
 * classes: the high bytes), LSB first; the escapes' indices and bits. Planes must be zeroed. */
int lynx_exact_pack(const uint16_t *x, const uint8_t *cls, const uint16_t *rank, int64_t count,
                    const int32_t *bits, int num_classes, uint8_t **planes, int64_t *cursor, int32_t *escape_index,
                    uint16_t *escape_bits) {
    uint8_t scratch = 0;
    uint8_t *pl[MAX_CLASSES + 1];
    int bs[MAX_CLASSES + 1], lgs[MAX_CLASSES + 1];
    int64_t cur[MAX_CLASSES + 1];
    if (num_classes > MAX_CLASSES) return 1;
    pl[0] = &scratch, bs[0] = 0, lgs[0] = 0, cur[0] = 0;
    for (int k = 0; k < num_classes; k++) {
        pl[k + 1] = planes[2 * k] ? planes[2 * k] : &scratch; /* an empty class has no plane and no rank */
        bs[k + 1] = bits[k], lgs[k + 1] = lg_of(bits[k]), cur[k + 1] = cursor[k];
    }
    int64_t e = 0;
    for (int64_t i = 0; i < count; i++) {
        uint8_t c = cls[i];
        if (c == 255) {
            escape_index[e] = (int32_t)i;
            escape_bits[e++] = x[i];
            continue;
        }
        int b = bs[c], lg = lgs[c];
        int64_t at = cur[c];
        cur[c] = at + (c != 0);
        if (b == 16) {
            planes[2 * (c - 1)][at] = (uint8_t)(rank[i] & 0xFF);
            planes[2 * (c - 1) + 1][at] = (uint8_t)(rank[i] >> 8);
        } else {
            pl[c][c ? at >> lg : 0] |= (uint8_t)(rank[i] << ((at & ((1 << lg) - 1)) * b));
        }
    }
    for (int k = 0; k < num_classes; k++) cursor[k] = cur[k + 1];
    return 0;
}

/* Decode: BF16 bits of every value from (L, n), the escapes (ascending) and the classes' planes.
 * Returns 0; 1 when a rank lies outside its bin or a class holds too few ranks; 2 for an empty bin
 * that was not escaped. Values before `skip` (the sink) are left as they are. */
int lynx_exact_restore(const int32_t *L, const int32_t *N, int64_t count, int64_t skip, const int32_t *lo,
                       const int32_t *hi, const int32_t *bits, int num_classes, const uint8_t **planes,
                       const int64_t *available, const int32_t *escape_index, const uint16_t *escape_bits,
                       int64_t escapes, uint16_t *out, int64_t *cursor) {
    int64_t e = 0; /* cursor[k] (zeroed by the caller): ranks of class k read, for the caller's length check */
    uint8_t lut[257];
    static const uint8_t zero = 0;
    const uint8_t *pl[MAX_CLASSES + 1];
    int bs[MAX_CLASSES + 1], lgs[MAX_CLASSES + 1];
    int64_t cur[MAX_CLASSES + 1], avail[MAX_CLASSES + 1];
    if (num_classes > MAX_CLASSES) return 1;
    class_lut(lo, hi, num_classes, lut);
    lut[1] = 0; /* n == 1: the dummy class (nothing coded) */
    pl[0] = &zero, bs[0] = 0, lgs[0] = 0, cur[0] = 0, avail[0] = INT64_MAX;
    for (int k = 0; k < num_classes; k++) {
        pl[k + 1] = planes[2 * k] ? planes[2 * k] : &zero;
        bs[k + 1] = bits[k], lgs[k + 1] = lg_of(bits[k]), cur[k + 1] = 0, avail[k + 1] = available[k];
    }
    for (int64_t i = skip; i < count; i++) {
        if (e < escapes && escape_index[e] == i) {
            out[i] = escape_bits[e++];
            continue;
        }
        int32_t n = N[i], r;
        if (n < 1) return 2;
        int c = n <= 256 ? lut[n] : class_of(lut, n, lo, hi, num_classes);
        if (c == 0 && n >= 2) return 1;
        int64_t at = cur[c];
        if (at >= avail[c]) return 1;
        cur[c] = at + (c != 0);
        int b = bs[c];
        if (b == 16) {
            r = planes[2 * (c - 1)][at] | (planes[2 * (c - 1) + 1][at] << 8);
        } else {
            int lg = lgs[c];
            r = (pl[c][c ? at >> lg : 0] >> ((at & ((1 << lg) - 1)) * b)) & ((1 << b) - 1);
        }
        if (r >= n) return 1;
        out[i] = (uint16_t)bits_of(L[i] + r);
    }
    for (int k = 0; k < num_classes; k++) cursor[k] = cur[k + 1];
    return 0;
}
