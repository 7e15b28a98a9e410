/* Attention of one new token over its sequence's past (decode at batch 1), bfloat16 in and
 * out, float32 inside: torch's CPU flash kernel spends ~100 µs of fixed cost per call on
 * what is ~0.1 MFLOP here. Grouped-query: the G query heads of a kv head share its keys.
 *
 *   out[h] = softmax(scale * q[h] . k[t], t < K) @ v       for h in kv head h / G
 *
 * q, out: [Hkv * G, D] contiguous; k, v: per kv head j, key t at base + j * head_stride +
 * t * D (the decoder's workspace rows). D a multiple of 16, at most 256.
 * Built and loaded by native.py. */

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline __m512 load_bf16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

static inline uint16_t round_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

int mooncake_decode_attention(const uint16_t *q, const uint16_t *k, const uint16_t *v, long head_stride,
                              int Hkv, int G, int K, int D, float scale, uint16_t *out, int threads) {
    if (D % 16 || D > 256 || K < 1 || Hkv < 1 || G < 1) return -1;
    int failed = 0;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int i = 0; i < Hkv * G; i++) {  /* one query head each */
        int j = i / G;
        float *s = (float *)malloc(sizeof(float) * (size_t)K);
        if (!s) {
            failed = 1;
            continue;
        }
        const uint16_t *kj = k + (size_t)j * head_stride, *vj = v + (size_t)j * head_stride;
        int dv = D / 16;
        __m512 qv[16];
        const uint16_t *qi = q + (size_t)i * D;
        for (int c = 0; c < dv; c++) qv[c] = _mm512_mul_ps(load_bf16(qi + 16 * c), _mm512_set1_ps(scale));
        float mx = -INFINITY;
        for (int t = 0; t < K; t++) {
            __m512 acc = _mm512_setzero_ps();
            for (int c = 0; c < dv; c++) acc = _mm512_fmadd_ps(qv[c], load_bf16(kj + (size_t)t * D + 16 * c), acc);
            s[t] = _mm512_reduce_add_ps(acc);
            mx = s[t] > mx ? s[t] : mx;
        }
        float sum = 0.f;
        for (int t = 0; t < K; t++) {
            s[t] = expf(s[t] - mx);
            sum += s[t];
        }
        __m512 o[16];
        for (int c = 0; c < dv; c++) o[c] = _mm512_setzero_ps();
        for (int t = 0; t < K; t++) {
            __m512 p = _mm512_set1_ps(s[t]);
            for (int c = 0; c < dv; c++) o[c] = _mm512_fmadd_ps(p, load_bf16(vj + (size_t)t * D + 16 * c), o[c]);
        }
        uint16_t *oi = out + (size_t)i * D;
        float inv = 1.f / sum, buf[16];
        for (int c = 0; c < dv; c++) {
            _mm512_storeu_ps(buf, _mm512_mul_ps(o[c], _mm512_set1_ps(inv)));
            for (int e = 0; e < 16; e++) oi[16 * c + e] = round_bf16(buf[e]);
        }
        free(s);
    }
    return failed ? -1 : 0;
}
