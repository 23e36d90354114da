/* Dequantize weight-only int8 / int4 weights to bfloat16, for a bfloat16 GEMM.
 *
 * PyTorch's CPU kernels for quantized weights (_weight_int8pack_mm,
 * _weight_int4pack_mm_for_cpu) win at a few rows and lose from about ten rows on; from
 * there radixserve dequantizes a layer's weight into a reused buffer with these functions
 * and runs oneDNN's bfloat16 GEMM on it.
 *
 * int8: q[N][K] int8, scale[N] float  ->  out[N][K] = bf16(q * scale).
 * int4: PyTorch's CPU-packed layout (_convert_weight_to_int4pack_for_cpu) with N a multiple
 *       of 64: blocks of 64 rows, each [K][32] bytes, byte j of row k holding row n0 + j
 *       (low nibble) and row n0 + 32 + j (high nibble); scales_and_zeros [K/G][N][2]
 *       bfloat16; W = (q - 8) * scale + zero  ->  outT[K][count] = bf16(W^T) for the rows
 *       first .. first + count (transposed: every byte row becomes 64 contiguous outputs);
 *       callers take the rows a chunk at a time, so that the chunk stays in cache between
 *       its dequantization and its GEMM.
 */
#include <stdint.h>
#include <string.h>
#include <omp.h>
#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
#define QL_AVX512_BF16 1
#endif

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even (finite inputs) */
    uint32_t u;
    memcpy(&u, &f, 4);
    u += 0x7FFF + ((u >> 16) & 1);
    return (uint16_t)(u >> 16);
}

int qdequant_int8_bf16(const int8_t *q, const float *scale, int64_t N, int64_t K, int nthreads,
                       uint16_t *out) {
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const float sc = scale[n];
        const int8_t *qn = q + n * K;
        uint16_t *on = out + n * K;
        for (int64_t k = 0; k < K; k++) on[k] = f32_to_bf16((float)qn[k] * sc);
    }
    return 0;
}

int qdequant_int4pack_bf16(const uint8_t *packed, const uint16_t *sz, int64_t N, int64_t K,
                           int G, int64_t first, int64_t count, int nthreads, uint16_t *outT) {
    /* rows first .. first + count of W, as outT[K][count] */
    if (N % 64 || first % 64 || count % 64 || first + count > N || G <= 0 || K % G) return -1;
    const int64_t blocks = count / 64, groups = K / G;
#pragma omp parallel for num_threads(nthreads) schedule(static) collapse(2)
    for (int64_t bb = 0; bb < blocks; bb++) {
        for (int64_t g = 0; g < groups; g++) {
            const int64_t b = first / 64 + bb, n0 = b * 64, c0 = bb * 64;
            float s[64], z[64];
            for (int j = 0; j < 64; j++) {
                const uint16_t *p = sz + (g * N + n0 + j) * 2;
                s[j] = bf16_to_f32(p[0]);
                z[j] = bf16_to_f32(p[1]) - 8.f * s[j];
            }
#if defined(QL_AVX512_BF16)
            __m512 vs[4], vz[4];
            for (int h = 0; h < 4; h++) {
                vs[h] = _mm512_loadu_ps(s + 16 * h);
                vz[h] = _mm512_loadu_ps(z + 16 * h);
            }
            const __m256i mask = _mm256_set1_epi8(0x0F);
            for (int64_t k = g * G; k < (g + 1) * G; k++) {
                const __m256i raw = _mm256_loadu_si256((const __m256i *)(packed + (b * K + k) * 32));
                const __m256i nib[2] = {_mm256_and_si256(raw, mask),
                                        _mm256_and_si256(_mm256_srli_epi16(raw, 4), mask)};
                uint16_t *o = outT + k * count + c0;
                for (int h = 0; h < 4; h++) { /* rows n0 + 16h .. n0 + 16h + 15 */
                    const __m128i bytes16 = h & 1 ? _mm256_extracti128_si256(nib[h >> 1], 1)
                                                  : _mm256_castsi256_si128(nib[h >> 1]);
                    const __m512 f = _mm512_fmadd_ps(
                        _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes16)), vs[h], vz[h]);
                    _mm256_storeu_si256((__m256i *)(o + 16 * h), (__m256i)_mm512_cvtneps_pbh(f));
                }
            }
#else
            for (int64_t k = g * G; k < (g + 1) * G; k++) {
                const uint8_t *bytes = packed + (b * K + k) * 32;
                uint16_t *o = outT + k * count + c0;
                for (int j = 0; j < 32; j++) {
                    o[j] = f32_to_bf16((float)(bytes[j] & 0xF) * s[j] + z[j]);
                    o[j + 32] = f32_to_bf16((float)(bytes[j] >> 4) * s[j + 32] + z[j + 32]);
                }
            }
#endif
        }
    }
    return 0;
}
