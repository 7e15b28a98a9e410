/* int4 weights (groups of 32: q in 0..15, w = q * scale + zero; GGUF's Q4_1, and Q4_0 as
 * zero = -8 * scale) times activations quantized to int8 per block of 32, AVX-512 VNNI
 * (``vpdpbusd``: 64 unsigned-nibble x signed-int8 products per instruction, no unpacking of
 * the weights to float). Threads from OpenMP. Built and loaded by native.py.
 *
 *   out[m, n] = sum_g scale[n, g] * d[m, g] * sum_{k in g} q[n, k] * xq[m, k]
 *             + sum_g zero[n, g] * xsum[m, g]
 *
 * with, per row m of x and group g of 32 values, d = max|x| / 127, xq = round(x / d) in
 * -127..127 and xsum = d * sum(xq): the whole product is the weights' with x rounded to xq * d
 * (the offset term on the same rounded x: the errors of a zero-mean weight row then mostly
 * cancel, where an exact sum of x would leave the scale term's error alone, 2x larger). The
 * integer sums are exact; the only error is x's rounding, at most d / 2 per value. Each output depends on its own row of x only, through the same operations
 * in the same order whatever the number of rows: a sequence computes the same in any batch.
 *
 * Layouts: x [M, K] bfloat16 or float32; w [N, K/2] bytes (a group's 16 bytes hold its
 * elements 0-15 in the low nibbles and 16-31 in the high ones); scale, zero [N, K/32] float32;
 * out [M, N] in x's dtype. Each pair of groups is read as 32 bytes and spread to 64 nibbles
 * [g0 0-15 | g1 0-15 | g0 16-31 | g1 16-31]; the quantized activations are stored in that
 * order, with d spread over the int32 lanes the same way. */

#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define G 32
#define NR 4  /* weight rows per block */
#define NM 4  /* activation rows per pass: each weight pair is spread once for all of them */
#ifndef PREFETCH4
#define PREFETCH4 2048
#endif

static inline uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline __m512 load16(const void *x, int bf16, size_t at) {
    if (bf16) {
        __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)x + at));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    return _mm512_loadu_ps((const float *)x + at);
}

/* One row of x (K values from x + at) to xq (pairs * 64 bytes), dl (pairs * 16 floats) and xs
 * (groups floats). */
static void quantize_row(const void *x, int bf16, size_t at, int groups, int8_t *xq, float *dl, float *xs) {
    float d[2];
    __m128i q[2][2];
    for (int g = 0; g < groups; g++) {
        __m512 a = load16(x, bf16, at + (size_t)g * G), b = load16(x, bf16, at + (size_t)g * G + 16);
        float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
        float inv = amax > 0.f ? 127.f / amax : 0.f;
        d[g & 1] = amax / 127.f;
        __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, _mm512_set1_ps(inv)));  /* nearest, |.| <= 127 */
        __m512i qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, _mm512_set1_ps(inv)));
        xs[g] = d[g & 1] * (float)_mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
        q[g & 1][0] = _mm512_cvtepi32_epi8(qa);
        q[g & 1][1] = _mm512_cvtepi32_epi8(qb);
        if ((g & 1) == 0 && g + 1 < groups) continue;
        int p = g / 2, two = g & 1;
        int8_t *o = xq + (size_t)p * 64;
        float *l = dl + (size_t)p * 16;
        if (two) {  /* [g0 0-15 | g1 0-15 | g0 16-31 | g1 16-31] */
            _mm_storeu_si128((__m128i *)o, q[0][0]);
            _mm_storeu_si128((__m128i *)(o + 16), q[1][0]);
            _mm_storeu_si128((__m128i *)(o + 32), q[0][1]);
            _mm_storeu_si128((__m128i *)(o + 48), q[1][1]);
            for (int i = 0; i < 16; i++) l[i] = d[(i >> 2) & 1];
        } else {  /* a last, odd group: [g 0-15 | g 16-31 | zeros] */
            _mm_storeu_si128((__m128i *)o, q[0][0]);
            _mm_storeu_si128((__m128i *)(o + 16), q[0][1]);
            memset(o + 32, 0, 32);
            for (int i = 0; i < 16; i++) l[i] = i < 8 ? d[0] : 0.f;
        }
    }
}

static inline __m512i spread_pair(const uint8_t *p) {
    __m256i v = _mm256_loadu_si256((const __m256i *)p), m = _mm256_set1_epi8(0x0f);
    __m256i lo = _mm256_and_si256(v, m), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m);
    return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}

static inline __m512i spread_one(const uint8_t *p) {
    __m128i v = _mm_loadu_si128((const __m128i *)p), m = _mm_set1_epi8(0x0f);
    __m128i lo = _mm_and_si128(v, m), hi = _mm_and_si128(_mm_srli_epi16(v, 4), m);
    return _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set_m128i(hi, lo), 0);
}

/* res[r][m] for NR weight rows and MM activation rows. */
#define DEFINE_Q8_BLOCK(MM)                                                                       \
    static void q8_block_##MM(const uint8_t *const *wr, const float *const *sc, const float *const *zr, \
                              const int8_t *xq, const float *dl, const float *xs, int groups,          \
                              size_t xq_len, size_t dl_len, float res[NR][NM]) {                       \
        __m512 acc[NR][MM], zacc[NR][MM];                                                         \
        const __m512i spread = _mm512_set_epi32(1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0);  \
        for (int r = 0; r < NR; r++)                                                              \
            for (int m = 0; m < MM; m++) acc[r][m] = zacc[r][m] = _mm512_setzero_ps();            \
        int pairs = groups / 2;                                                                   \
        for (int p = 0; p < pairs; p++) {                                                         \
            __m512i xv[MM];                                                                       \
            __m512 dv[MM];                                                                        \
            for (int m = 0; m < MM; m++) {                                                        \
                xv[m] = _mm512_loadu_si512(xq + m * xq_len + (size_t)p * 64);                     \
                dv[m] = _mm512_loadu_ps(dl + m * dl_len + (size_t)p * 16);                        \
            }                                                                                     \
            for (int r = 0; r < NR; r++) {                                                        \
                _mm_prefetch((const char *)(wr[r] + p * 32 + PREFETCH4), _MM_HINT_T0);            \
                __m512i wv = spread_pair(wr[r] + (size_t)p * 32);                                 \
                double s2;                                                                        \
                memcpy(&s2, sc[r] + 2 * p, sizeof s2); /* the pair's two scales */                \
                __m512 s = _mm512_permutexvar_ps(spread, _mm512_castpd_ps(_mm512_set1_pd(s2)));   \
                for (int m = 0; m < MM; m++) {                                                    \
                    __m512i i = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wv, xv[m]);           \
                    acc[r][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i), _mm512_mul_ps(s, dv[m]), acc[r][m]); \
                }                                                                                 \
            }                                                                                     \
        }                                                                                         \
        if (groups & 1) {                                                                         \
            for (int r = 0; r < NR; r++) {                                                        \
                __m512i wv = spread_one(wr[r] + (size_t)pairs * 32);                              \
                __m512 s = _mm512_set1_ps(sc[r][groups - 1]);                                     \
                for (int m = 0; m < MM; m++) {                                                    \
                    __m512i xv = _mm512_loadu_si512(xq + m * xq_len + (size_t)pairs * 64);        \
                    __m512 dv = _mm512_loadu_ps(dl + m * dl_len + (size_t)pairs * 16);            \
                    __m512i i = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wv, xv);              \
                    acc[r][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i), _mm512_mul_ps(s, dv), acc[r][m]); \
                }                                                                                 \
            }                                                                                     \
        }                                                                                         \
        for (int g = 0; g < groups; g += 16) {                                                    \
            __mmask16 k = groups - g >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (groups - g)) - 1); \
            for (int r = 0; r < NR; r++) {                                                        \
                __m512 z = _mm512_maskz_loadu_ps(k, zr[r] + g);                                   \
                for (int m = 0; m < MM; m++)                                                      \
                    zacc[r][m] = _mm512_fmadd_ps(z, _mm512_maskz_loadu_ps(k, xs + m * (size_t)groups + g), zacc[r][m]); \
            }                                                                                     \
        }                                                                                         \
        for (int r = 0; r < NR; r++)                                                              \
            for (int m = 0; m < MM; m++)                                                          \
                res[r][m] = _mm512_reduce_add_ps(acc[r][m]) + _mm512_reduce_add_ps(zacc[r][m]);   \
    }

DEFINE_Q8_BLOCK(1)
DEFINE_Q8_BLOCK(2)
DEFINE_Q8_BLOCK(3)
DEFINE_Q8_BLOCK(4)

/* Returns 0, or -1 when the shapes are not served (K a multiple of 32) or memory is short. */
int mooncake_int4_gemv_q8(const void *x, int x_is_bf16, const uint8_t *w, const float *scale, const float *zero,
                          void *out, int M, int N, int K, int threads) {
    if (M < 1 || N < 1 || K < G || K % G) return -1;
    int groups = K / G, pairs_up = (groups + 1) / 2;
    size_t xq_len = (size_t)pairs_up * 64, dl_len = (size_t)pairs_up * 16;
    int8_t *xq = (int8_t *)malloc(xq_len * M);
    float *dl = (float *)malloc(sizeof(float) * (dl_len + groups) * M);
    if (!xq || !dl) {
        free(xq);
        free(dl);
        return -1;
    }
    float *xs = dl + dl_len * M;
    for (int m = 0; m < M; m++)
        quantize_row(x, x_is_bf16, (size_t)m * K, groups, xq + m * xq_len, dl + m * dl_len, xs + (size_t)m * groups);
    int blocks = (N + NR - 1) / NR;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int b = 0; b < blocks; b++) {
        int n0 = b * NR;
        const uint8_t *wr[NR];
        const float *sc[NR], *zr[NR];
        for (int r = 0; r < NR; r++) {
            int n = n0 + r < N ? n0 + r : N - 1;  /* past the last row: repeat it, discard the result */
            wr[r] = w + (size_t)n * (K / 2);
            sc[r] = scale + (size_t)n * groups;
            zr[r] = zero + (size_t)n * groups;
        }
        for (int m0 = 0; m0 < M; m0 += NM) {
            int mm = M - m0 < NM ? M - m0 : NM;
            float res[NR][NM];
            const int8_t *q = xq + m0 * xq_len;
            const float *l = dl + m0 * dl_len, *s = xs + (size_t)m0 * groups;
            switch (mm) {
            case 1: q8_block_1(wr, sc, zr, q, l, s, groups, xq_len, dl_len, res); break;
            case 2: q8_block_2(wr, sc, zr, q, l, s, groups, xq_len, dl_len, res); break;
            case 3: q8_block_3(wr, sc, zr, q, l, s, groups, xq_len, dl_len, res); break;
            default: q8_block_4(wr, sc, zr, q, l, s, groups, xq_len, dl_len, res); break;
            }
            for (int r = 0; r < NR && n0 + r < N; r++)
                for (int m = 0; m < mm; m++) {
                    size_t o = (size_t)(m0 + m) * N + n0 + r;
                    if (x_is_bf16)
                        ((uint16_t *)out)[o] = to_bf16(res[r][m]);
                    else
                        ((float *)out)[o] = res[r][m];
                }
        }
    }
    free(xq);
    free(dl);
    return 0;
}
