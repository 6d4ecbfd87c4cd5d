/* The native decode step (decode_stack_bf16): a step of a few tokens through the whole model in one call, the
 * embedding rows, every decoder layer (norm, fused qkv linear, RoPE, K/V write, paged attention, o linear, add+norm,
 * gate_up linear, SiLU*mul, down linear), the final norm and the lm_head, with this library's kernels and each
 * linear's single-row kernel called in the order, on the operands and with the arguments the model's Python forward
 * gives them: the logits are bitwise that forward's, without the Python between the ~15 calls a layer. The model
 * comes as common.h's typed descriptors (StackModel), bound once by kernels/decode_stack.py. */
#include "cpu_internal.h"

#include <stdatomic.h>

/* Each descriptor struct's size and its fields' offsets and sizes, for the test that holds the ctypes mirrors in
 * kernels/decode_stack.py to them: fills up to `capacity` entries, returns how many there are. */
typedef struct {
    const char *name; /* "Struct" (its size), "Struct.field", or "StackLinear.kind=name" (its value as the offset) */
    int64_t offset, size;
} StackField;

#define STRUCT_SIZE(type) {#type, 0, (int64_t)sizeof(type)}
#define KIND(name, value) {"StackLinear.kind=" name, value, 0}
#define FIELD(type, field) {#type "." #field, (int64_t)offsetof(type, field), (int64_t)sizeof(((type *)0)->field)}
static const StackField STACK_LAYOUT[] = {
    STRUCT_SIZE(StackLinear), FIELD(StackLinear, kind), FIELD(StackLinear, weight), FIELD(StackLinear, scales),
    FIELD(StackLinear, zeros), FIELD(StackLinear, bits), FIELD(StackLinear, group), FIELD(StackLinear, quant_gemv),
    FIELD(StackLinear, quant_share), FIELD(StackLinear, rows), FIELD(StackLinear, next_part),
    KIND("gemv", STACK_GEMV), KIND("amx", STACK_AMX), KIND("quant", STACK_QUANT),
    STRUCT_SIZE(StackLayer), FIELD(StackLayer, input_norm), FIELD(StackLayer, qkv), FIELD(StackLayer, qkv_bias),
    FIELD(StackLayer, o), FIELD(StackLayer, o_bias), FIELD(StackLayer, post_norm), FIELD(StackLayer, gate_up),
    FIELD(StackLayer, gate_up_bias), FIELD(StackLayer, down), FIELD(StackLayer, down_bias), FIELD(StackLayer, k_pool),
    FIELD(StackLayer, v_pool),
    STRUCT_SIZE(StackBuffers), FIELD(StackBuffers, hidden), FIELD(StackBuffers, residual),
    FIELD(StackBuffers, normed), FIELD(StackBuffers, qkv), FIELD(StackBuffers, attended), FIELD(StackBuffers, gate_up),
    FIELD(StackBuffers, act), FIELD(StackBuffers, logits), FIELD(StackBuffers, cos), FIELD(StackBuffers, sin),
    FIELD(StackBuffers, last_x), FIELD(StackBuffers, last_residual),
    STRUCT_SIZE(StackModel), FIELD(StackModel, num_layers), FIELD(StackModel, hidden), FIELD(StackModel, heads),
    FIELD(StackModel, kv_heads), FIELD(StackModel, head_dim), FIELD(StackModel, intermediate), FIELD(StackModel, vocab),
    FIELD(StackModel, num_blocks), FIELD(StackModel, block_size), FIELD(StackModel, window), FIELD(StackModel, eps),
    FIELD(StackModel, scale), FIELD(StackModel, layers), FIELD(StackModel, buffers), FIELD(StackModel, embedding),
    FIELD(StackModel, final_norm), FIELD(StackModel, lm_head), FIELD(StackModel, cos_table),
    FIELD(StackModel, sin_table),
    STRUCT_SIZE(StackStep), FIELD(StackStep, tokens), FIELD(StackStep, token), FIELD(StackStep, position),
    FIELD(StackStep, slot), FIELD(StackStep, num_rows), FIELD(StackStep, tables), FIELD(StackStep, table_width),
    FIELD(StackStep, lens), FIELD(StackStep, starts), FIELD(StackStep, qlens), FIELD(StackStep, num_logits),
    FIELD(StackStep, logits_rows),
};
#undef KIND
#undef FIELD
#undef STRUCT_SIZE

int64_t decode_stack_layout(StackField *out, int64_t capacity) {
    const int64_t count = (int64_t)(sizeof STACK_LAYOUT / sizeof STACK_LAYOUT[0]);
    for (int64_t i = 0; i < count && i < capacity; i++) out[i] = STACK_LAYOUT[i];
    return count;
}

#if HAVE_AVX512
int kernel_vector_bits(void) { return 512; }

#if HAVE_AVX512_BF16
/* One part of a quantised linear (its rows of y and bias from `offset`), then each thread prefetches the start of
 * its share of `next` (NULL, or not quantised: nothing), whose inputs are next_k. */
INLINE int stack_quant_part(const StackLinear *part, const void *x, const void *bias, void *y, int64_t m,
                            int64_t offset, int64_t k, int num_threads, const StackLinear *next, int64_t next_k) {
    const StackLinear *chained = next != NULL && next->kind == STACK_QUANT ? next : NULL;
    return part->quant_gemv(part->weight, part->scales, part->zeros, (int)part->bits, x,
                            bias != NULL ? (const void *)((const uint16_t *)bias + offset) : NULL,
                            (uint16_t *)y + offset, m, part->rows, k, part->group, num_threads,
                            chained ? chained->weight : NULL, chained ? chained->scales : NULL,
                            chained ? chained->zeros : NULL, chained ? (int)chained->bits : 0,
                            chained ? chained->rows : 0, next_k, chained ? chained->group : 0);
}

/* Rows through a linear's kernel: 0 where gemm_amx_bf16 or the quantised GEMV found no memory for its prepared
 * input. gemv_bf16 serves one row only, and so do a quantised weight's parts (each writes its columns of y as one
 * row; DecodeStack runs quantised linears one token a step). `next` (next_k inputs) is the linear the step runs
 * after this one: a quantised GEMV followed by another ends with its threads prefetching the start of their
 * shares of it (a part, of the part after it). */
INLINE int stack_linear(const StackLinear *linear, const void *x, const void *bias, void *y, int64_t m, int64_t n,
                        int64_t k, int num_threads, const StackLinear *next, int64_t next_k) {
    switch (linear->kind) {
    case STACK_AMX: return gemm_amx_bf16(linear->weight, x, bias, y, m, n, k, num_threads);
    case STACK_GEMV: return m == 1 && gemv_bf16(linear->weight, x, bias, y, n, k, num_threads);
    case STACK_QUANT: {
        if (linear->next_part != NULL && m != 1) return 0;
        int64_t offset = 0;
        for (const StackLinear *part = linear; part != NULL; part = part->next_part) {
            const StackLinear *after = part->next_part;
            if (!stack_quant_part(part, x, bias, y, m, offset, k, num_threads, after != NULL ? after : next,
                                  after != NULL ? k : next_k))
                return 0;
            offset += part->rows;
        }
        return offset == n;
    }
    }
    return 0;
}

/* The first ATTENTION_PREFETCH_ROWS key and value rows a row's attention reads, prefetched before the qkv GEMV
 * (the weights streamed since the last step evicted the pool), so the attention starts on them. */
#define ATTENTION_PREFETCH_ROWS 64
INLINE void stack_prefetch_head_keys(const void *k_pool, const void *v_pool, const int64_t *table, int64_t len,
                                     int64_t head, int64_t head_dim, int64_t num_blocks, int64_t block_size,
                                     int64_t window) {
    const int shift = __builtin_ctzll((unsigned long long)block_size);
    const int64_t from = window > 0 && len > window ? len - window : 0;
    const int64_t to = from + ATTENTION_PREFETCH_ROWS < len - 1 ? from + ATTENTION_PREFETCH_ROWS : len - 1;
    for (int64_t pos = from; pos < to; pos++) {
        const int64_t row = pool_row(head * num_blocks, table, pos, shift, block_size, head_dim);
        prefetch_row(k_pool, row, head_dim, 1);
        prefetch_row(v_pool, row, head_dim, 1);
    }
}

/* Before a layer's qkv GEMV, the small cold reads after it (the pool rows write_kv fills, each row's first keys)
 * are prefetched, to come back while its stream runs. */
INLINE void stack_prefetch_layer(const StackModel *model, const StackStep *step, const StackLayer *layer) {
    const int64_t head_dim = model->head_dim, pool_slots = model->num_blocks * model->block_size;
    for (int64_t t = 0; t < step->tokens; t++)
        for (int64_t h = 0; h < model->kv_heads; h++) {
            prefetch_row(layer->k_pool, (h * pool_slots + step->slot[t]) * head_dim, head_dim, 1);
            prefetch_row(layer->v_pool, (h * pool_slots + step->slot[t]) * head_dim, head_dim, 1);
        }
    for (int64_t r = 0; r < step->num_rows; r++)
        for (int64_t h = 0; h < model->kv_heads; h++)
            stack_prefetch_head_keys(layer->k_pool, layer->v_pool, step->tables + r * step->table_width, step->lens[r],
                                     h, head_dim, model->num_blocks, model->block_size, model->window);
}

/* ---- the one-token step in one parallel region ----
 * A step of one token through linears that all have a one-row kernel a thread can run its share of
 * (gemv_bf16_share, the quantised library's quant_gemv_bf16_share) runs in a single parallel region: the threads
 * meet at a spin barrier (team_wait) after each linear, the K/V writes and the attention, six a layer, where the
 * step above opens and joins a libgomp region per linear and per attention (a region's start and join move several
 * cache lines between the cores, a barrier on one line moves it twice). The small work between the linears is done
 * by every thread on its own copies (norms, the residual stream, SiLU*mul) or split between the threads: each writes
 * the new K/V rows of its KV heads (RoPE on K) and attends its even share of the query heads (paged_attention's item
 * h for KV head h restricted to them). Same kernels, same operands, same order within each output: the logits are
 * bitwise the step above's. */

/* A barrier for the threads of one region, on its own line: each arrival counts, and a thread leaves when the
 * count reaches its goal (threads a barrier; never reset, compared modulo 2^32). A waiting thread spins `spins`
 * times (prefetching its next attention's rows, then pausing), then sleeps on the count (a futex) until the last
 * arrival wakes it: with more threads than cores a spinning thread holds the core the one it waits for needs. */
#include <linux/futex.h>
#include <sys/syscall.h>
long syscall(long number, ...); /* unistd.h declares it only outside strict C11 */
/* Pauses before sleeping: far above a step's longest wait, far below a scheduler's time slice;
 * 1000 with more threads than the cores they may run on (as libgomp throttles its own spinning). */
#define TEAM_SPINS 10000
#define TEAM_SPINS_CROWDED 1000
typedef struct {
    _Alignas(128) _Atomic uint32_t arrived;
    _Atomic uint32_t sleepers;
    char line[120];
} TeamBarrier;

/* The key and value rows of the KV heads [head, head_end) at positions [first, end) of one layer's pool, which a
 * thread's next attention reads: the thread prefetches them a row at a time while it waits at a barrier (pos: the
 * next row's position), since the pool is cold at each attention. */
typedef struct {
    const uint16_t *k_pool, *v_pool;
    const int64_t *table;
    int64_t num_blocks, block_size, head_dim, head, head_end, first, pos, end;
} KeyTrickle;

/* The trickle's next row prefetched; 0 when none is left. */
INLINE int trickle_row(KeyTrickle *ahead) {
    if (ahead->head >= ahead->head_end) return 0;
    const int shift = __builtin_ctzll((unsigned long long)ahead->block_size);
    const int64_t row = pool_row(ahead->head * ahead->num_blocks, ahead->table, ahead->pos, shift, ahead->block_size,
                                 ahead->head_dim);
    prefetch_row(ahead->k_pool, row, ahead->head_dim, 1);
    prefetch_row(ahead->v_pool, row, ahead->head_dim, 1);
    if (++ahead->pos >= ahead->end) ahead->pos = ahead->first, ahead->head++;
    return 1;
}

/* `ahead` (NULL: none): rows a waiting thread prefetches, one a spin, instead of pausing. */
INLINE void team_wait(TeamBarrier *barrier, uint32_t *goal, uint32_t threads, int64_t spins, KeyTrickle *ahead) {
    *goal += threads;
    if (atomic_fetch_add(&barrier->arrived, 1) + 1 == *goal) {
        if (atomic_load(&barrier->sleepers) != 0)
            syscall(SYS_futex, &barrier->arrived, FUTEX_WAKE_PRIVATE, INT32_MAX, NULL, NULL, 0);
        return;
    }
    for (int64_t spin = 0; spin < spins; spin++) {
        if ((int32_t)(atomic_load_explicit(&barrier->arrived, memory_order_acquire) - *goal) >= 0) return;
        if (ahead == NULL || !trickle_row(ahead)) _mm_pause();
    }
    /* sleepers counted before the count is read again, the last arrival reading sleepers after its count
     * (both sequentially consistent): either it sees this sleeper and wakes it, or this thread sees its count */
    atomic_fetch_add(&barrier->sleepers, 1);
    for (uint32_t seen; (int32_t)((seen = atomic_load(&barrier->arrived)) - *goal) < 0;)
        syscall(SYS_futex, &barrier->arrived, FUTEX_WAIT_PRIVATE, seen, NULL, NULL, 0);
    atomic_fetch_sub(&barrier->sleepers, 1);
}

/* Whether a linear (each of its parts) has a kernel a thread of the region can run its share of. */
INLINE int team_can_run(const StackLinear *linear) {
    for (const StackLinear *part = linear; part != NULL; part = part->next_part) {
        if (part->kind == STACK_GEMV && part == linear && part->next_part == NULL) continue;
        if (part->kind != STACK_QUANT || part->quant_share == NULL) return 0;
    }
    return 1;
}

/* Whether the step runs in one region: one token in one row, its logits row 0, every linear team_can_run. */
INLINE int team_fits(const StackModel *model, const StackStep *step) {
    if (step->tokens != 1 || step->num_rows != 1 || step->num_logits != 1 || step->logits_rows[0] != 0
        || !team_can_run(model->lm_head))
        return 0;
    for (int64_t l = 0; l < model->num_layers; l++) {
        const StackLayer *layer = model->layers + l;
        if (!team_can_run(layer->qkv) || !team_can_run(layer->o) || !team_can_run(layer->gate_up)
            || !team_can_run(layer->down))
            return 0;
    }
    return 1;
}

/* Thread `me`'s share (of `threads`) of a linear on one row: stack_linear's kernels, each part's rows from its
 * offset; a quantised part then prefetches the thread's share of the next (`next`, next_k inputs, after the last
 * part). 0 where a quantised kernel found no memory for its prepared input. */
INLINE int team_linear(const StackLinear *linear, const uint16_t *x, const uint16_t *bias, uint16_t *y, int64_t k,
                       int me, int threads, const StackLinear *next, int64_t next_k) {
    if (linear->kind == STACK_GEMV) {
        gemv_bf16_share((const uint16_t *)linear->weight, x, bias, y, linear->rows, k, me, threads);
        return 1;
    }
    int ok = 1;
    int64_t offset = 0;
    for (const StackLinear *part = linear; part != NULL; part = part->next_part) {
        const StackLinear *after = part->next_part, *then = after != NULL ? after : next;
        const StackLinear *chained = then != NULL && then->kind == STACK_QUANT ? then : NULL;
        ok &= part->quant_share(part->weight, part->scales, part->zeros, (int)part->bits, x,
                                bias != NULL ? bias + offset : NULL, y + offset, part->rows, k, part->group, me,
                                threads, chained ? chained->weight : NULL, chained ? chained->scales : NULL,
                                chained ? chained->zeros : NULL, chained ? (int)chained->bits : 0,
                                chained ? chained->rows : 0, after != NULL ? k : next_k, chained ? chained->group : 0);
        offset += part->rows;
    }
    return ok;
}

/* What every thread of the one-region step shares. */
typedef struct {
    const StackModel *model;
    const StackStep *step;
    TeamBarrier *barrier;
    int64_t spins, q_size, kv_size, qkv_size, group, own; /* own: each thread's copies, in bf16 values */
    const uint16_t *cos, *sin;                            /* the token's RoPE rows */
    uint16_t *copies;
    int64_t first_tile[2];
    int tiles;
} Team;

/* One thread of it: its copies (residual stream, normed row, SiLU*mul row), the KV heads whose new K/V rows it
 * writes and the query heads [q_from, q_to) it attends, its barrier goal and the rows it prefetches while waiting. */
typedef struct {
    const Team *team;
    int me, threads;
    uint16_t *residual, *normed, *act;
    int64_t kv_from, kv_to, q_from, q_to;
    uint32_t goal;
    KeyTrickle ahead;
    PagedCall call;
    int failed;
} TeamThread;

INLINE void team_thread_init(TeamThread *t, const Team *team) {
    const StackModel *model = team->model;
    const int64_t heads = model->heads, kv_heads = model->kv_heads, group = team->group;
    *t = (TeamThread){0};
    t->team = team, t->me = omp_get_thread_num(), t->threads = omp_get_num_threads();
    t->residual = team->copies + t->me * team->own, t->normed = t->residual + model->hidden;
    t->act = t->normed + model->hidden;
    /* an even split of the query heads; whole query groups on AMX tiles (a tile serves its item's queries together) */
    t->kv_from = kv_heads * t->me / t->threads, t->kv_to = kv_heads * (t->me + 1) / t->threads;
    const int64_t unit = team->tiles ? group : 1, units = heads / unit;
    t->q_from = unit * (units * t->me / t->threads), t->q_to = unit * (units * (t->me + 1) / t->threads);
    const StackStep *step = team->step;
    t->call = (PagedCall){model->buffers->qkv, NULL, NULL, model->buffers->attended, step->tables, step->lens,
                          step->starts, step->qlens, team->first_tile, team->qkv_size, 0, 1, heads, kv_heads,
                          model->head_dim, model->num_blocks, model->block_size, model->window, group,
                          group >= TILE_QUERIES ? 1 : TILE_QUERIES / group, model->scale,
                          __builtin_ctzll((unsigned long long)model->block_size), team->tiles};
}

INLINE void team_sync(TeamThread *t, int trickle) {
    team_wait(t->team->barrier, &t->goal, (uint32_t)t->threads, t->team->spins, trickle ? &t->ahead : NULL);
}

/* The thread's new K/V rows and its query heads' share of the token's attention in `layer`; `next`: the layer
 * after it (NULL: none), whose key rows the thread then prefetches while it waits. */
INLINE void team_attention(TeamThread *t, const StackLayer *layer, const StackLayer *next) {
    const Team *team = t->team;
    const StackModel *model = team->model;
    const int64_t head_dim = model->head_dim, heads = model->heads, group = team->group, qkv_size = team->qkv_size;
    const int64_t slot_row = model->num_blocks * model->block_size, slot = team->step->slot[0];
    uint16_t *qkv = model->buffers->qkv;
    for (int64_t h = t->kv_from; h < t->kv_to; h++) {
        rotary_heads_bf16(qkv, 0, qkv_size, heads + h, heads + h + 1, head_dim, team->cos, team->sin);
        const size_t to = (size_t)((h * slot_row + slot) * head_dim);
        memcpy(layer->k_pool + to, qkv + team->q_size + h * head_dim, (size_t)head_dim * sizeof(uint16_t));
        memcpy(layer->v_pool + to, qkv + team->q_size + team->kv_size + h * head_dim, (size_t)head_dim * sizeof(uint16_t));
    }
    team_sync(t, 1); /* every head's new K/V row in the pool */
    for (int64_t h = t->q_from / group; h * group < t->q_to; h++) { /* item h: tile 0 of row 0, KV head h */
        const int64_t from = (t->q_from > h * group ? t->q_from : h * group) - h * group;
        const int64_t to = (t->q_to < (h + 1) * group ? t->q_to : (h + 1) * group) - h * group;
        rotary_heads_bf16(qkv, 0, qkv_size, h * group + from, h * group + to, head_dim, team->cos, team->sin);
        attend_queries_bf16(&t->call, h, from, to);
    }
    if (next != NULL && t->q_from < t->q_to) { /* the next layer's rows but the one it writes */
        const int64_t len = team->step->lens[0], window = model->window, first = window > 0 && len > window ? len - window : 0;
        t->ahead = (KeyTrickle){next->k_pool, next->v_pool, team->step->tables, model->num_blocks, model->block_size,
                                head_dim, t->q_from / group, first < len - 1 ? (t->q_to - 1) / group + 1 : 0, first,
                                first, len - 1};
    } else t->ahead.head_end = 0;
    team_sync(t, 1);
}

/* One decoder layer on the thread's share; `next`: the layer after it (NULL: the lm_head comes next). */
INLINE void team_layer(TeamThread *t, const StackLayer *layer, const StackLayer *next, int first_layer) {
    const Team *team = t->team;
    const StackModel *model = team->model;
    const StackBuffers *buffers = model->buffers;
    const int64_t hidden = model->hidden, head_dim = model->head_dim, group = team->group;
    const int64_t slot_row = model->num_blocks * model->block_size, slot = team->step->slot[0];
    rms_norm_row_bf16(first_layer ? t->residual : buffers->hidden, first_layer ? NULL : t->residual, layer->input_norm,
                      t->normed, 0, hidden, model->eps);
    t->call.k_pool = layer->k_pool, t->call.v_pool = layer->v_pool;
    for (int64_t h = t->kv_from; h < t->kv_to; h++) { /* the thread's rows: see stack_prefetch_layer */
        prefetch_row(layer->k_pool, (h * slot_row + slot) * head_dim, head_dim, 1);
        prefetch_row(layer->v_pool, (h * slot_row + slot) * head_dim, head_dim, 1);
    }
    for (int64_t h = t->ahead.head_end > 0 ? t->ahead.head : t->q_from / group; h * group < t->q_to; h++) /* not yet */
        stack_prefetch_head_keys(layer->k_pool, layer->v_pool, team->step->tables, team->step->lens[0], h, head_dim,
                                 model->num_blocks, model->block_size, model->window);
    t->failed |= !team_linear(layer->qkv, t->normed, layer->qkv_bias, buffers->qkv, hidden, t->me, t->threads,
                              layer->o, team->q_size);
    team_sync(t, 1);
    team_attention(t, layer, next);
    prefetch_row(layer->post_norm, 0, hidden, 1);
    t->failed |= !team_linear(layer->o, buffers->attended, layer->o_bias, buffers->hidden, team->q_size, t->me,
                              t->threads, layer->gate_up, hidden);
    team_sync(t, 1);
    rms_norm_row_bf16(buffers->hidden, t->residual, layer->post_norm, t->normed, 0, hidden, model->eps);
    t->failed |= !team_linear(layer->gate_up, t->normed, layer->gate_up_bias, buffers->gate_up, hidden, t->me,
                              t->threads, layer->down, model->intermediate);
    team_sync(t, 1);
    silu_and_mul_row_bf16(buffers->gate_up, t->act, 0, model->intermediate);
    prefetch_row(next == NULL ? model->final_norm : next->input_norm, 0, hidden, 1);
    t->failed |= !team_linear(layer->down, t->act, layer->down_bias, buffers->hidden, model->intermediate, t->me,
                              t->threads, next == NULL ? model->lm_head : next->qkv, hidden);
    team_sync(t, 1);
}

/* The final norm and the lm_head on the thread's share, then its slice of the logits in float32 and the slice's
 * argmax (hot in its cache) into picks[me]. */
INLINE void team_logits(TeamThread *t, float *logits, int64_t *picks) {
    const StackModel *model = t->team->model;
    const int64_t vocab = model->vocab;
    uint16_t *rounded = model->buffers->logits;
    rms_norm_row_bf16(model->buffers->hidden, t->residual, model->final_norm, t->normed, 0, model->hidden, model->eps);
    t->failed |= !team_linear(model->lm_head, t->normed, NULL, rounded, model->hidden, t->me, t->threads, NULL, 0);
    team_sync(t, 0);
    const int64_t from = vocab * t->me / t->threads, to = vocab * (t->me + 1) / t->threads;
    for (int64_t i = from; i < to; i++) { /* bf16 -> float32: exact */
        const uint32_t bits = (uint32_t)rounded[i] << 16;
        memcpy(logits + i, &bits, sizeof(bits));
    }
    if (to > from) picks[t->me] = from + argmax_row(logits + from, to - from);
}

/* The slices' argmaxes combined in thread order: the first maximum, or the first NaN (a NaN stays; else a later
 * slice's only where greater). */
INLINE int64_t team_argmax(const float *logits, const int64_t *picks, int slots) {
    int64_t best = -1;
    for (int t = 0; t < slots; t++) {
        const int64_t pick = picks[t];
        if (pick >= 0 && (best < 0 || (!isnan(logits[best]) && (isnan(logits[pick]) || logits[pick] > logits[best]))))
            best = pick;
    }
    return best;
}

/* decode_stack_bf16 for one token in one row, its logits row 0 (team_fits), and that row's argmax into argmax[0].
 * Returns 0 where the threads' copies or a linear's prepared input found no memory. */
static int decode_team(const StackModel *model, const StackStep *step, float *logits, int64_t *argmax,
                       int num_threads) {
    const int64_t half = model->head_dim / 2, position = step->position[0];
    const int slots = num_threads < 1 ? 1 : num_threads; /* threads the region may have */
    TeamBarrier barrier = {0};
    Team team = {model, step, &barrier, num_threads > omp_get_num_procs() ? TEAM_SPINS_CROWDED : TEAM_SPINS,
                 model->heads * model->head_dim, model->kv_heads * model->head_dim, 0, model->heads / model->kv_heads,
                 (2 * model->hidden + model->intermediate + 31) / 32 * 32, model->cos_table + position * half,
                 model->sin_table + position * half, NULL, {0, 1}, attention_tiles_available()};
    team.qkv_size = team.q_size + 2 * team.kv_size;
    team.copies = aligned_alloc(64, sizeof(uint16_t) * (size_t)(team.own * slots)); /* 64-byte aligned rows */
    if (team.copies == NULL) return 0;
    int64_t picks[slots]; /* each thread's slice's argmax, -1: none */
    for (int t = 0; t < slots; t++) picks[t] = -1;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        TeamThread t;
        team_thread_init(&t, &team);
        if (team.tiles) attention_tiles_load();
        memcpy(t.residual, model->embedding + step->token[0] * model->hidden, (size_t)model->hidden * sizeof(uint16_t));
        for (int64_t l = 0; l < model->num_layers; l++)
            team_layer(&t, model->layers + l, l + 1 < model->num_layers ? model->layers + l + 1 : NULL, l == 0);
        team_logits(&t, logits, picks);
        failed |= t.failed;
    }
    free(team.copies);
    argmax[0] = team_argmax(logits, picks, slots);
    return !failed;
}

/* ---- the step over several tokens (or linears without a per-thread share): a parallel region per op ---- */

/* The first layer's residual stream is the embedding itself; each token's RoPE rows. */
INLINE void stack_tokens_in(const StackModel *model, const StackStep *step) {
    const int64_t hidden = model->hidden, half = model->head_dim / 2;
    const size_t row_bytes = (size_t)hidden * sizeof(uint16_t), half_bytes = (size_t)half * sizeof(uint16_t);
    const StackBuffers *b = model->buffers;
    for (int64_t t = 0; t < step->tokens; t++) {
        memcpy(b->residual + t * hidden, model->embedding + step->token[t] * hidden, row_bytes);
        memcpy(b->cos + t * half, model->cos_table + step->position[t] * half, half_bytes);
        memcpy(b->sin + t * half, model->sin_table + step->position[t] * half, half_bytes);
    }
}

/* One decoder layer for all the step's tokens; `next`: the layer after it (NULL: the lm_head). 0: no memory. */
INLINE int stack_layer(const StackModel *model, const StackStep *step, const StackLayer *layer,
                       const StackLayer *next, int first_layer, int threads) {
    const StackBuffers *b = model->buffers;
    const int64_t tokens = step->tokens, hidden = model->hidden, heads = model->heads, kv_heads = model->kv_heads;
    const int64_t head_dim = model->head_dim, intermediate = model->intermediate, q_size = heads * head_dim;
    const int64_t kv_size = kv_heads * head_dim, qkv_size = q_size + 2 * kv_size;
    rms_norm_bf16(first_layer ? b->residual : b->hidden, first_layer ? NULL : b->residual, layer->input_norm,
                  b->normed, tokens, hidden, model->eps, threads);
    stack_prefetch_layer(model, step, layer);
    if (!stack_linear(layer->qkv, b->normed, layer->qkv_bias, b->qkv, tokens, qkv_size, hidden, threads, layer->o,
                      q_size))
        return 0;
    rotary_bf16(b->qkv, tokens, qkv_size, heads + kv_heads, head_dim, b->cos, b->sin, threads);
    write_kv_bf16(b->qkv + q_size, qkv_size, b->qkv + q_size + kv_size, qkv_size, layer->k_pool, layer->v_pool,
                  step->slot, tokens, kv_heads, head_dim, model->num_blocks * model->block_size, threads);
    paged_attention_bf16(b->qkv, qkv_size, layer->k_pool, layer->v_pool, step->tables, step->table_width, step->lens,
                         step->starts, step->qlens, b->attended, step->num_rows, heads, kv_heads, head_dim,
                         model->num_blocks, model->block_size, model->scale, model->window, threads);
    prefetch_row(layer->post_norm, 0, hidden, 1);
    if (!stack_linear(layer->o, b->attended, layer->o_bias, b->hidden, tokens, hidden, q_size, threads, layer->gate_up,
                      hidden))
        return 0;
    rms_norm_bf16(b->hidden, b->residual, layer->post_norm, b->normed, tokens, hidden, model->eps, threads);
    if (!stack_linear(layer->gate_up, b->normed, layer->gate_up_bias, b->gate_up, tokens, 2 * intermediate, hidden,
                      threads, layer->down, intermediate))
        return 0;
    silu_and_mul_bf16(b->gate_up, b->act, tokens, intermediate, threads);
    prefetch_row(next != NULL ? next->input_norm : model->final_norm, 0, hidden, 1);
    return stack_linear(layer->down, b->act, layer->down_bias, b->hidden, tokens, hidden, intermediate, threads,
                        next != NULL ? next->qkv : model->lm_head, hidden);
}

/* The logits rows only (as the forward takes hidden[logits_indices] and residual[logits_indices]): the final norm,
 * the lm_head, and its bf16 outputs as float32 (exact: the bits move up 16). 0: no memory. */
INLINE int stack_logits(const StackModel *model, const StackStep *step, float *logits, int threads) {
    const StackBuffers *b = model->buffers;
    const int64_t hidden = model->hidden, vocab = model->vocab, num_logits = step->num_logits;
    const size_t row_bytes = (size_t)hidden * sizeof(uint16_t);
    for (int64_t i = 0; i < num_logits; i++) {
        memcpy(b->last_x + i * hidden, b->hidden + step->logits_rows[i] * hidden, row_bytes);
        memcpy(b->last_residual + i * hidden, b->residual + step->logits_rows[i] * hidden, row_bytes);
    }
    rms_norm_bf16(b->last_x, b->last_residual, model->final_norm, b->normed, num_logits, hidden, model->eps, threads);
    if (!stack_linear(model->lm_head, b->normed, NULL, b->logits, num_logits, vocab, hidden, threads, NULL, 0))
        return 0;
    for (int64_t i = 0; i < num_logits * vocab; i++) {
        const uint32_t bits = (uint32_t)b->logits[i] << 16;
        memcpy(logits + i, &bits, sizeof(bits));
    }
    return 1;
}

/* Returns 1 (0: out of memory in a linear's kernel, nothing to retry here); writes float32 logits
 * [num_logits, vocab] for the step's tokens `logits_rows`, and into `argmax` [num_logits] each row's argmax where
 * the one-region step found it on the way (-1 where not: the caller finds it if it needs it). */
int decode_stack_bf16(const StackModel *model, const StackStep *step, float *logits, int64_t *argmax,
                      int num_threads) {
    if (team_fits(model, step)) return decode_team(model, step, logits, argmax, num_threads);
    for (int64_t r = 0; r < step->num_logits; r++) argmax[r] = -1;
    stack_tokens_in(model, step);
    for (int64_t l = 0; l < model->num_layers; l++)
        if (!stack_layer(model, step, model->layers + l, l + 1 < model->num_layers ? model->layers + l + 1 : NULL,
                         l == 0, num_threads))
            return 0;
    return stack_logits(model, step, logits, num_threads);
}
#else
int decode_stack_bf16(const StackModel *model, const StackStep *step, float *logits, int64_t *argmax,
                      int num_threads) {
    (void)model, (void)step, (void)logits, (void)argmax, (void)num_threads;
    return 0; /* no AVX512-BF16: the model's Python forward runs */
}
#endif

#else
int kernel_vector_bits(void) { return 0; }
#endif
