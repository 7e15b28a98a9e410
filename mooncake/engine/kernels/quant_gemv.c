/* Weight-only int8 and int4 matrix-vector products for a few rows of activations (decode at
 * small batch), AVX-512, threads from OpenMP (the same libgomp torch runs on).
 *
 *   int8: out[m, n] = scale[n] * sum_k x[m, k] * w[n, k]      (accumulated in float32)
 *   int4: out[m, n] = sum_k x[m, k] * (q[n, k] * scale[n, g(k)] + zero[n, g(k)])
 *         over groups g of 32 consecutive k, q in 0..15 (GGUF's Q4_1 layout of values); each
 *         group is unpacked to float32 once for up to 4 rows of x, the products summed in float32
 *   Q8_0: out[m, n] = sum_g scale[n, g] * sum_{k in g} x[m, k] * w[n, k]   (GGUF's Q8_0: int8
 *         w and a scale per group of 32; each group's sum in float32, then times its scale)
 *
 * x: [M, K] bfloat16 or float32; int8 w: [N, K], row-major, scale [N] float32; int4 w: [N, K/2]
 * bytes, a group's 16 bytes holding its elements 0-15 in the low nibbles and 16-31 in the high
 * ones, scale and zero [N, K/32] float32; out: [M, N] in x's dtype (bfloat16 rounded to nearest
 * even, as torch rounds). Each weight row is read once for all M rows of x: the call is bound by
 * reading w. Built and loaded by native.py. */

/* The dot products run on integers (AVX-512 VNNI ``vpdpwssd``: 32 int16 products per
 * instruction, no int8 -> float conversion per weight): each row of x is split exactly enough
 * into two int16 parts with power-of-two scales, x ~= hi * 2^e + lo * 2^(e - 15), whose
 * error (|x|max * 2^-30) is below float32's own rounding of the sums, so the result is the
 * float reference's to float32 accuracy. Each lane's sum stays inside int32 for K <= 8192. */

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define ROWS 4    /* weight rows per block: independent loads in flight */
#define MAX_M 2   /* activation rows per pass (accumulators: ROWS * MAX_M * 2 registers) */
#define MAX_K 8192
#ifndef PREFETCH
#define PREFETCH 4096 /* bytes ahead of each weight row read: without it the reads ran at a third of the bandwidth */
#endif
static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);  /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* The 16 int32 lanes summed in int64 (each lane fits int32; their sum may not). */
static inline int64_t lane_sum(__m512i a) {
    return _mm512_reduce_add_epi64(_mm512_add_epi64(_mm512_cvtepi32_epi64(_mm512_castsi512_si256(a)),
                                                    _mm512_cvtepi32_epi64(_mm512_extracti64x4_epi64(a, 1))));
}

/* res[r][m] = dot(w row r, x row m) for the ROWS rows wr and MM rows of x (hi, lo parts). */
#define DEFINE_BLOCK(MM)                                                                     \
    static void block_##MM(const int8_t *const *wr, const int16_t *hi, const int16_t *lo,   \
                           const float *sh, const float *sl, int K, float res[ROWS][MAX_M]) { \
        __m512i ah[ROWS][MM], al[ROWS][MM];                                                  \
        for (int r = 0; r < ROWS; r++)                                                       \
            for (int m = 0; m < MM; m++) ah[r][m] = al[r][m] = _mm512_setzero_si512();       \
        for (int k = 0; k < K; k += 32) {                                                    \
            __m512i xh[MM], xl[MM];                                                          \
            for (int m = 0; m < MM; m++) {                                                   \
                xh[m] = _mm512_loadu_si512(hi + (size_t)m * K + k);                          \
                xl[m] = _mm512_loadu_si512(lo + (size_t)m * K + k);                          \
            }                                                                                \
            for (int r = 0; r < ROWS; r++) {                                                 \
                _mm_prefetch((const char *)(wr[r] + k + PREFETCH), _MM_HINT_T0);             \
                __m512i wv = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(wr[r] + k))); \
                for (int m = 0; m < MM; m++) {                                               \
                    ah[r][m] = _mm512_dpwssd_epi32(ah[r][m], wv, xh[m]);                     \
                    al[r][m] = _mm512_dpwssd_epi32(al[r][m], wv, xl[m]);                     \
                }                                                                            \
            }                                                                                \
        }                                                                                    \
        for (int r = 0; r < ROWS; r++)                                                       \
            for (int m = 0; m < MM; m++)                                                     \
                res[r][m] = (float)lane_sum(ah[r][m]) * sh[m] + (float)lane_sum(al[r][m]) * sl[m]; \
    }

DEFINE_BLOCK(1)
DEFINE_BLOCK(2)

/* Row m of x as hi * sh + lo * sl (int16 parts, power-of-two scales). */
static void split_row(const float *x, int K, int16_t *hi, int16_t *lo, float *sh, float *sl) {
    float amax = 0.f;
    for (int k = 0; k < K; k++) amax = fmaxf(amax, fabsf(x[k]));
    int e;
    frexpf(amax, &e);              /* amax < 2^e */
    float s_hi = ldexpf(1.f, e - 14), s_lo = ldexpf(1.f, e - 29);   /* |hi| <= 2^14, |lo| <= 2^14 */
    if (amax == 0.f || !isfinite(amax)) s_hi = s_lo = 0.f;
    for (int k = 0; k < K; k++) {
        float h = s_hi ? nearbyintf(x[k] / s_hi) : 0.f;
        hi[k] = (int16_t)h;
        lo[k] = s_lo ? (int16_t)nearbyintf((x[k] - h * s_hi) / s_lo) : 0;
    }
    *sh = s_hi;
    *sl = s_lo;
}

/* Returns 0, or -1 when the shapes are not served (K a multiple of 32, at most MAX_K). */
int mooncake_int8_gemv(const void *x, int x_is_bf16, const int8_t *w, const float *scale, void *out,
                       int M, int N, int K, int threads) {
    if (M < 1 || N < 1 || K < 32 || K % 32 || K > MAX_K) return -1;
    size_t MK = (size_t)M * K;
    float *xf = (float *)malloc(sizeof(float) * (MK + 2 * (size_t)M));
    int16_t *parts = (int16_t *)malloc(sizeof(int16_t) * 2 * MK);
    if (!xf || !parts) {
        free(xf);
        free(parts);
        return -1;
    }
    float *sh = xf + MK, *sl = sh + M;
    int16_t *hi = parts, *lo = parts + MK;
    for (size_t i = 0; i < MK; i++)
        xf[i] = x_is_bf16 ? bf16_to_f32(((const uint16_t *)x)[i]) : ((const float *)x)[i];
    for (int m = 0; m < M; m++)
        split_row(xf + (size_t)m * K, K, hi + (size_t)m * K, lo + (size_t)m * K, sh + m, sl + m);
    int blocks = (N + ROWS - 1) / ROWS;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int b = 0; b < blocks; b++) {
        int n0 = b * ROWS;
        const int8_t *wr[ROWS];
        for (int r = 0; r < ROWS; r++) {
            int n = n0 + r < N ? n0 + r : N - 1;  /* past the last row: repeat it, discard the result */
            wr[r] = w + (size_t)n * K;
        }
        for (int m0 = 0; m0 < M; m0 += MAX_M) {
            int mm = M - m0 < MAX_M ? M - m0 : MAX_M;
            float res[ROWS][MAX_M];
            size_t at = (size_t)m0 * K;
            if (mm == 1)
                block_1(wr, hi + at, lo + at, sh + m0, sl + m0, K, res);
            else
                block_2(wr, hi + at, lo + at, sh + m0, sl + m0, K, res);
            for (int r = 0; r < ROWS && n0 + r < N; r++)
                for (int m = 0; m < mm; m++) {
                    float v = res[r][m] * scale[n0 + r];
                    size_t o = (size_t)(m0 + m) * N + n0 + r;
                    if (x_is_bf16)
                        ((uint16_t *)out)[o] = f32_to_bf16(v);
                    else
                        ((float *)out)[o] = v;
                }
        }
    }
    free(xf);
    free(parts);
    return 0;
}


/* ---------------------------------------------------------------- int4, groups of 32 */

#define GROUP 32
#define MAX_M4 4  /* activation rows per pass: a group is unpacked once for all of them */

/* A group's 32 weights in float32, q * scale + zero, multiplied and then added, each rounded
 * (the explicitly rounded forms, which the compiler does not contract into one fused
 * multiply-add): as torch rounds the dequantized weight, so in float32 these are bit for bit
 * the float reference's weights. */
#define NEAREST (_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
static inline __m512 dequantize16(__m128i q8, __m512 d, __m512 z) {
    __m512 q = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(q8));
    return _mm512_add_round_ps(_mm512_mul_round_ps(q, d, NEAREST), z, NEAREST);
}

static inline void unpack_group(const uint8_t *p, float scale, float zero, __m512 *w0, __m512 *w1) {
    __m128i b = _mm_loadu_si128((const __m128i *)p), m = _mm_set1_epi8(0x0f);
    __m512 d = _mm512_set1_ps(scale), z = _mm512_set1_ps(zero);
    *w0 = dequantize16(_mm_and_si128(b, m), d, z);
    *w1 = dequantize16(_mm_and_si128(_mm_srli_epi16(b, 4), m), d, z);
}

/* res[r][m] = dot(int4 row r, row m of x) for ROWS weight rows and MM rows of x (float32). */
#define DEFINE_BLOCK4(MM)                                                                        \
    static void block4_##MM(const uint8_t *const *wr, const float *const *sc, const float *const *zr, \
                            const float *x, int K, float res[ROWS][MAX_M4]) {                    \
        __m512 acc[ROWS][MM];                                                                     \
        for (int r = 0; r < ROWS; r++)                                                            \
            for (int m = 0; m < MM; m++) acc[r][m] = _mm512_setzero_ps();                         \
        for (int g = 0; g < K / GROUP; g++) {                                                     \
            __m512 x0[MM], x1[MM];                                                                \
            for (int m = 0; m < MM; m++) {                                                        \
                x0[m] = _mm512_loadu_ps(x + (size_t)m * K + g * GROUP);                           \
                x1[m] = _mm512_loadu_ps(x + (size_t)m * K + g * GROUP + 16);                      \
            }                                                                                     \
            for (int r = 0; r < ROWS; r++) {                                                      \
                _mm_prefetch((const char *)(wr[r] + g * GROUP / 2 + PREFETCH / 2), _MM_HINT_T0);  \
                __m512 w0, w1;                                                                    \
                unpack_group(wr[r] + g * GROUP / 2, sc[r][g], zr[r][g], &w0, &w1);                \
                for (int m = 0; m < MM; m++)                                                      \
                    acc[r][m] = _mm512_fmadd_ps(w1, x1[m], _mm512_fmadd_ps(w0, x0[m], acc[r][m])); \
            }                                                                                     \
        }                                                                                         \
        for (int r = 0; r < ROWS; r++)                                                            \
            for (int m = 0; m < MM; m++) res[r][m] = _mm512_reduce_add_ps(acc[r][m]);             \
    }

DEFINE_BLOCK4(1)
DEFINE_BLOCK4(2)
DEFINE_BLOCK4(3)
DEFINE_BLOCK4(4)

/* x [M, K] as float32: x itself, or (bfloat16) a converted copy in *owned (freed by the caller; NULL
 * when memory is short). */
static const float *x_as_float(const void *x, int x_is_bf16, size_t MK, float **owned) {
    *owned = NULL;
    if (!x_is_bf16) return (const float *)x;
    float *xf = (float *)malloc(sizeof(float) * MK);
    if (xf)
        for (size_t i = 0; i < MK; i++) xf[i] = bf16_to_f32(((const uint16_t *)x)[i]);
    *owned = xf;
    return xf;
}

/* A block's results res[r][m] (rows n0.. of the weights, m0.. of x) into out [M, N], in x's dtype. */
static void store_block(void *out, int x_is_bf16, int N, int n0, int m0, int mm, int max_m, const float *res) {
    for (int r = 0; r < ROWS && n0 + r < N; r++)
        for (int m = 0; m < mm; m++) {
            size_t o = (size_t)(m0 + m) * N + n0 + r;
            float v = res[r * max_m + m];
            if (x_is_bf16)
                ((uint16_t *)out)[o] = f32_to_bf16(v);
            else
                ((float *)out)[o] = v;
        }
}

/* Returns 0, or -1 when the shapes are not served (K a multiple of 32). */
int mooncake_int4_gemv(const void *x, int x_is_bf16, const uint8_t *w, const float *scale, const float *zero,
                       void *out, int M, int N, int K, int threads) {
    if (M < 1 || N < 1 || K < GROUP || K % GROUP) return -1;
    int groups = K / GROUP;
    float *xf;
    const float *xs = x_as_float(x, x_is_bf16, (size_t)M * K, &xf);
    if (!xs) return -1;
    int blocks = (N + ROWS - 1) / ROWS;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int b = 0; b < blocks; b++) {
        int n0 = b * ROWS;
        const uint8_t *wr[ROWS];
        const float *sc[ROWS], *zr[ROWS];
        for (int r = 0; r < ROWS; r++) {
            int n = n0 + r < N ? n0 + r : N - 1;  /* past the last row: repeat it, discard the result */
            wr[r] = w + (size_t)n * (K / 2);
            sc[r] = scale + (size_t)n * groups;
            zr[r] = zero + (size_t)n * groups;
        }
        for (int m0 = 0; m0 < M; m0 += MAX_M4) {
            int mm = M - m0 < MAX_M4 ? M - m0 : MAX_M4;
            float res[ROWS][MAX_M4];
            const float *xm = xs + (size_t)m0 * K;
            switch (mm) {
            case 1: block4_1(wr, sc, zr, xm, K, res); break;
            case 2: block4_2(wr, sc, zr, xm, K, res); break;
            case 3: block4_3(wr, sc, zr, xm, K, res); break;
            default: block4_4(wr, sc, zr, xm, K, res); break;
            }
            store_block(out, x_is_bf16, N, n0, m0, mm, MAX_M4, &res[0][0]);
        }
    }
    free(xf);
    return 0;
}


/* ---------------------------------------------------------------- Q8_0: int8, a scale per group of 32 */

#define MAX_M8 4  /* activation rows per pass: a group is converted to float32 once for all of them */

/* res[r][m] = sum_g d[r, g] * sum_{k in g} q[r, k] * x[m, k] for ROWS weight rows and MM rows of x:
 * per group the 32 products summed in float32 (a multiply, then a fused multiply-add), then one
 * fused multiply-add by the group's scale into the row's accumulator; the same operations in the
 * same order for every row of x, whatever MM. */
#define DEFINE_BLOCK8(MM)                                                                          \
    static void block8_##MM(const int8_t *const *wr, const uint16_t *const *sc, const float *x, int K, \
                            float res[ROWS][MAX_M8]) {                                              \
        __m512 acc[ROWS][MM];                                                                       \
        for (int r = 0; r < ROWS; r++)                                                              \
            for (int m = 0; m < MM; m++) acc[r][m] = _mm512_setzero_ps();                           \
        for (int g = 0; g < K / GROUP; g++) {                                                       \
            __m512 x0[MM], x1[MM];                                                                  \
            for (int m = 0; m < MM; m++) {                                                          \
                x0[m] = _mm512_loadu_ps(x + (size_t)m * K + g * GROUP);                             \
                x1[m] = _mm512_loadu_ps(x + (size_t)m * K + g * GROUP + 16);                        \
            }                                                                                       \
            for (int r = 0; r < ROWS; r++) {                                                        \
                const int8_t *q = wr[r] + (size_t)g * GROUP;                                        \
                _mm_prefetch((const char *)(q + PREFETCH), _MM_HINT_T0);                            \
                __m512 w0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)q))); \
                __m512 w1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + 16)))); \
                __m512 d = _mm512_cvtph_ps(_mm256_set1_epi16((short)sc[r][g])); /* float16 -> float32 */ \
                for (int m = 0; m < MM; m++) {                                                      \
                    __m512 s = _mm512_fmadd_ps(w1, x1[m], _mm512_mul_ps(w0, x0[m]));                \
                    acc[r][m] = _mm512_fmadd_ps(s, d, acc[r][m]);                                   \
                }                                                                                   \
            }                                                                                       \
        }                                                                                           \
        for (int r = 0; r < ROWS; r++)                                                              \
            for (int m = 0; m < MM; m++) res[r][m] = _mm512_reduce_add_ps(acc[r][m]);               \
    }

DEFINE_BLOCK8(1)
DEFINE_BLOCK8(2)
DEFINE_BLOCK8(3)
DEFINE_BLOCK8(4)

/* out[m, n] = sum_g scale[n, g] * sum_{k in g} w[n, k] * x[m, k] (GGUF's Q8_0: w [N, K] int8, scale
 * [N, K/32] float16, the file's own: 1/16 byte per weight more than int8 rows, float32 scales' 1/8
 * were slower still at batch 1, where the call is bound by reading them); x [M, K] bfloat16 or float32, out [M, N] in x's
 * dtype. Returns 0, or -1 when the shapes are not served (K a multiple of 32) or memory is short. */
int mooncake_q8_0_gemv(const void *x, int x_is_bf16, const int8_t *w, const uint16_t *scale, void *out,
                       int M, int N, int K, int threads) {
    if (M < 1 || N < 1 || K < GROUP || K % GROUP) return -1;
    int groups = K / GROUP;
    float *xf;
    const float *xs = x_as_float(x, x_is_bf16, (size_t)M * K, &xf);
    if (!xs) return -1;
    int blocks = (N + ROWS - 1) / ROWS;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int b = 0; b < blocks; b++) {
        int n0 = b * ROWS;
        const int8_t *wr[ROWS];
        const uint16_t *sc[ROWS];
        for (int r = 0; r < ROWS; r++) {
            int n = n0 + r < N ? n0 + r : N - 1;  /* past the last row: repeat it, discard the result */
            wr[r] = w + (size_t)n * K;
            sc[r] = scale + (size_t)n * groups;
        }
        for (int m0 = 0; m0 < M; m0 += MAX_M8) {
            int mm = M - m0 < MAX_M8 ? M - m0 : MAX_M8;
            float res[ROWS][MAX_M8];
            const float *xm = xs + (size_t)m0 * K;
            switch (mm) {
            case 1: block8_1(wr, sc, xm, K, res); break;
            case 2: block8_2(wr, sc, xm, K, res); break;
            case 3: block8_3(wr, sc, xm, K, res); break;
            default: block8_4(wr, sc, xm, K, res); break;
            }
            store_block(out, x_is_bf16, N, n0, m0, mm, MAX_M8, &res[0][0]);
        }
    }
    free(xf);
    return 0;
}
