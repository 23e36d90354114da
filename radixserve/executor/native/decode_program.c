/* A decode step of one token per sequence as one call: a flat list of kernel calls, run in
 * order, over the step's n rows.
 *
 * A decode step of a small model is ~300 kernel calls of a few microseconds each (SmolLM2-
 * 135M: 30 layers of RMSNorm, q/k/v, rotary, KV write, attention, o, RMSNorm, gate/up,
 * SiLU-and-mul, down); called one by one from Python, each pays ctypes, argument checks
 * and a fresh output tensor, which at 576 hidden dimensions is as much as the kernel (at
 * one row) and ~10% of a step of 16 rows. Here the Python side
 * (executor/decode_program.py) lays the calls out once, with every buffer preallocated
 * for up to its capacity of rows, and each step is one call of `decode_program_run`.
 *
 * Every op calls the same kernel, with the same arguments, as the op-by-op path would
 * (the kernels live in their own libraries: elementwise.c, int4_panels.c, int8_panels.c,
 * paged_decode.c; their addresses come in the op), so the result is the same bit for
 * bit. What changes from step to step is read through the pointers of
 * `step`: the token ids, their positions, their KV slots, the sequences' pages and
 * lengths, and the row count n.
 *
 * ops: [count][OP_WIDTH] int64, op[0] the kind, op[1] the kernel's address, then its
 * arguments (floats as the bits of a double; a row stride in elements of the tensor's
 * type unless said). step: [token_ids*, positions*, slots*, page_tables* (int32),
 * seq_lens* (int32), max_pages, n, LoRA descriptor* (0: no adapter in the step; see
 * lora.c)], the pointers to int64 unless said. Returns 0, or
 * -(1 + i) when op i refused (a kernel's error or an id or position out of range): the
 * caller raises.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

enum {
    OP_EMBED = 1,
    OP_NORM,
    OP_INT4,
    OP_INT8,
    OP_ROTARY_ROWS,
    OP_ROTARY,
    OP_KV_WRITE,
    OP_DECODE,
    OP_SILU,
    OP_COPY_ROWS,
    OP_NORM_HEADS,
    OP_BIAS,
    OP_MOE,
    OP_LORA,
    OP_KV_WRITE_INT8,
    OP_DECODE_INT8,
};
#define OP_WIDTH 20
/* a row-wise kernel's threads: no more than rows, as LayerOps' (one row: no thread woken to
 * do nothing; at 16 rows both threads, which also keeps the second one from falling asleep
 * between the GEMMs: one thread on the row-wise kernels cost 0.8 ms in a 16-row Gemma 3
 * step's forward and 0.7 in its LM head) */
#define ROW_THREADS(t) ((int)(n < (t) ? n : (t)))

typedef void (*norm_fn)(const void *, void *, const void *, void *, int64_t, int64_t, float, int);
typedef int (*int4_fn)(const void *, int64_t, int64_t, const void *, const void *, int64_t,
                       int64_t, void *, void *, void *, int64_t, int);
typedef int (*int8_fn)(const void *, int64_t, int64_t, const void *, const void *, const void *,
                       int64_t, int64_t, void *, void *, void *, int64_t, int);
typedef void (*rotary_fn)(void *, int64_t, int64_t, int64_t, int64_t, const void *, const void *,
                          int);
typedef void (*kv_write_fn)(const char *, const char *, int64_t, int64_t, char *, char *,
                            const int64_t *, int64_t, int64_t, int64_t, int64_t, int);
typedef int (*decode_fn)(const void *, const void *, const void *, const int32_t *,
                         const int32_t *, int, int, int, int, int, int, float, int, float, int,
                         void *, const float *, int);
typedef void (*kv_write_int8_fn)(const void *, const void *, int64_t, int64_t, void *, void *,
                                 void *, void *, const int64_t *, int64_t, int64_t, int64_t,
                                 int64_t, int);
typedef int (*decode_int8_fn)(const void *, const void *, const void *, const void *,
                              const void *, const int32_t *, const int32_t *, int, int, int, int,
                              int, int, float, int, float, int, void *);
typedef void (*act_fn)(const void *, void *, int64_t, int64_t, int);
typedef int (*lora_fn)(const void *, int64_t, void *, int64_t, int64_t, int64_t, int64_t,
                       const int64_t *, int64_t, int64_t, int);

static inline double as_double(int64_t bits) {
    double d;
    memcpy(&d, &bits, sizeof d);
    return d;
}

/* bfloat16 <-> float32 as PyTorch rounds (to nearest even; any NaN to its one NaN) */
static inline float bf16_f32(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t f32_bf16(float f) {
    if (f != f) return 0x7FC0u;
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

#define P(i) ((void *)(intptr_t)op[i])
#define BF16(i) ((uint16_t *)(intptr_t)op[i])

static int routed_experts(const int64_t *op, int64_t n, const int64_t *step);

/* One op over the step's n rows: 0, or nonzero when it refused. */
static int run_op(const int64_t *op, int64_t n, const int64_t *step) {
    const int64_t *tokens = (const int64_t *)(intptr_t)step[0];
    const int64_t *positions = (const int64_t *)(intptr_t)step[1];
    const int64_t *slots = (const int64_t *)(intptr_t)step[2];
    const int32_t *page_tables = (const int32_t *)(intptr_t)step[3];
    const int32_t *seq_lens = (const int32_t *)(intptr_t)step[4];
    const int max_pages = (int)step[5];
    int rc = 0;
    switch (op[0]) {
    case OP_EMBED: /* dst, table, row bytes, table rows */
        for (int64_t r = 0; r < n; r++) {
            if (tokens[r] < 0 || tokens[r] >= op[5]) return 1;
            memcpy((char *)P(2) + r * op[4], (const char *)P(3) + tokens[r] * op[4],
                   (size_t)op[4]);
        }
        break;
    case OP_NORM: /* add (0: none), residual, weight, out, d, eps, threads */
        ((norm_fn)P(1))(P(2), P(3), P(4), P(5), n, op[6], (float)as_double(op[7]),
                        ROW_THREADS(op[8]));
        break;
    case OP_INT4: /* x, k, panels, sz, n, group, xs, xp, y, threads */
        rc = ((int4_fn)P(1))(P(2), n, op[3], P(4), P(5), op[6], op[7], P(8), P(9), P(10),
                             op[6], (int)op[11]);
        break;
    case OP_INT8: /* x, k, panels, scale, zero, n, group, xt, xs, y, threads */
        rc = ((int8_fn)P(1))(P(2), n, op[3], P(4), P(5), P(6), op[7], op[8], P(9), P(10),
                             P(11), op[7], (int)op[12]);
        break;
    case OP_ROTARY_ROWS: /* cos table, sin table, table rows, d, cos rows, sin rows:
                            each row's position's table rows, gathered */
        for (int64_t r = 0; r < n; r++) {
            if (positions[r] < 0 || positions[r] >= op[4]) return 1;
            const size_t bytes = (size_t)op[5] * sizeof(uint16_t);
            memcpy(BF16(6) + r * op[5], BF16(2) + positions[r] * op[5], bytes);
            memcpy(BF16(7) + r * op[5], BF16(3) + positions[r] * op[5], bytes);
        }
        break;
    case OP_ROTARY: /* x, heads, d, row stride, cos rows, sin rows, threads */
        ((rotary_fn)P(1))(P(2), n, op[3], op[4], op[5], P(6), P(7),
                          ROW_THREADS(op[8]));
        break;
    case OP_KV_WRITE: /* k, v, k and v row strides in bytes, k cache, v cache, kv heads,
                         page size, head bytes */
        ((kv_write_fn)P(1))(P(2), P(3), op[4], op[5], P(6), P(7), slots, n, op[8], op[9],
                            op[10], 1);
        break;
    case OP_DECODE: /* q, k cache, v cache, kv heads, group, page size, d, scale, window,
                       softcap, threads, out */
        rc = ((decode_fn)P(1))(P(2), P(3), P(4), page_tables, seq_lens, (int)n, max_pages,
                               (int)op[5], (int)op[6], (int)op[7], (int)op[8],
                               (float)as_double(op[9]), (int)op[10],
                               (float)as_double(op[11]), (int)op[12], P(13), NULL, 0);
        break;
    case OP_KV_WRITE_INT8: /* k, v, k and v row strides in elements, k codes, v codes,
                              k scales, v scales, kv heads, page size, d (an int8 cache) */
        ((kv_write_int8_fn)P(1))(P(2), P(3), op[4], op[5], P(6), P(7), P(8), P(9), slots, n,
                                 op[10], op[11], op[12], 1);
        break;
    case OP_DECODE_INT8: /* q, k codes, v codes, k scales, v scales, kv heads, group, page
                            size, d, scale, window, softcap, threads, out */
        rc = ((decode_int8_fn)P(1))(P(2), P(3), P(4), P(5), P(6), page_tables, seq_lens,
                                    (int)n, max_pages, (int)op[7], (int)op[8], (int)op[9],
                                    (int)op[10], (float)as_double(op[11]), (int)op[12],
                                    (float)as_double(op[13]), (int)op[14], P(15));
        break;
    case OP_SILU: /* x, out, d, threads (SiLU- or GELU-and-mul) */
        ((act_fn)P(1))(P(2), P(3), n, op[4],
                       ROW_THREADS(op[5]));
        break;
    case OP_COPY_ROWS: /* src, src row stride in bytes, dst, row bytes */
        for (int64_t r = 0; r < n; r++)
            memcpy((char *)P(4) + r * op[5], (const char *)P(2) + r * op[3], (size_t)op[5]);
        break;
    case OP_NORM_HEADS: /* norm, src, src row stride, heads, d, weight, dst, eps: each
                           row's heads RMS-normed into dst [n, heads, d] */
        for (int64_t r = 0; r < n; r++)
            ((norm_fn)P(1))(NULL, BF16(2) + r * op[3], P(6), BF16(7) + r * op[4] * op[5],
                            op[4], op[5], (float)as_double(op[8]), 1);
        break;
    case OP_BIAS: /* y [n, width], bias [width]: y += bias (a linear's bias, after its
                     GEMM: ``y + bias`` in bfloat16, as the op-by-op path adds it) */
        for (int64_t r = 0; r < n; r++) {
            uint16_t *y = BF16(2) + r * op[4];
            const uint16_t *b = BF16(3);
            for (int64_t j = 0; j < op[4]; j++) y[j] = f32_bf16(bf16_f32(y[j]) + bf16_f32(b[j]));
        }
        break;
    case OP_MOE:
        rc = routed_experts(op, n, step);
        break;
    case OP_LORA: /* x, x stride, y, y stride, in, out, slot, threads: the step's LoRA
                     adapters' products added to y (step[7]: their descriptor; 0: none) */
        if (step[7] != 0)
            rc = ((lora_fn)P(1))(P(2), op[3], P(4), op[5], op[6], op[7], op[8],
                                 (const int64_t *)(intptr_t)step[7], 0, n, (int)op[9]);
        break;
    default:
        return 1;
    }
    return rc;
}

int decode_program_run(const int64_t *ops, int64_t count, const int64_t *step) {
    for (int64_t i = 0; i < count; i++)
        if (run_op(ops + i * OP_WIDTH, step[6], step) != 0) return (int)-(1 + i);
    return 0;
}


/* A mixture-of-experts MLP over the step's n rows (executor/routed_experts.py):
 *   route: each row's logits over the E experts (float32 dot products of its bfloat16
 *     values with the router's rows, rounded to bfloat16 as a bfloat16 GEMM's output is),
 *     their softmax in float32, the top k (the first of equal ones), renormalised to sum
 *     to 1 when flags & 1, rounded to bfloat16 unless flags & 2 (Mixtral); a row whose
 *     logits are not all numbers takes experts 0..k-1 with NaN weights (NaN out, as the
 *     Python path gives, not an error);
 *   run: the rows grouped by expert (in row order), each chosen expert's ops run once
 *     over its rows gathered into `xg` (the expert's ops read `xg` and leave its output in
 *     `yd`: gate/up GEMM, activation, down GEMM, each one of this file's ops);
 *   combine: each row's chosen outputs times their weights summed in float32, rounded to
 *     bfloat16 once, into `out`.
 * Only the chosen experts' weights are read. op: threads (in the kernel's place), x,
 * hidden, router [E, hidden], E, k, flags, expert ops [1 + threads][E][per][OP_WIDTH]
 * (table 0: each op on all the threads over scratch set 0; table 1 + t: on one thread over
 * set t), per, xg [threads][cap, hidden], yd [threads][cap, hidden], acc (float)
 * [threads][cap, hidden] (the scratch sets), out [n, hidden],
 * ids (int64) [cap * k], weights (float) [cap * k], logits (float) [cap * E],
 * order (int64) [cap * k], capacity, counts (int64) [E + 1]. Refuses (1) more rows than
 * the capacity, k > E, or an expert op that refuses. */
static int routed_experts(const int64_t *op, int64_t n, const int64_t *step) {
    const uint16_t *x = BF16(2), *router = BF16(4);
    const int64_t hidden = op[3], n_experts = op[5], k = op[6], flags = op[7];
    const int64_t *expert_ops = (const int64_t *)(intptr_t)op[8];
    const int64_t per = op[9];
    uint16_t *xg = BF16(10), *yd = BF16(11), *out = BF16(13);
    float *acc = (float *)P(12), *weights = (float *)P(15), *logits = (float *)P(16);
    int64_t *ids = (int64_t *)P(14), *order = (int64_t *)P(17), *counts = (int64_t *)P(19);
    const int threads = (int)op[1];
    if (n > op[18] || k > n_experts) return 1;
    /* every row's logits, on the threads when there are enough of them to share */
    _Pragma("omp parallel for schedule(static) num_threads(threads) if (n * n_experts * hidden >= (1 << 20))")
    for (int64_t re = 0; re < n * n_experts; re++) {
        const uint16_t *xr = x + (re / n_experts) * hidden;
        const uint16_t *w = router + (re % n_experts) * hidden;
        /* 16 independent partial sums (the compiler keeps them in one vector: a single
         * chain of float adds may not be reordered, and would run at its latency) */
        float part[16] = {0};
        int64_t h = 0;
        for (; h + 16 <= hidden; h += 16)
            for (int l = 0; l < 16; l++) part[l] += bf16_f32(xr[h + l]) * bf16_f32(w[h + l]);
        for (; h < hidden; h++) part[0] += bf16_f32(xr[h]) * bf16_f32(w[h]);
        float s = 0.0f;
        for (int l = 0; l < 16; l++) s += part[l];
        logits[re] = bf16_f32(f32_bf16(s));
    }
    for (int64_t r = 0; r < n; r++) {
        float *lr = logits + r * n_experts;
        float top = -INFINITY;
        for (int64_t e = 0; e < n_experts; e++)
            if (lr[e] > top) top = lr[e];
        float total = 0.0f;
        for (int64_t e = 0; e < n_experts; e++) total += (lr[e] = expf(lr[e] - top));
        if (!(total > 0.0f) || total != total || top == INFINITY) { /* NaN or inf logits */
            for (int64_t j = 0; j < k; j++) {
                ids[r * k + j] = j;
                weights[r * k + j] = NAN;
            }
            continue;
        }
        float chosen = 0.0f;
        for (int64_t j = 0; j < k; j++) {
            int64_t best = -1;
            for (int64_t e = 0; e < n_experts; e++)
                if (lr[e] >= 0.0f && (best < 0 || lr[e] > lr[best])) best = e;
            ids[r * k + j] = best;
            weights[r * k + j] = lr[best] / total;
            chosen += weights[r * k + j];
            lr[best] = -1.0f; /* taken */
        }
        for (int64_t j = 0; j < k; j++) {
            float w = weights[r * k + j];
            if (flags & 1) w /= chosen;
            if (!(flags & 2)) w = bf16_f32(f32_bf16(w));
            weights[r * k + j] = w;
        }
    }
    /* the (row, slot) pairs grouped by expert, in row order within each */
    memset(counts, 0, (size_t)(n_experts + 1) * sizeof *counts);
    for (int64_t p = 0; p < n * k; p++) counts[ids[p] + 1]++;
    for (int64_t e = 0; e < n_experts; e++) counts[e + 1] += counts[e];
    for (int64_t p = 0; p < n * k; p++) order[counts[ids[p]]++] = p;
    /* counts[e] is now the end of expert e's pairs (the start of e + 1's) */
    int64_t active = 0; /* experts with rows this step */
    for (int64_t e = 0; e < n_experts; e++) active += counts[e] > (e ? counts[e - 1] : 0);
    const int64_t cap = op[18], table = n_experts * per * OP_WIDTH;
    /* Enough experts to share: each thread runs whole experts, single-threaded, over its
     * own scratch (table 1 + t, the t-th xg / yd / acc) and sums into its own acc; else
     * every expert's ops run on all the threads in turn (table 0, scratch 0). One parallel
     * region a layer instead of three per expert, and each thread streams its experts'
     * weights whole. */
    const int sets = threads > 1 && active >= 2 * threads ? threads : 1;
    int failed = 0;
    _Pragma("omp parallel num_threads(sets) if (sets > 1) reduction(|:failed)")
    {
        const int t = sets > 1 ? omp_get_thread_num() : 0;
        const int64_t lo = t * active / sets, hi = (t + 1) * active / sets;
        const int64_t *ops_t = expert_ops + (sets > 1 ? 1 + t : 0) * table;
        uint16_t *xg_t = xg + t * cap * hidden, *yd_t = yd + t * cap * hidden;
        float *acc_t = acc + t * cap * hidden;
        memset(acc_t, 0, (size_t)(n * hidden) * sizeof *acc_t);
        int64_t start = 0, index = 0;
        for (int64_t e = 0; e < n_experts && !failed; e++) {
            const int64_t rows = counts[e] - start;
            if (rows == 0) continue;
            if (index >= lo && index < hi) {
                for (int64_t i = 0; i < rows; i++)
                    memcpy(xg_t + i * hidden, x + (order[start + i] / k) * hidden,
                           (size_t)hidden * sizeof *x);
                for (int64_t j = 0; j < per && !failed; j++)
                    failed = run_op(ops_t + (e * per + j) * OP_WIDTH, rows, step) != 0;
                for (int64_t i = 0; i < rows; i++) {
                    const int64_t p = order[start + i];
                    const float w = weights[p];
                    float *a = acc_t + (p / k) * hidden;
                    const uint16_t *y = yd_t + i * hidden;
                    for (int64_t h = 0; h < hidden; h++) a[h] += w * bf16_f32(y[h]);
                }
            }
            index++;
            start = counts[e];
        }
    }
    if (failed) return 1;
    for (int t = 1; t < sets; t++) /* the threads' sums, in thread order */
        for (int64_t i = 0; i < n * hidden; i++) acc[i] += acc[t * cap * hidden + i];
    for (int64_t i = 0; i < n * hidden; i++) out[i] = f32_bf16(acc[i]);
    return 0;
}
