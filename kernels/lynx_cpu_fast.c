/* CPU fast path of the lynx codec (alpha = 0): one pass per page, byte-identical to the torch
 * reference (python/sglang_lynx/codec/lynx_format.py, whose docstring documents the code and layout).
 * Built by lynx_cpu_fast.py with -O3 -ffp-contract=off -fno-trapping-math (no FMA contraction, IEEE
 * division; no-trapping only lets ceilf vectorise), so every
 * float operation is the reference's, in its order. Single-threaded; no allocation but one page buffer. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { DT_F32 = 0, DT_BF16 = 1, DT_F16 = 2 };

static inline float bf16_to_f32(uint16_t b) {
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

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

/* bits of the largest fp16 <= x (quant_math.fp16_floor) */
static inline uint16_t fp16_floor_bits(float x) {
    _Float16 h = (_Float16)x;
    int16_t b = (int16_t)h_bits(h);
    if ((float)h > x) {
        if (b == 0 || b == (int16_t)0x8000) return 0x8001;
        b = b > 0 ? (int16_t)(b - 1) : (int16_t)(b + 1);
    }
    return (uint16_t)b;
}

static inline void put_f16(uint8_t *p, int64_t idx, uint16_t bits) {
    p[2 * idx] = (uint8_t)(bits & 0xFF);
    p[2 * idx + 1] = (uint8_t)(bits >> 8);
}

static inline float get_f16(const uint8_t *p, int64_t idx) {
    return (float)h_from_bits((uint16_t)(p[2 * idx] | (p[2 * idx + 1] << 8)));
}

/* anchor and biased residual codes of n values with per-value fp16 min and safe range */
static void code_row(const float *restrict x, const float *restrict mn, const float *restrict rs, int64_t n,
                     uint8_t *restrict a_out, uint8_t *restrict r_out) {
    for (int64_t j = 0; j < n; j++) {
        float u = (x[j] - mn[j]) / rs[j];
        u = u < 0.0f ? 0.0f : u;
        u = u > 1.0f ? 1.0f : u;
        float a = ceilf(u * 15.0f - 0.5f);
        a = a < 0.0f ? 0.0f : a;
        a = a > 15.0f ? 15.0f : a;
        float f = ceilf(u * 225.0f - 0.5f);
        f = f < 0.0f ? 0.0f : f;
        f = f > 225.0f ? 225.0f : f;
        float r = f - a * 15.0f;
        r = r < -7.0f ? -7.0f : r;
        r = r > 7.0f ? 7.0f : r;
        a_out[j] = (uint8_t)(int32_t)a;
        r_out[j] = (uint8_t)(int32_t)(r + 7.0f);
    }
}

static void pack_row(const uint8_t *codes_in, int64_t n, uint8_t *out) {
    for (int64_t i = 0; i < n / 2; i++) out[i] = (uint8_t)(codes_in[2 * i] | (codes_in[2 * i + 1] << 4));
}

/* float32 copy of rows [first, first + count); returns 0 when all are finite, 1 otherwise */
static int load_rows(const void *x, int dtype, int64_t first, int64_t count, int64_t hd, float *out) {
    int64_t n = count * hd;
    if (dtype == DT_F32) {
        memcpy(out, (const float *)x + first * hd, (size_t)n * 4);
    } else if (dtype == DT_BF16) {
        const uint16_t *src = (const uint16_t *)x + first * hd;
        for (int64_t i = 0; i < n; i++) out[i] = bf16_to_f32(src[i]);
    } else {
        const _Float16 *src = (const _Float16 *)x + first * hd;
        for (int64_t i = 0; i < n; i++) out[i] = (float)src[i];
    }
    float acc = 0.0f; /* x * 0 is NaN exactly for NaN and +-Inf */
    for (int64_t i = 0; i < n; i++) acc += out[i] * 0.0f;
    return acc == acc ? 0 : 1;
}

/* Encode all pages of one layer's K (is_key) or V into the preallocated streams; peak[page] gets the
 * largest |min|, |max| of the page's groups (the caller raises above the fp16-safe range).
 * Returns 0; 1 when a value is NaN or Inf (streams then incomplete); -1 when out of memory. */
int lynx_encode(const void *x, int dtype, int64_t T, int64_t hd, int is_key, int64_t P, int64_t C, int64_t G,
                int64_t S, int64_t hdr_bytes, int64_t a_page, int64_t r_page, uint8_t *anchor, uint8_t *residual,
                float *peak) {
    float *buf = (float *)malloc((size_t)(P * hd) * sizeof(float));
    float *lo = (float *)malloc((size_t)hd * sizeof(float));
    float *hi = (float *)malloc((size_t)hd * sizeof(float));
    float *mn = (float *)malloc((size_t)hd * sizeof(float));
    float *rs = (float *)malloc((size_t)hd * sizeof(float));
    uint8_t *ta = (uint8_t *)malloc((size_t)hd), *tr = (uint8_t *)malloc((size_t)hd);
    if (!buf || !lo || !hi || !mn || !rs || !ta || !tr) {
        free(buf); free(lo); free(hi); free(mn); free(rs); free(ta); free(tr);
        return -1;
    }
    int64_t pages = (T + P - 1) / P;
    for (int64_t p = 0; p < pages; p++) {
        int64_t start = p * P, n_p = T - start < P ? T - start : P;
        if (load_rows(x, dtype, start, n_p, hd, buf)) {
            free(buf); free(lo); free(hi); free(mn); free(rs); free(ta); free(tr);
            return 1;
        }
        uint8_t *block = anchor + hdr_bytes + p * a_page;
        uint8_t *res = residual + p * r_page;
        float page_peak = 0.0f;
        if (is_key) {
            int64_t chunks = (n_p + C - 1) / C, groups = chunks * hd;
            uint8_t *codes_out = block + 4 * groups;
            int sink_on = p == 0 && S > 0 && S < n_p;
            for (int64_t c = 0; c < chunks; c++) {
                int64_t t0 = c * C, t1 = t0 + C < n_p ? t0 + C : n_p;
                for (int64_t t = t0; t < t1; t++) {
                    const float *row = buf + ((sink_on && t < S) ? S : t) * hd;
                    if (t == t0) {
                        memcpy(lo, row, (size_t)hd * 4);
                        memcpy(hi, row, (size_t)hd * 4);
                    } else {
                        for (int64_t j = 0; j < hd; j++) {
                            lo[j] = row[j] < lo[j] ? row[j] : lo[j];
                            hi[j] = row[j] > hi[j] ? row[j] : hi[j];
                        }
                    }
                }
                for (int64_t j = 0; j < hd; j++) {
                    float l = fabsf(lo[j]), h = fabsf(hi[j]);
                    page_peak = l > page_peak ? l : page_peak;
                    page_peak = h > page_peak ? h : page_peak;
                    uint16_t mb = fp16_floor_bits(lo[j]);
                    float m = (float)h_from_bits(mb);
                    uint16_t rb = fp16_floor_bits(-(hi[j] - m)) ^ 0x8000u;
                    float r = (float)h_from_bits(rb);
                    put_f16(block, c * hd + j, mb);
                    put_f16(block + 2 * groups, c * hd + j, rb);
                    mn[j] = m;
                    rs[j] = r > 0.0f ? r : 1.0f;
                }
                for (int64_t t = t0; t < t1; t++) {
                    code_row(buf + t * hd, mn, rs, hd, ta, tr);
                    pack_row(ta, hd, codes_out + t * (hd / 2));
                    pack_row(tr, hd, res + t * (hd / 2));
                }
            }
        } else {
            int64_t groups = n_p * (hd / G);
            uint8_t *codes_out = block + 4 * groups;
            for (int64_t g = 0; g < groups; g++) {
                const float *row = buf + g * G;
                float l = row[0], h = row[0];
                for (int64_t k = 1; k < G; k++) {
                    l = row[k] < l ? row[k] : l;
                    h = row[k] > h ? row[k] : h;
                }
                float al = fabsf(l), ah = fabsf(h);
                page_peak = al > page_peak ? al : page_peak;
                page_peak = ah > page_peak ? ah : page_peak;
                uint16_t mb = fp16_floor_bits(l);
                float m = (float)h_from_bits(mb);
                uint16_t rb = fp16_floor_bits(-(h - m)) ^ 0x8000u;
                float r = (float)h_from_bits(rb);
                put_f16(block, g, mb);
                put_f16(block + 2 * groups, g, rb);
                float rsafe = r > 0.0f ? r : 1.0f;
                for (int64_t k = 0; k < G; k++) {
                    mn[k] = m;
                    rs[k] = rsafe;
                }
                code_row(row, mn, rs, G, ta, tr);
                pack_row(ta, G, codes_out + g * (G / 2));
                pack_row(tr, G, res + g * (G / 2));
            }
        }
        peak[p] = page_peak;
    }
    free(buf); free(lo); free(hi); free(mn); free(rs); free(ta); free(tr);
    return 0;
}

static inline void store(void *pool, int dtype, int64_t idx, float v) {
    if (dtype == DT_F32) ((float *)pool)[idx] = v;
    else if (dtype == DT_BF16) ((uint16_t *)pool)[idx] = f32_to_bf16(v);
    else ((_Float16 *)pool)[idx] = (_Float16)v;
}

/* Decode one layer's K or V (anchor-only when residual is NULL) into pool[slots[t]] in the pool dtype;
 * the first `sink` tokens come from the bf16 header at the start of the anchor stream. */
void lynx_decode(const uint8_t *anchor, const uint8_t *residual, void *pool, int pool_dtype, int64_t pool_stride,
                 const int64_t *slots, int64_t T, int64_t hd, int is_key, int64_t P, int64_t C, int64_t G,
                 int64_t sink, int64_t hdr_bytes, int64_t a_page, int64_t r_page) {
    int64_t pages = (T + P - 1) / P;
    float lut[256];
    for (int a = 0; a < 16; a++)
        for (int r = 0; r < 16; r++)
            lut[a * 16 + r] = residual ? ((float)a * 15.0f + (float)r - 7.0f) / 225.0f : (float)a / 15.0f;
    for (int64_t p = 0; p < pages; p++) {
        int64_t start = p * P, n_p = T - start < P ? T - start : P;
        const uint8_t *block = anchor + hdr_bytes + p * a_page;
        const uint8_t *res = residual ? residual + p * r_page : NULL;
        int64_t groups = is_key ? ((n_p + C - 1) / C) * hd : n_p * (hd / G);
        const uint8_t *mn_b = block, *rng_b = block + 2 * groups, *codes_in = block + 4 * groups;
        for (int64_t t = 0; t < n_p; t++) {
            int64_t tok = start + t, base = slots[tok] * pool_stride;
            if (tok < sink) {
                const uint16_t *hdr = (const uint16_t *)anchor + tok * hd;
                for (int64_t j = 0; j < hd; j++) {
                    uint16_t b;
                    memcpy(&b, hdr + j, 2);
                    store(pool, pool_dtype, base + j, bf16_to_f32(b));
                }
                continue;
            }
            const uint8_t *ai = codes_in + t * (hd / 2), *ri = res ? res + t * (hd / 2) : NULL;
            int64_t g0 = is_key ? (t / C) * hd : t * (hd / G);
            for (int64_t j = 0; j < hd; j += 2) {
                uint8_t ab = ai[j / 2], rb = ri ? ri[j / 2] : 0;
                int64_t g_e = is_key ? g0 + j : g0 + j / G, g_o = is_key ? g0 + j + 1 : g0 + (j + 1) / G;
                float u0 = lut[(ab & 15) * 16 + (rb & 15)], u1 = lut[(ab >> 4) * 16 + (rb >> 4)];
                store(pool, pool_dtype, base + j, u0 * get_f16(rng_b, g_e) + get_f16(mn_b, g_e));
                store(pool, pool_dtype, base + j + 1, u1 * get_f16(rng_b, g_o) + get_f16(mn_b, g_o));
            }
        }
    }
}
