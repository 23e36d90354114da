/* Grammar masks on logits: every token a row's bitmask forbids becomes -inf.
 *
 * bitmask is xgrammar's layout: row r holds `words` int32 words, bit j of word w set = token
 * 32 w + j allowed. Only rows listed in `rows` are applied (the constrained rows of the
 * batch); tokens at or past `vocab` are never written. Built and called like
 * paged_decode.c (see radixserve/executor/native/__init__.py).
 *
 * With AVX-512 a word's 32 bits are directly the lane mask of one masked store of -inf
 * (bfloat16: 32 lanes; float32: two stores of 16), so a row of a 49k vocabulary costs
 * ~1.5k stores whatever the grammar allows; without it, a scalar loop over the zero bits.
 */
#include <stdint.h>

#define NEG_INF_BF16 ((uint16_t)0xFF80u)
#define NEG_INF_F32 0xFF800000u

static inline uint32_t word_mask(int64_t w, int64_t vocab) { /* bits of tokens < vocab */
    const int64_t left = vocab - 32 * w;
    return left >= 32 ? 0xFFFFFFFFu : ((1u << left) - 1u);
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>

void apply_token_bitmask_bf16(uint16_t *logits, int64_t row_stride, const int32_t *bitmask,
                              int64_t words, const int64_t *rows, int64_t num_rows,
                              int64_t vocab) {
    const __m512i neg_inf = _mm512_set1_epi16((short)NEG_INF_BF16);
    for (int64_t i = 0; i < num_rows; i++) {
        const int64_t r = rows[i];
        uint16_t *row = logits + r * row_stride;
        const uint32_t *bits = (const uint32_t *)bitmask + r * words;
        for (int64_t w = 0; 32 * w < vocab && w < words; w++) {
            const uint32_t forbid = ~bits[w] & word_mask(w, vocab);
            if (forbid) _mm512_mask_storeu_epi16(row + 32 * w, (__mmask32)forbid, neg_inf);
        }
    }
}

void apply_token_bitmask_f32(float *logits, int64_t row_stride, const int32_t *bitmask,
                             int64_t words, const int64_t *rows, int64_t num_rows,
                             int64_t vocab) {
    const __m512i neg_inf = _mm512_set1_epi32((int)NEG_INF_F32);
    for (int64_t i = 0; i < num_rows; i++) {
        const int64_t r = rows[i];
        float *row = logits + r * row_stride;
        const uint32_t *bits = (const uint32_t *)bitmask + r * words;
        for (int64_t w = 0; 32 * w < vocab && w < words; w++) {
            const uint32_t forbid = ~bits[w] & word_mask(w, vocab);
            if (forbid & 0xFFFFu)
                _mm512_mask_storeu_epi32(row + 32 * w, (__mmask16)(forbid & 0xFFFFu), neg_inf);
            if (forbid >> 16)
                _mm512_mask_storeu_epi32(row + 32 * w + 16, (__mmask16)(forbid >> 16), neg_inf);
        }
    }
}
#else
#define DEFINE_APPLY(NAME, T, NEG_INF)                                                  \
    void NAME(T *logits, int64_t row_stride, const int32_t *bitmask, int64_t words,     \
              const int64_t *rows, int64_t num_rows, int64_t vocab) {                   \
        for (int64_t i = 0; i < num_rows; i++) {                                        \
            const int64_t r = rows[i];                                                  \
            T *row = logits + r * row_stride;                                           \
            const uint32_t *bits = (const uint32_t *)bitmask + r * words;               \
            for (int64_t w = 0; 32 * w < vocab && w < words; w++) {                     \
                uint32_t forbid = ~bits[w] & word_mask(w, vocab);                       \
                while (forbid) {                                                        \
                    row[32 * w + __builtin_ctz(forbid)] = NEG_INF;                      \
                    forbid &= forbid - 1u;                                              \
                }                                                                       \
            }                                                                           \
        }                                                                               \
    }
DEFINE_APPLY(apply_token_bitmask_bf16, uint16_t, NEG_INF_BF16)
typedef union { uint32_t u; float f; } f32_bits;
static const f32_bits neg_inf_f32 = {NEG_INF_F32};
DEFINE_APPLY(apply_token_bitmask_f32, float, neg_inf_f32.f)
#endif
