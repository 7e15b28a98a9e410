/* Decode-step kernels for one new token per sequence, AVX-512F, threads from OpenMP:
 *
 *   mooncake_decode_attention: rotary on q and k of the fused qkv projection's output, the new
 *     k and v written into the decode KV workspace at the token's position, and attention of the
 *     token's query heads over its row's keys (GQA: query head h reads kv head h / G).
 *   mooncake_add_rmsnorm: x += a (in place, rounded to x's dtype), then h = rmsnorm(x) * w.
 *
 * Tensors are bfloat16 or float32 (``is_bf16``); arithmetic is float32, each result rounded once
 * to the tensor dtype (bfloat16: to nearest even). Every row (a sequence; an (sequence, kv head)
 * pair for attention) is computed by itself in a fixed order that depends only on that row's own
 * data and length, so a sequence gets bitwise the same numbers in a batch of any size.
 * Built and loaded by native.py. */

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_D 256  /* head dimension: at most 16 vectors of 16 floats */
#define MAX_G 16   /* query heads per kv head */
#define PREFETCH 4096  /* bytes ahead of the keys and values read (as quant_gemv.c: reads wait on memory otherwise) */

static inline __m512 load16(const void *p, int bf16) {
    if (bf16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
    return _mm512_loadu_ps((const float *)p);
}

/* float32 -> bfloat16, round to nearest even, NaN kept quiet (as torch rounds). */
static inline __m256i to_bf16(__m512 v) {
    __m512i u = _mm512_castps_si512(v);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40)));
    return _mm512_cvtepi32_epi16(r);
}

static inline void store16(void *p, __m512 v, int bf16) {
    if (bf16)
        _mm256_storeu_si256((__m256i *)p, to_bf16(v));
    else
        _mm512_storeu_ps((float *)p, v);
}

/* v rounded to the tensor dtype and back (the value a store then a load would give). */
static inline __m512 round_to(__m512 v, int bf16) {
    if (!bf16) return v;
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(to_bf16(v)), 16));
}

/* exp(x), Cephes' polynomial, ~2 ulp; inf above 88.7, 0 below -103. */
static inline __m512 exp_any(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-103.f)), _mm512_set1_ps(89.f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.f)));
    return _mm512_scalef_ps(p, n);
}

/* The sums of 8 vectors' lanes, as one vector of 8 (fixed order). */
static inline __m256 sum8(const __m512 *a) {
    __m256 s[8];
    for (int i = 0; i < 8; i++)
        s[i] = _mm256_add_ps(_mm512_castps512_ps256(a[i]), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a[i]), 1)));
    __m256 s01 = _mm256_hadd_ps(s[0], s[1]), s23 = _mm256_hadd_ps(s[2], s[3]);
    __m256 s45 = _mm256_hadd_ps(s[4], s[5]), s67 = _mm256_hadd_ps(s[6], s[7]);
    __m256 s0123 = _mm256_hadd_ps(s01, s23), s4567 = _mm256_hadd_ps(s45, s67);
    return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20), _mm256_permute2f128_ps(s0123, s4567, 0x31));
}

/* x rotated (rope(x) = x * cos + roll(x, D/2) * signed_sin), D/16 vectors of float32 in r. */
static void rotate(const char *x, const char *cs, const char *sn, int D, int bf16, __m512 *r) {
    int es = bf16 ? 2 : 4, half = D / 2;
    for (int c = 0; c < D / 16; c++) {
        int d = c * 16, rd = d < half ? d + half : d - half;
        __m512 xv = load16(x + (size_t)d * es, bf16), xr = load16(x + (size_t)rd * es, bf16);
        r[c] = _mm512_fmadd_ps(xr, load16(sn + (size_t)d * es, bf16), _mm512_mul_ps(xv, load16(cs + (size_t)d * es, bf16)));
    }
}

/* Whether the CPU has AVX-512 BF16 (bfloat16 pair dot products, ``vdpbf16ps``). */
static int has_dpbf16(void) {
    static int known = -1;
    if (known < 0) known = __builtin_cpu_supports("avx512bf16") ? 1 : 0;
    return known;
}

/* scores[g][j] = q_g . k_j * scale for bfloat16 keys, with ``vdpbf16ps`` on the keys as stored (no
 * conversion); q: [G][MAX_D / 16] float32 vectors holding bfloat16 values. */
__attribute__((target("avx512bf16,avx512f,avx512bw,avx512vl"))) static void scores_dpbf16(
        const __m512 *q, int G, int C, const char *k0, int n, int n8, size_t row, const char *kend, float scale,
        float *scores) {
    __m512i q16[MAX_G][MAX_D / 32];
    for (int g = 0; g < G; g++)
        for (int c = 0; c < C / 2; c++)
            q16[g][c] = _mm512_inserti64x4(_mm512_castsi256_si512(to_bf16(q[g * (MAX_D / 16) + 2 * c])),
                                           to_bf16(q[g * (MAX_D / 16) + 2 * c + 1]), 1);
    for (int j0 = 0; j0 < n8; j0 += 8) {
        const char *kb = k0 + (size_t)j0 * row;
        for (size_t off = 0; off < 8 * row; off += 64)
            if (kb + PREFETCH + off < kend) _mm_prefetch(kb + PREFETCH + off, _MM_HINT_T0);
        for (int g = 0; g < G; g++) {
            __m512 acc[8];
            for (int t = 0; t < 8; t++) {
                const char *k = k0 + (size_t)(j0 + t < n ? j0 + t : n - 1) * row;
                __m512 a = _mm512_setzero_ps();
                for (int c = 0; c < C / 2; c++)
                    a = _mm512_dpbf16_ps(a, (__m512bh)q16[g][c], (__m512bh)_mm512_loadu_si512(k + (size_t)c * 64));
                acc[t] = a;
            }
            _mm256_storeu_ps(scores + (size_t)g * n8 + j0, _mm256_mul_ps(sum8(acc), _mm256_set1_ps(scale)));
        }
    }
}

/* One (sequence, kv head)'s new token: k rotated and stored, v stored, at position pos of its workspace row. */
static void store_kv(const char *qkv, int H, int Hkv, int D, int kvh, int bf16, const char *cs, const char *sn,
                     char *kc, char *vc, int64_t pos) {
    int es = bf16 ? 2 : 4;
    size_t row = (size_t)D * es;
    __m512 kr[MAX_D / 16];
    rotate(qkv + (size_t)(H + kvh) * row, cs, sn, D, bf16, kr);
    for (int c = 0; c < D / 16; c++) store16(kc + (size_t)pos * row + (size_t)c * 16 * es, kr[c], bf16);
    memcpy(vc + (size_t)pos * row, qkv + (size_t)(H + Hkv + kvh) * row, row);
}

/* One (sequence, kv head): attend keys [lo, pos] (its k and v at pos already stored).
 * Inlined with C = D / 16 a constant (see attend_row), so its loops unroll and the accumulators of
 * the value pass stay in registers. */
static inline __attribute__((always_inline)) void attend_one(
        const char *qkv, int H, int Hkv, const int C, int kvh, int bf16, const char *cs, const char *sn, char *kc,
        char *vc, int64_t pos, int64_t lo, float scale, char *out, float *scores) {
    const int D = C * 16, GB = C <= 4 ? 4 : C <= 8 ? 2 : 1;  /* query heads per value pass: GB * C registers */
    int es = bf16 ? 2 : 4, G = H / Hkv;
    size_t row = (size_t)D * es;
    __m512 q[MAX_G][MAX_D / 16];
    for (int g = 0; g < G; g++) {
        rotate(qkv + (size_t)(kvh * G + g) * row, cs, sn, D, bf16, q[g]);
        for (int c = 0; c < C; c++) q[g][c] = round_to(q[g][c], bf16);
    }
    int n = (int)(pos + 1 - lo);
    int n8 = (n + 7) & ~7;
    const char *k0 = kc + (size_t)lo * row, *v0 = vc + (size_t)lo * row, *kend = kc + (size_t)(pos + 1) * row;
    if (bf16 && has_dpbf16())
        scores_dpbf16(&q[0][0], G, C, k0, n, n8, row, kend, scale, scores);
    else
        for (int j0 = 0; j0 < n8; j0 += 8) {  /* scores[g][j] = q_g . k_j * scale, 8 keys at a time */
            const char *kb = k0 + (size_t)j0 * row;
            for (size_t off = 0; off < 8 * row; off += 64)
                if (kb + PREFETCH + off < kend) _mm_prefetch(kb + PREFETCH + off, _MM_HINT_T0);
            __m512 kf[8][MAX_D / 16];  /* each key converted once, for all G query heads */
            for (int t = 0; t < 8; t++) {
                const char *k = k0 + (size_t)(j0 + t < n ? j0 + t : n - 1) * row;
                for (int c = 0; c < C; c++) kf[t][c] = load16(k + (size_t)c * 16 * es, bf16);
            }
            for (int g = 0; g < G; g++) {
                __m512 acc[8];
                for (int t = 0; t < 8; t++) {
                    __m512 a = _mm512_mul_ps(q[g][0], kf[t][0]);
                    for (int c = 1; c < C; c++) a = _mm512_fmadd_ps(q[g][c], kf[t][c], a);
                    acc[t] = a;
                }
                _mm256_storeu_ps(scores + (size_t)g * n8 + j0, _mm256_mul_ps(sum8(acc), _mm256_set1_ps(scale)));
            }
        }
    for (size_t off = 0; off < PREFETCH && off < (size_t)n * row; off += 64) _mm_prefetch(v0 + off, _MM_HINT_T0);
    for (int g = 0; g < G; g++) {  /* softmax over [0, n) */
        float *s = scores + (size_t)g * n8;
        __m512 mx = _mm512_set1_ps(-INFINITY);
        int j = 0;
        for (; j + 16 <= n; j += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(s + j));
        float m = _mm512_reduce_max_ps(mx);
        for (; j < n; j++) m = fmaxf(m, s[j]);
        __m512 mv = _mm512_set1_ps(m), sum = _mm512_setzero_ps();
        for (j = 0; j + 16 <= n; j += 16) {
            __m512 e = exp_any(_mm512_sub_ps(_mm512_loadu_ps(s + j), mv));
            _mm512_storeu_ps(s + j, e);
            sum = _mm512_add_ps(sum, e);
        }
        if (j < n) {
            __mmask16 k = (__mmask16)((1u << (n - j)) - 1);
            __m512 e = _mm512_maskz_mov_ps(k, exp_any(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, s + j), mv)));
            _mm512_mask_storeu_ps(s + j, k, e);
            sum = _mm512_add_ps(sum, e);
        }
        float inv = 1.f / _mm512_reduce_add_ps(sum);
        for (j = 0; j < n; j++) s[j] *= inv;
    }
    const char *vend = vc + (size_t)(pos + 1) * row;
    for (int g0 = 0; g0 < G; g0 += GB) {  /* out_g = sum_j p[g][j] v_j */
        __m512 acc[GB][MAX_D / 16];
        for (int gi = 0; gi < GB; gi++)
            for (int c = 0; c < C; c++) acc[gi][c] = _mm512_setzero_ps();
        for (int j = 0; j < n; j++) {
            const char *v = v0 + (size_t)j * row;
            if (g0 == 0)
                for (size_t off = 0; off < row; off += 64)
                    if (v + PREFETCH + off < vend) _mm_prefetch(v + PREFETCH + off, _MM_HINT_T0);
            __m512 vv[MAX_D / 16];
            for (int c = 0; c < C; c++) vv[c] = load16(v + (size_t)c * 16 * es, bf16);
            for (int gi = 0; gi < GB; gi++)
                if (g0 + gi < G) {
                    __m512 p = _mm512_set1_ps(scores[(size_t)(g0 + gi) * n8 + j]);
                    for (int c = 0; c < C; c++) acc[gi][c] = _mm512_fmadd_ps(p, vv[c], acc[gi][c]);
                }
        }
        for (int gi = 0; gi < GB && g0 + gi < G; gi++)
            for (int c = 0; c < C; c++)
                store16(out + (size_t)(kvh * G + g0 + gi) * row + (size_t)c * 16 * es, acc[gi][c], bf16);
    }
}

#define ATTEND_CASE(CC) \
    case CC: attend_one(qkv, H, Hkv, CC, kvh, bf16, cs, sn, kc, vc, pos, lo, scale, out, scores); break;

static void attend_row(const char *qkv, int H, int Hkv, int D, int kvh, int bf16, const char *cs, const char *sn,
                       char *kc, char *vc, int64_t pos, int64_t lo, float scale, char *out, float *scores) {
    switch (D / 16) {
        ATTEND_CASE(2) ATTEND_CASE(4) ATTEND_CASE(6) ATTEND_CASE(8)
        ATTEND_CASE(10) ATTEND_CASE(12) ATTEND_CASE(14) ATTEND_CASE(16)
    }
}

/* qkv: [B, (H + 2 Hkv) * D] rows ``qkv_stride`` elements apart; cos, sin: [*, D] tables (row = position);
 * kc, vc: the layer's workspace [B, Hkv, Kcap, D] (``ws_row``, ``ws_head`` elements between rows and heads);
 * pos: [B] int64 position of each row's new token; window: keys (pos - window, pos], 0: all from 0;
 * out: [B, H * D]. Returns 0; -1 for a shape not served (D a multiple of 32 up to 256, G up to 16), -2 for
 * a position outside [0, limit), -3 when out of memory. pool (or NULL): the layer of the paged KV pool
 * [blocks, 2, Hkv, T, D] with element strides pool_strides[4]; each row's new k and v are copied to its
 * block slot_block[b], offset slot_offset[b] there too; pool_strides[4], [5]: its blocks and T (-4: a slot
 * outside them). ws_rows (or NULL: row b is workspace row b): [B] the workspace row of each new token; several
 * tokens of one sequence (a speculative verify: consecutive positions) share its row, and each attends the
 * others' keys up to its own position. Every new token's k and v are stored before any attends. */
int mooncake_decode_attention(const void *qkv, int64_t qkv_stride, int bf16, const void *cos, const void *sin,
                              void *kc, void *vc, int64_t ws_row, int64_t ws_head, const int64_t *pos, int B, int H,
                              int Hkv, int D, int64_t window, float scale, void *out, int64_t limit, void *pool,
                              const int64_t *pool_strides, const int64_t *slot_block, const int64_t *slot_offset,
                              const int64_t *ws_rows, int64_t num_ws_rows, int threads) {
    if (B < 1 || D % 32 || D > MAX_D || Hkv < 1 || H % Hkv || H / Hkv > MAX_G) return -1;
    int es = bf16 ? 2 : 4, G = H / Hkv;
    int64_t maxn = 1;
    for (int b = 0; b < B; b++) {
        if (pos[b] < 0 || pos[b] >= limit) return -2;
        maxn = pos[b] + 1 > maxn ? pos[b] + 1 : maxn;
        if (pool && (slot_block[b] < 0 || slot_block[b] >= pool_strides[4] || slot_offset[b] < 0 ||
                     slot_offset[b] >= pool_strides[5]))
            return -4;
        if (ws_rows ? ws_rows[b] < 0 || ws_rows[b] >= num_ws_rows : b >= num_ws_rows) return -5;
    }
    int err = 0;
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (int t = 0; t < B * Hkv; t++) {  /* every new k and v first: a verify row reads the earlier ones' */
            int b = t / Hkv, h = t % Hkv;
            int64_t p = pos[b], r = ws_rows ? ws_rows[b] : b;
            char *k = (char *)kc + ((size_t)r * ws_row + (size_t)h * ws_head) * es;
            char *v = (char *)vc + ((size_t)r * ws_row + (size_t)h * ws_head) * es;
            store_kv((const char *)qkv + (size_t)b * qkv_stride * es, H, Hkv, D, h, bf16,
                     (const char *)cos + (size_t)p * D * es, (const char *)sin + (size_t)p * D * es, k, v, p);
            if (pool) {
                const int64_t *ps = pool_strides;
                char *dst = (char *)pool + (size_t)(slot_block[b] * ps[0] + h * ps[2] + slot_offset[b] * ps[3]) * es;
                memcpy(dst, k + (size_t)p * D * es, (size_t)D * es);
                memcpy(dst + (size_t)ps[1] * es, v + (size_t)p * D * es, (size_t)D * es);
            }
        }
        float *scores = (float *)malloc(sizeof(float) * (size_t)G * (size_t)((maxn + 7) & ~7));
        if (!scores) {
#pragma omp atomic write
            err = 1;
        }
#pragma omp for schedule(static)
        for (int t = 0; t < B * Hkv; t++) {
            if (!scores) continue;
            int b = t / Hkv, h = t % Hkv;
            int64_t p = pos[b], r = ws_rows ? ws_rows[b] : b, lo = window > 0 && p - window + 1 > 0 ? p - window + 1 : 0;
            attend_row((const char *)qkv + (size_t)b * qkv_stride * es, H, Hkv, D, h, bf16,
                       (const char *)cos + (size_t)p * D * es, (const char *)sin + (size_t)p * D * es,
                       (char *)kc + ((size_t)r * ws_row + (size_t)h * ws_head) * es,
                       (char *)vc + ((size_t)r * ws_row + (size_t)h * ws_head) * es, p, lo, scale,
                       (char *)out + (size_t)b * H * D * es, scores);
        }
        free(scores);
    }
    return err ? -3 : 0;
}

/* x: [N, C] (updated in place by a, unless a is NULL); w: [C]; h: [N, C]. C a multiple of 16. */
int mooncake_add_rmsnorm(void *x, const void *a, const void *w, void *h, int N, int C, float eps, int bf16) {
    if (N < 1 || C < 16 || C % 16) return -1;
    int es = bf16 ? 2 : 4;
    for (int n = 0; n < N; n++) {
        char *xr = (char *)x + (size_t)n * C * es;
        const char *ar = a ? (const char *)a + (size_t)n * C * es : NULL;
        __m512 ss = _mm512_setzero_ps();
        for (int c = 0; c < C; c += 16) {
            __m512 v = load16(xr + (size_t)c * es, bf16);
            if (ar) {
                v = round_to(_mm512_add_ps(v, load16(ar + (size_t)c * es, bf16)), bf16);
                store16(xr + (size_t)c * es, v, bf16);
            }
            ss = _mm512_fmadd_ps(v, v, ss);
        }
        __m512 r = _mm512_set1_ps(1.f / sqrtf(_mm512_reduce_add_ps(ss) / (float)C + eps));
        char *hr = (char *)h + (size_t)n * C * es;
        for (int c = 0; c < C; c += 16)
            store16(hr + (size_t)c * es,
                    _mm512_mul_ps(round_to(_mm512_mul_ps(load16(xr + (size_t)c * es, bf16), r), bf16),
                                  load16((const char *)w + (size_t)c * es, bf16)), bf16);
    }
    return 0;
}

/* out = silu(g) * u for gu: [N, 2 I] (gate then up, as the fused projection's output); out: [N, I].
 * silu(g) is rounded to the dtype before the product, as torch's two ops round. I a multiple of 16. */
int mooncake_silu_mul(const void *gu, void *out, int N, int I, int bf16) {
    if (N < 1 || I < 16 || I % 16) return -1;
    int es = bf16 ? 2 : 4;
    for (int n = 0; n < N; n++) {
        const char *g = (const char *)gu + (size_t)n * 2 * I * es, *u = g + (size_t)I * es;
        char *o = (char *)out + (size_t)n * I * es;
        for (int i = 0; i < I; i += 16) {
            __m512 x = load16(g + (size_t)i * es, bf16);
            __m512 e = exp_any(_mm512_sub_ps(_mm512_setzero_ps(), x));
            __m512 sx = round_to(_mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.f), e)), bf16);
            store16(o + (size_t)i * es, _mm512_mul_ps(sx, load16(u + (size_t)i * es, bf16)), bf16);
        }
    }
    return 0;
}
