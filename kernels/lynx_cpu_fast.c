/* CPU fast path of the lynx codec (alpha = 0): one pass per page, byte-identical to the torch
 * reference (python/sglang_lynx/codec/lynx_format.py, whose docstring documents the code and layout).
 * Built by lynx_cpu_fast.py with -O3 -march=native -ffp-contract=off -fno-trapping-math (no FMA
 * contraction, IEEE division; no-trapping only lets ceilf vectorise), so every float operation is the
 * reference's, in its order. The loops run over whole rows so that they vectorise (lynx_cpu_fast_rows.h);
 * only min / max are regrouped across lanes, which is exact (see minmax there).
 * The entry points take a page range [p0, p1), so the wrapper may run disjoint ranges on threads. */
#include <stdlib.h>

#include "lynx_cpu_fast_rows.h"

/* Encode pages [p0, p1) of one layer's K (is_key) or V into the preallocated streams; peak[page] gets
 * the largest |min|, |max| of the page's groups. p0 == 0 also writes the bf16 header (n_sink tokens).
 * Returns 0; 1 when a value is NaN or Inf (streams then incomplete); 2 when a page's peak exceeds
 * `safe` (the fp16-safe range; streams complete); -1 when out of memory. */
int lynx_encode(const void *x, int dtype, int64_t T, int64_t hd, int is_key, int64_t P, int64_t C, int64_t G,
                int64_t S, int64_t n_sink, int64_t hdr_bytes, int64_t a_page, int64_t r_page, int64_t p0, int64_t p1,
                uint8_t *anchor, uint8_t *residual, float *peak, float safe) {
    int64_t esize = dtype == DT_F32 ? 4 : 2, nm = is_key ? hd : P * (hd / G); /* metadata records per block */
    float *buf = (float *)malloc((size_t)(P * hd + 3 * hd + 5 * nm) * sizeof(float));
    if (!buf) return -1;
    float *mn = buf + P * hd, *rs = mn + hd, *pk = rs + hd; /* per value of a row; pk: per-lane peaks */
    float *lo = pk + hd, *hi = lo + nm, *gm = hi + nm, *gr = gm + nm, *d = gr + nm; /* per group */
    int rc = 0;
    if (p0 == 0 && n_sink > 0) { /* the header: exact bf16 copy of the first tokens */
        if (load_values(x, dtype, n_sink * hd, buf)) rc = 1;
        for (int64_t i = 0; i < n_sink * hd; i++) put_u16(anchor, i, f32_to_bf16(buf[i]));
    }
    for (int64_t p = p0; p < p1 && rc != 1; p++) {
        int64_t start = p * P, n_p = T - start < P ? T - start : P;
        if (load_values((const uint8_t *)x + start * hd * esize, dtype, n_p * hd, buf)) {
            rc = 1;
            break;
        }
        uint8_t *block = anchor + hdr_bytes + p * a_page, *res = residual + p * r_page;
        memset(pk, 0, (size_t)hd * sizeof(float)); /* max of |lo|, |hi| (all >= 0) is order-free */
        if (is_key) {
            int64_t chunks = (n_p + C - 1) / C, groups = chunks * hd;
            uint8_t *codes_out = block + 4 * groups;
            int sink_on = p == 0 && S > 0 && S < n_p;
            for (int64_t c = 0; c < chunks; c++) {
                int64_t t0 = c * C, t1 = t0 + C < n_p ? t0 + C : n_p;
                const float *first = buf + ((sink_on && t0 < S) ? S : t0) * hd;
                memcpy(lo, first, (size_t)hd * 4);
                memcpy(hi, first, (size_t)hd * 4);
                for (int64_t t = t0 + 1; t < t1; t++) {
                    const float *restrict row = buf + ((sink_on && t < S) ? S : t) * hd;
                    for (int64_t j = 0; j < hd; j++) {
                        lo[j] = row[j] < lo[j] ? row[j] : lo[j];
                        hi[j] = row[j] > hi[j] ? row[j] : hi[j];
                    }
                }
                for (int64_t j = 0; j < hd; j++) {
                    float l = fabsf(lo[j]), h = fabsf(hi[j]), m = l > h ? l : h;
                    pk[j] = m > pk[j] ? m : pk[j];
                }
                group_meta(lo, hi, hd, block + 2 * c * hd, block + 2 * (groups + c * hd), mn, rs, d);
                for (int64_t t = t0; t < t1; t++)
                    code_row(buf + t * hd, mn, rs, hd, codes_out + t * (hd / 2), res + t * (hd / 2));
            }
        } else {
            int64_t per_row = hd / G, groups = n_p * per_row;
            uint8_t *codes_out = block + 4 * groups;
            for (int64_t g = 0; g < groups; g++) {
                minmax(buf + g * G, G, &lo[g], &hi[g]);
                float l = fabsf(lo[g]), h = fabsf(hi[g]), m = l > h ? l : h;
                pk[0] = m > pk[0] ? m : pk[0];
            }
            group_meta(lo, hi, groups, block, block + 2 * groups, gm, gr, d);
            for (int64_t t = 0; t < n_p; t++) {
                for (int64_t q = 0; q < per_row; q++)
                    for (int64_t k = 0; k < G; k++) {
                        mn[q * G + k] = gm[t * per_row + q];
                        rs[q * G + k] = gr[t * per_row + q];
                    }
                code_row(buf + t * hd, mn, rs, hd, codes_out + t * (hd / 2), res + t * (hd / 2));
            }
        }
        float page_peak = 0.0f;
        for (int64_t j = 0; j < hd; j++) page_peak = pk[j] > page_peak ? pk[j] : page_peak;
        peak[p] = page_peak;
        if (page_peak > safe) rc = 2;
    }
    free(buf);
    return rc;
}

/* 0 when every slot is in [0, rows), 1 otherwise */
int lynx_check_slots(const int64_t *slots, int64_t T, int64_t rows) {
    int bad = 0;
    for (int64_t t = 0; t < T; t++) bad |= (slots[t] < 0) | (slots[t] >= rows);
    return bad;
}

/* one decoded row x = u * rng + mn (u from the anchor nibbles and, if rb, the residual nibbles) into dst */
static void decode_row(const uint8_t *restrict ab, const uint8_t *restrict rb, const float *restrict mf,
                       const float *restrict rf, int64_t hd, uint8_t *restrict dst, int dtype) {
    float x[hd];
    if (rb) {
        for (int64_t i = 0; i < hd / 2; i++) {
            x[2 * i] = (float)((ab[i] & 15) * 15 + (rb[i] & 15) - 7) / 225.0f;
            x[2 * i + 1] = (float)((ab[i] >> 4) * 15 + (rb[i] >> 4) - 7) / 225.0f;
        }
    } else {
        for (int64_t i = 0; i < hd / 2; i++) {
            x[2 * i] = (float)(ab[i] & 15) / 15.0f;
            x[2 * i + 1] = (float)(ab[i] >> 4) / 15.0f;
        }
    }
    for (int64_t j = 0; j < hd; j++) x[j] = x[j] * rf[j] + mf[j];
    if (dtype == DT_F32) {
        memcpy(dst, x, (size_t)hd * 4);
    } else if (dtype == DT_BF16) {
        uint16_t bits[hd];
        for (int64_t j = 0; j < hd; j++) bits[j] = f32_to_bf16(x[j]);
        memcpy(dst, bits, (size_t)hd * 2);
    } else {
        f32_to_f16_row(x, dst, hd);
    }
}

/* Decode pages [p0, p1) of one layer's K or V into pool[slots[t]] in the pool dtype. The residual of
 * token t is residual + t * hd / 2; without it (anchor-only), tokens from trail_first on read theirs
 * from `trailer` (the layer trailer) and the others decode a / 15. The first `sink` tokens come from
 * the bf16 header at the start of the anchor stream. Slots must be in range (lynx_check_slots).
 * Returns 0; -1 when out of memory (nothing written). */
int lynx_decode(const uint8_t *anchor, const uint8_t *residual, const uint8_t *trailer, int64_t trail_first,
                void *pool, int pool_dtype, int64_t pool_stride, const int64_t *slots, int64_t T, int64_t hd,
                int is_key, int64_t P, int64_t C, int64_t G, int64_t sink, int64_t hdr_bytes, int64_t a_page,
                int64_t p0, int64_t p1) {
    int64_t esize = pool_dtype == DT_F32 ? 4 : 2, half = hd / 2, per_row = hd / G;
    int64_t nm = is_key ? hd : P * per_row; /* metadata records converted at once: a chunk's, a page's */
    float *buf = (float *)malloc((size_t)(2 * hd + 2 * nm) * sizeof(float));
    if (!buf) return -1;
    float *mf = buf, *rf = mf + hd, *gm = rf + hd, *gr = gm + nm;
    for (int64_t p = p0; p < p1; p++) {
        int64_t start = p * P, n_p = T - start < P ? T - start : P, loaded = -1;
        const uint8_t *block = anchor + hdr_bytes + p * a_page;
        int64_t groups = is_key ? ((n_p + C - 1) / C) * hd : n_p * per_row;
        const uint8_t *mn_b = block, *rng_b = block + 2 * groups, *codes_in = block + 4 * groups;
        if (!is_key) {
            f16_to_f32_row(mn_b, gm, groups);
            f16_to_f32_row(rng_b, gr, groups);
        }
        for (int64_t t = 0; t < n_p; t++) {
            int64_t tok = start + t;
            uint8_t *dst = (uint8_t *)pool + slots[tok] * pool_stride * esize;
            if (tok < sink) { /* bf16 header -> pool dtype (exact through float32) */
                const uint8_t *hdr = anchor + 2 * tok * hd;
                if (pool_dtype == DT_BF16) {
                    memcpy(dst, hdr, (size_t)hd * 2);
                    continue;
                }
                float row[hd];
                for (int64_t j = 0; j < hd; j++) {
                    uint32_t u = (uint32_t)get_u16(hdr, j) << 16;
                    memcpy(&row[j], &u, 4);
                }
                if (pool_dtype == DT_F32) memcpy(dst, row, (size_t)hd * 4);
                else f32_to_f16_row(row, dst, hd);
                continue;
            }
            if (is_key && t / C != loaded) { /* channel metadata of this chunk */
                loaded = t / C;
                f16_to_f32_row(mn_b + 2 * loaded * hd, mf, hd);
                f16_to_f32_row(rng_b + 2 * loaded * hd, rf, hd);
            } else if (!is_key) { /* this token's group metadata, spread over its values */
                for (int64_t q = 0; q < per_row; q++)
                    for (int64_t k = 0; k < G; k++) {
                        mf[q * G + k] = gm[t * per_row + q];
                        rf[q * G + k] = gr[t * per_row + q];
                    }
            }
            const uint8_t *rb = residual ? residual + tok * half
                                : tok >= trail_first ? trailer + (tok - trail_first) * half : NULL;
            decode_row(codes_in + t * half, rb, mf, rf, hd, dst, pool_dtype);
        }
    }
    free(buf);
    return 0;
}
