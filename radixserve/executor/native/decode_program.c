/* A one-token decode step as one call: a flat list of kernel calls, run in order.
 *
 * A batch-1 decode step of a small model is ~300 kernel calls of a few microseconds each
 * (SmolLM2-135M: 30 layers of RMSNorm, q/k/v, rotary, KV write, attention, o, RMSNorm,
 * gate/up, SiLU-and-mul, down); called one by one from Python, each pays ctypes, argument
 * checks and a fresh output tensor, which at 576 hidden dimensions is as much as the
 * kernel. Here the Python side (executor/decode_program.py) lays the calls out once, with
 * every buffer preallocated, and each step is one call of `decode_program_run`.
 *
 * Every op calls the same kernel, with the same arguments, as the op-by-op path would
 * (the kernels live in their own libraries: elementwise.c, int4_panels.c, int8_panels.c,
 * paged_decode.c; their addresses come in the op), so the result is the same bit for
 * bit. Only four values change from step to step: the token id, its position, its KV
 * slot and the sequence's pages; they are read through the pointers of `step`.
 *
 * ops: [n][OP_WIDTH] int64, op[0] the kind, op[1] the kernel's address, then its
 * arguments (floats as the bits of a double). step: [token_id*, position*, slot*,
 * page_table* (int32), seq_len* (int32), max_pages], the pointers to int64 unless said.
 * Returns 0, or -(1 + i) when op i refused (a kernel's error or an id or position out of
 * range): the caller raises.
 */
#include <stdint.h>
#include <string.h>

enum { OP_EMBED = 1, OP_NORM, OP_INT4, OP_INT8, OP_ROTARY, OP_KV_WRITE, OP_DECODE, OP_SILU };
#define OP_WIDTH 20

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
typedef void (*silu_fn)(const void *, void *, int64_t, int64_t, int);

static inline double as_double(int64_t bits) {
    double d;
    memcpy(&d, &bits, sizeof d);
    return d;
}

#define P(i) ((void *)(intptr_t)op[i])

int decode_program_run(const int64_t *ops, int64_t n, const int64_t *step) {
    const int64_t token = *(const int64_t *)(intptr_t)step[0];
    const int64_t position = *(const int64_t *)(intptr_t)step[1];
    const int64_t *slot = (const int64_t *)(intptr_t)step[2];
    const int32_t *page_table = (const int32_t *)(intptr_t)step[3];
    const int32_t *seq_len = (const int32_t *)(intptr_t)step[4];
    const int max_pages = (int)step[5];
    for (int64_t i = 0; i < n; i++) {
        const int64_t *op = ops + i * OP_WIDTH;
        int rc = 0;
        switch (op[0]) {
        case OP_EMBED: /* dst, table, row bytes, rows */
            if (token < 0 || token >= op[5]) return (int)-(1 + i);
            memcpy(P(2), (const char *)P(3) + token * op[4], (size_t)op[4]);
            break;
        case OP_NORM: /* add (0: none), residual, weight, out, d, eps, threads */
            ((norm_fn)P(1))(P(2), P(3), P(4), P(5), 1, op[6], (float)as_double(op[7]), (int)op[8]);
            break;
        case OP_INT4: /* x, k, panels, sz, n, group, xs, xp, y, threads */
            rc = ((int4_fn)P(1))(P(2), 1, op[3], P(4), P(5), op[6], op[7], P(8), P(9), P(10),
                                 op[6], (int)op[11]);
            break;
        case OP_INT8: /* x, k, panels, scale, zero, n, group, xt, xs, y, threads */
            rc = ((int8_fn)P(1))(P(2), 1, op[3], P(4), P(5), P(6), op[7], op[8], P(9), P(10),
                                 P(11), op[7], (int)op[12]);
            break;
        case OP_ROTARY: /* x, heads, d, cos table, sin table, table rows, threads */
            if (position < 0 || position >= op[7]) return (int)-(1 + i);
            ((rotary_fn)P(1))(P(2), 1, op[3], op[4], op[3] * op[4],
                              (const uint16_t *)P(5) + position * op[4],
                              (const uint16_t *)P(6) + position * op[4], (int)op[8]);
            break;
        case OP_KV_WRITE: /* k, v, k cache, v cache, kv heads, page size, head bytes, threads */
            ((kv_write_fn)P(1))(P(2), P(3), 0, 0, P(4), P(5), slot, 1, op[6], op[7], op[8],
                                (int)op[9]);
            break;
        case OP_DECODE: /* q, k cache, v cache, kv heads, group, page size, d, scale, window,
                           softcap, threads, out */
            rc = ((decode_fn)P(1))(P(2), P(3), P(4), page_table, seq_len, 1, max_pages,
                                   (int)op[5], (int)op[6], (int)op[7], (int)op[8],
                                   (float)as_double(op[9]), (int)op[10],
                                   (float)as_double(op[11]), (int)op[12], P(13), NULL, 0);
            break;
        case OP_SILU: /* x, out, d, threads */
            ((silu_fn)P(1))(P(2), P(3), 1, op[4], (int)op[5]);
            break;
        default:
            return (int)-(1 + i);
        }
        if (rc != 0) return (int)-(1 + i);
    }
    return 0;
}
