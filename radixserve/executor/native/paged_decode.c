/* Paged decode attention for CPU: one query token per sequence, K/V read in place from the
 * page-major cache [num_pages, kv_heads, page_size, head_dim], online softmax in float32.
 *
 * Plain C with OpenMP, built at first use by radixserve/executor/native/__init__.py and
 * called through ctypes on raw tensor pointers (no Python objects cross this boundary).
 * Each (sequence, kv head) task reads its pages once: no gather copy, no score tensor.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define MAX_GROUP 16
#define MAX_HEAD_DIM 256
#define MAX_PAGE 256

static inline float bf16_to_f32(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even; inputs are finite */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* One task: the `group` query heads that share kv head `h` of sequence `b`. */
#define DEFINE_TASK(NAME, T, LOAD, STORE)                                                     \
    static inline __attribute__((always_inline)) void NAME(                                 \
        const T *q, const T *k_cache, const T *v_cache, const int32_t *pages,               \
        int32_t seq_len, int kv_heads, int h, int group, int page_size, int d, float scale, \
        T *out) {                                                                           \
        float qf[MAX_GROUP][MAX_HEAD_DIM], acc[MAX_GROUP][MAX_HEAD_DIM];                    \
        float m[MAX_GROUP], l[MAX_GROUP], s[MAX_GROUP][MAX_PAGE], kf[MAX_HEAD_DIM];         \
        for (int g = 0; g < group; g++) {                                                   \
            const T *qr = q + (size_t)(h * group + g) * d;                                  \
            for (int i = 0; i < d; i++) qf[g][i] = LOAD(qr[i]) * scale;                     \
            for (int i = 0; i < d; i++) acc[g][i] = 0.0f;                                   \
            m[g] = -INFINITY;                                                               \
            l[g] = 0.0f;                                                                    \
        }                                                                                   \
        const size_t page_stride = (size_t)kv_heads * page_size * d;                        \
        for (int p = 0; p * page_size < seq_len; p++) {                                     \
            const size_t base = (size_t)pages[p] * page_stride + (size_t)h * page_size * d; \
            const T *kp = k_cache + base, *vp = v_cache + base;                             \
            int n = seq_len - p * page_size;                                                \
            if (n > page_size) n = page_size;                                               \
            for (int t = 0; t < n; t++) {                                                   \
                const T *kr = kp + (size_t)t * d;                                           \
                for (int i = 0; i < d; i++) kf[i] = LOAD(kr[i]);                            \
                for (int g = 0; g < group; g++) {                                           \
                    float dot = 0.0f;                                                       \
                    for (int i = 0; i < d; i++) dot += qf[g][i] * kf[i];                    \
                    s[g][t] = dot;                                                          \
                }                                                                           \
            }                                                                               \
            for (int g = 0; g < group; g++) {                                               \
                float page_max = s[g][0];                                                   \
                for (int t = 1; t < n; t++) page_max = s[g][t] > page_max ? s[g][t] : page_max; \
                const float new_m = page_max > m[g] ? page_max : m[g];                      \
                const float rescale = expf(m[g] - new_m);                                   \
                l[g] *= rescale;                                                            \
                for (int i = 0; i < d; i++) acc[g][i] *= rescale;                           \
                for (int t = 0; t < n; t++) {                                               \
                    s[g][t] = expf(s[g][t] - new_m);                                        \
                    l[g] += s[g][t];                                                        \
                }                                                                           \
                m[g] = new_m;                                                               \
            }                                                                               \
            for (int t = 0; t < n; t++) {                                                   \
                const T *vr = vp + (size_t)t * d;                                           \
                for (int i = 0; i < d; i++) kf[i] = LOAD(vr[i]);                            \
                for (int g = 0; g < group; g++) {                                           \
                    const float w = s[g][t];                                                \
                    for (int i = 0; i < d; i++) acc[g][i] += w * kf[i];                     \
                }                                                                           \
            }                                                                               \
        }                                                                                   \
        for (int g = 0; g < group; g++) {                                                   \
            T *o = out + (size_t)(h * group + g) * d;                                       \
            const float inv = 1.0f / l[g];                                                  \
            for (int i = 0; i < d; i++) o[i] = STORE(acc[g][i] * inv);                      \
        }                                                                                   \
    }

#define IDENTITY(x) (x)
DEFINE_TASK(task_bf16, uint16_t, bf16_to_f32, f32_to_bf16)
DEFINE_TASK(task_f32, float, IDENTITY, IDENTITY)

/* q, out: [batch, kv_heads * group, d]; page_tables: [batch, max_pages]; seq_lens: [batch].
 * Returns 0, or -1 if a size is beyond the kernel's fixed buffers (the caller falls back). */
#define DEFINE_ENTRY(NAME, T, TASK)                                                          \
    int NAME(const T *q, const T *k_cache, const T *v_cache, const int32_t *page_tables,     \
             const int32_t *seq_lens, int batch, int max_pages, int kv_heads, int group,     \
             int page_size, int d, float scale, int num_threads, T *out) {                   \
        if (group > MAX_GROUP || d > MAX_HEAD_DIM || page_size > MAX_PAGE) return -1;        \
        const int heads = kv_heads * group;                                                  \
        _Pragma("omp parallel for schedule(dynamic, 1) num_threads(num_threads)")            \
        for (int task = 0; task < batch * kv_heads; task++) {                                \
            const int b = task / kv_heads, h = task % kv_heads;                              \
            const T *qb = q + (size_t)b * heads * d;                                         \
            T *ob = out + (size_t)b * heads * d;                                             \
            const int32_t *pages = page_tables + (size_t)b * max_pages;                      \
            if (d == 64)                                                                     \
                TASK(qb, k_cache, v_cache, pages, seq_lens[b], kv_heads, h, group,           \
                     page_size, 64, scale, ob);                                              \
            else if (d == 128)                                                               \
                TASK(qb, k_cache, v_cache, pages, seq_lens[b], kv_heads, h, group,           \
                     page_size, 128, scale, ob);                                             \
            else                                                                             \
                TASK(qb, k_cache, v_cache, pages, seq_lens[b], kv_heads, h, group,           \
                     page_size, d, scale, ob);                                               \
        }                                                                                    \
        return 0;                                                                            \
    }

DEFINE_ENTRY(paged_decode_bf16, uint16_t, task_bf16)
DEFINE_ENTRY(paged_decode_f32, float, task_f32)
