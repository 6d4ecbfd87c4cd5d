/* bf16 linears: the one-row GEMV (gemv_bf16) and the AMX GEMM on pack_amx's tiles (gemm_amx_bf16, amx_enable). */
#include "cpu_internal.h"

#if HAVE_AVX512
/* y = W x (+ bias) for one bfloat16 row x [K] and W [N, K] row-major, in one pass over W (the batch-1 decode step
 * is these GEMVs). Each thread reads its contiguous share of W row after row, one sequential stream (x stays in
 * L1; interleaved row streams ran slower when the host's memory was contended), with products of bf16 pairs in four
 * float32 accumulators (dpbf16) and the stream prefetched GEMV_AHEAD elements (8 KiB) ahead at the rate it is read.
 * The prefetch is non-temporal, as the quantised streams' are: the weights are read once a token, and lines fetched
 * into L1 and L2 would reach L3 on eviction and push the KV pool out of it. */
#if defined(__AVX512BF16__)
#define GEMV_AHEAD 4096
/* `end`: where the thread's rows end; its stream prefetches no further (past it the lines were the other thread's,
 * already read and not kept in L3, or another tensor's). */
INLINE float gemv_row(const uint16_t *row, const uint16_t *vector, int64_t k, const uint16_t *end) {
    __m512 acc0 = _mm512_setzero_ps(), acc1 = acc0, acc2 = acc0, acc3 = acc0;
    int64_t c = 0;
    for (; c + 128 <= k; c += 128) {
        for (int line = 0; line < 4; line++)
            if (row + c + GEMV_AHEAD + 32 * line < end)
                _mm_prefetch((const char *)(row + c + GEMV_AHEAD + 32 * line), _MM_HINT_NTA);
        acc0 = _mm512_dpbf16_ps(acc0, (__m512bh)_mm512_loadu_epi16(row + c), (__m512bh)_mm512_loadu_epi16(vector + c));
        acc1 = _mm512_dpbf16_ps(acc1, (__m512bh)_mm512_loadu_epi16(row + c + 32),
                                (__m512bh)_mm512_loadu_epi16(vector + c + 32));
        acc2 = _mm512_dpbf16_ps(acc2, (__m512bh)_mm512_loadu_epi16(row + c + 64),
                                (__m512bh)_mm512_loadu_epi16(vector + c + 64));
        acc3 = _mm512_dpbf16_ps(acc3, (__m512bh)_mm512_loadu_epi16(row + c + 96),
                                (__m512bh)_mm512_loadu_epi16(vector + c + 96));
    }
    for (; c < k; c += 32) {
        if (row + c + GEMV_AHEAD < end) _mm_prefetch((const char *)(row + c + GEMV_AHEAD), _MM_HINT_NTA);
        const __mmask32 live = k - c >= 32 ? 0xffffffffu : (__mmask32)((1ull << (k - c)) - 1);
        acc0 = _mm512_dpbf16_ps(acc0, (__m512bh)_mm512_maskz_loadu_epi16(live, row + c),
                                (__m512bh)_mm512_maskz_loadu_epi16(live, vector + c));
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc0, acc1), _mm512_add_ps(acc2, acc3)));
}

/* Thread `me`'s rows of gemv_bf16 (of `threads`): each row is its own output. */
INLINE void gemv_share(const uint16_t *weight, const uint16_t *vector, const void *bias, void *y, int64_t n,
                       int64_t k, int64_t me, int64_t threads) {
    const int64_t first = n * me / threads, last = n * (me + 1) / threads;
    for (int64_t r = first; r < last; r++) {
        float value = gemv_row(weight + r * k, vector, k, weight + last * k);
        if (bias != NULL) value += _mm512_cvtss_f32(load16m(bias, r, 1, 1));
        store16m(y, r, _mm512_set1_ps(value), 1, 1);
    }
}

HIDDEN void gemv_bf16_share(const uint16_t *weight, const uint16_t *vector, const void *bias, void *y, int64_t n,
                            int64_t k, int64_t me, int64_t threads) {
    gemv_share(weight, vector, bias, y, n, k, me, threads);
}

int gemv_bf16(const void *w, const void *x, const void *bias, void *y, int64_t n, int64_t k, int num_threads) {
#pragma omp parallel num_threads(num_threads)
    gemv_share((const uint16_t *)w, (const uint16_t *)x, bias, y, n, k, omp_get_thread_num(), omp_get_num_threads());
    return 1;
}
#else
int gemv_bf16(const void *w, const void *x, const void *bias, void *y, int64_t n, int64_t k, int num_threads) {
    (void)w, (void)x, (void)bias, (void)y, (void)n, (void)k, (void)num_threads;
    return 0; /* no AVX512-BF16: the caller keeps torch.mv */
}
#endif
/* y = x W^T (+ bias) on AMX (Sapphire Rapids and later) from a weight packed by kernels/cpu.py's
 * `pack_amx`: N padded to 64 and K to 32, tiles [N / 32][K / 32][2][16 pairs][16 outputs][2] (a 16 x 16
 * B tile of bf16 pairs, 1 KiB, for each 16 outputs x 32 inputs; a 32-output pair's two side by side, each
 * pair's K steps one contiguous stream: strided 4 KiB steps defeat the prefetcher). On the GEMV above each row
 * of M costs a whole pass of compute; on tiles a few rows cost what one does. One work item is 16 rows of x (one
 * A tile) against a 64-output group (four C tiles), K in order; tiles 0-3 accumulate, 4 holds A, 6-7 B.
 *
 * Each output element is its C tile element, fed K in 32-wide steps in order from zero, then the bias
 * added in float32 and one rounding to bf16: it depends on its own row of x and column of W only, so any
 * row of an M-row call is bitwise that row's one-row call (verify rows equal one-token decodes, and a
 * decode row's value does not depend on what else shares the batch). */
#if HAVE_AMX_BF16

int amx_enable(void) { return amx_request_tiles(); }

/* C tile `tile` (rows x 16 float32) + bias, rounded, into y's rows [row0, row0 + rows) at column col0. */
#define STORE_C(tile, j)                                                                                      \
    do {                                                                                                      \
        _tile_stored(tile, scratch, 64);                                                                      \
        store_tile(scratch, bias, y, row0, rows, col0 + 16 * (j), n);                                         \
    } while (0)

INLINE void store_tile(const float *scratch, const void *bias, void *y, int64_t row0, int rows, int64_t col0, int64_t n) {
    if (col0 >= n) return;
    const __mmask16 live = tail_mask(n - col0);
    const __m512 b = bias != NULL ? load16m(bias, col0, live, 1) : _mm512_setzero_ps();
    for (int r = 0; r < rows; r++) {
        __m512 value = _mm512_load_ps(scratch + 16 * r);
        if (bias != NULL) value = _mm512_add_ps(value, b);
        store16m(y, (row0 + r) * n + col0, value, live, 1);
    }
}

/* Up to 16 rows: one A tile of m rows against a 64-output group's four B tiles per step. The weight
 * streams from DRAM here (decode): its tiles two steps ahead are prefetched (4 or 8 steps did no better). */
#define AMX_PREFETCH_STEPS 2
INLINE void amx_few_rows(const uint16_t *a, const uint16_t *w, const void *bias, void *y, int64_t m, int64_t n,
                         int64_t kp, int num_threads) {
    const int64_t steps = kp / 32, groups = (n + 63) / 64;
    TileConfig config = {0};
    tile_shape(&config, 0, 5, (int)m, 64); /* C 0-3, A 4 */
    tile_shape(&config, 6, 2, 16, 64);     /* B 6-7 */
    const int64_t row0 = 0;
    const int rows = (int)m;
#pragma omp parallel num_threads(num_threads)
    {
        _tile_loadconfig(&config);
        float scratch[16 * 16] __attribute__((aligned(64)));
#pragma omp for schedule(static)
        for (int64_t group = 0; group < groups; group++) {
            const int64_t col0 = group * 64;
            const uint16_t *low = w + 2 * group * steps * 1024, *high = low + steps * 1024; /* its two pairs */
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            for (int64_t s = 0; s < steps; s++) {
                if (s + AMX_PREFETCH_STEPS < steps)
                    for (int line = 0; line < 1024; line += 32) {
                        _mm_prefetch((const char *)(low + (s + AMX_PREFETCH_STEPS) * 1024 + line), _MM_HINT_T0);
                        _mm_prefetch((const char *)(high + (s + AMX_PREFETCH_STEPS) * 1024 + line), _MM_HINT_T0);
                    }
                _tile_loadd(4, a + s * 32, kp * 2);
                _tile_loadd(6, low + s * 1024, 64);
                _tile_loadd(7, low + s * 1024 + 512, 64);
                _tile_dpbf16ps(0, 4, 6);
                _tile_dpbf16ps(1, 4, 7);
                _tile_loadd(6, high + s * 1024, 64);
                _tile_loadd(7, high + s * 1024 + 512, 64);
                _tile_dpbf16ps(2, 4, 6);
                _tile_dpbf16ps(3, 4, 7);
            }
            STORE_C(0, 0);
            STORE_C(1, 1);
            STORE_C(2, 2);
            STORE_C(3, 3);
        }
        _tile_release();
    }
}

/* More rows: items of 32 rows (two A tiles, 4-5) x 32 outputs (a pair of B tiles, 6-7), C[i][j] in tile
 * 2i + j; a pass's last row tile, when its row tiles are odd, makes an item of one A tile (C 0-1), so rows
 * are padded to 16, not 32. Rows go in passes of AMX_PASS (one pass over all rows left L2); a pass's items by
 * blocks of AMX_COLS outputs, then chunks of AMX_ROWS
 * rows: a block's weight (1.2 MB at K = 576) and a chunk's rows stay in L2. Inside a chunk:
 * - pair-major (a pair's row pairs in turn: its B tiles in L1 across them) up to one chunk of rows (decode
 *   batches: the weight streams from DRAM once, on each pair's first row pair, prefetched two K steps ahead
 *   as for few rows; on its later row pairs the next pair's tiles go to L2, so DRAM keeps streaming while
 *   the pair's B tiles are re-read from L1), and where a row pair's A tiles do not fit L1 (K > AMX_ROW_MAJOR_K);
 * - row-major (the block's pairs in turn against one row pair, its A tiles in L1, B streaming from L2 with
 *   the same prefetch) for more rows at K <= AMX_ROW_MAJOR_K.
 * The epilogue (C + bias, rounded, to y) waits for the item's dot products if it runs after them: row-major,
 * an item's C tiles go to `scratch` and are written out a few rows per K step while the next item's dot
 * products run (not pair-major: its consecutive items write other rows of y).
 * Threads take chunks of items from a shared counter (one parallel region for all passes, no barrier between
 * them), each chunk a whole number of pairs (pair-major) or rows (row-major) where the sizes allow, so a
 * thread descheduled on a shared host does not hold the others up at a barrier.
 * Each output is still its C tile element, K in order from zero, plus the bias, rounded once. */
#define AMX_ROWS 256
#define AMX_COLS 1024
#define AMX_ROW_MAJOR_K 640
#define AMX_PASS 512

typedef struct {
    int64_t row0, col0; /* the item's first row of y and its first column; row0 < 0: nothing pending */
    int rows;           /* its live rows (up to 32: a tile's padding rows are not stored) */
    int next;           /* the next scratch row to write out: 0-15 from C 0|1, 16-31 from C 2|3 */
} amx_pending;

/* Scratch row `u` of the pending item (C[u / 16][0] | C[u / 16][1], their row u % 16) + bias to y. */
INLINE void amx_write_row(const float *scratch, const void *bias, void *y, const amx_pending *p, int u, int64_t n) {
    const float *c = scratch + (u / 16) * 512 + (u % 16) * 16; /* C tiles 2i and 2i + 1 lie 256 floats apart */
    for (int j = 0; j < 2; j++) {
        const int64_t col = p->col0 + 16 * j;
        if (col >= n) return;
        const __mmask16 live = tail_mask(n - col);
        __m512 value = _mm512_load_ps(c + 256 * j);
        if (bias != NULL) value = _mm512_add_ps(value, load16m(bias, col, live, 1));
        store16m(y, (p->row0 + u) * n + col, value, live, 1);
    }
}

INLINE void amx_write_rows(const float *scratch, const void *bias, void *y, amx_pending *p, int count, int64_t n) {
    for (; count > 0 && p->next < p->rows; count--, p->next++) amx_write_row(scratch, bias, y, p, p->next, n);
}

/* One item: rows [32 row_pair, + 32) of the pass at `a` (one A tile if `both` is 0) x outputs [32 pair, + 32),
 * its C tiles left in scratch as `pending`; the previous item's rows written out on the way (`write`). */
INLINE void amx_item(const uint16_t *a, const uint16_t *w, const void *bias, void *y, float *scratch,
                     amx_pending *pending, int64_t pass_row0, int64_t m, int64_t n, int64_t kp, int64_t pair,
                     int64_t row_pair, int both, int stream, int write) {
    const int64_t steps = kp / 32;
    const int per_step = (int)((32 + steps - 1) / steps); /* scratch rows written out per K step */
    const uint16_t *tiles = w + pair * steps * 1024;
    const uint16_t *a0 = a + row_pair * 32 * kp, *a1 = a0 + 16 * kp;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t s = 0; s < steps; s++) {
        const uint16_t *b = tiles + s * 1024;
        if (stream) /* two steps ahead, into the next pair's at the end (pairs lie back to back) */
            for (int line = 0; line < 1024; line += 32)
                _mm_prefetch((const char *)(b + AMX_PREFETCH_STEPS * 1024 + line), _MM_HINT_T0);
        else if (!write) /* pair-major, a later row pair: the next pair's step into L2, DRAM streaming on */
            for (int line = 0; line < 1024; line += 32)
                _mm_prefetch((const char *)(b + steps * 1024 + line), _MM_HINT_T1);
        tile_step_32x32(a0 + s * 32, a1 + s * 32, b, kp * 2, both);
        if (write) amx_write_rows(scratch, bias, y, pending, per_step, n);
    }
    amx_write_rows(scratch, bias, y, pending, 32, n);
    _tile_stored(0, scratch, 64);
    _tile_stored(1, scratch + 256, 64);
    if (both) {
        _tile_stored(2, scratch + 512, 64);
        _tile_stored(3, scratch + 768, 64);
    }
    pending->row0 = pass_row0 + row_pair * 32;
    pending->col0 = pair * 32;
    pending->rows = (int)(m - pending->row0 < 32 ? m - pending->row0 : 32);
    pending->next = 0;
}

static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

INLINE void amx_many_rows(const uint16_t *a, const uint16_t *w, const void *bias, void *y, int64_t m, int64_t n,
                          int64_t kp, int num_threads) {
    const int64_t pairs = (n + 63) / 64 * 2, block_pairs = AMX_COLS / 32, chunk_pairs = AMX_ROWS / 32;
    const int64_t passes = (m + AMX_PASS - 1) / AMX_PASS;
    TileConfig config = {0};
    tile_shape(&config, 0, 8, 16, 64);
#pragma omp parallel num_threads(num_threads)
    {
        _tile_loadconfig(&config);
        float scratch[4 * 256] __attribute__((aligned(64)));
        amx_pending pending = {-1, 0, 0, 0};
        const int64_t threads = omp_get_num_threads();
        for (int64_t pass = 0; pass < passes; pass++) {
            const int64_t row0 = pass * AMX_PASS, rows = min64(m - row0, AMX_PASS);
            const int64_t row_tiles = (rows + 15) / 16, row_pairs = (row_tiles + 1) / 2, items = pairs * row_pairs;
            const int row_major = kp <= AMX_ROW_MAJOR_K && row_pairs > chunk_pairs;
            /* chunks of whole pairs or rows (of the first block and chunk), about 4 a thread */
            const int64_t unit = row_major ? min64(pairs, block_pairs) : min64(row_pairs, chunk_pairs);
            const int64_t grab = unit * ((items / unit + 4 * threads - 1) / (4 * threads));
            const uint16_t *pass_a = a + row0 * kp;
#pragma omp for schedule(dynamic, grab) nowait
            for (int64_t item = 0; item < items; item++) {
                /* item = (block, chunk in it, then pair and row pair in it): the last block and chunk may be short */
                const int64_t block = item / (block_pairs * row_pairs), in_block = item % (block_pairs * row_pairs);
                const int64_t pairs_here = min64(pairs - block * block_pairs, block_pairs);
                const int64_t chunk = in_block / (pairs_here * chunk_pairs), in_chunk = in_block % (pairs_here * chunk_pairs);
                const int64_t rows_here = min64(row_pairs - chunk * chunk_pairs, chunk_pairs);
                const int64_t pair = block * block_pairs + (row_major ? in_chunk % pairs_here : in_chunk / rows_here);
                const int64_t row_pair = chunk * chunk_pairs + (row_major ? in_chunk / pairs_here : in_chunk % rows_here);
                /* the weight streams on every item row-major, on a pair's first row pair pair-major */
                const int stream = row_major || in_chunk % rows_here == 0;
                amx_item(pass_a, w, bias, y, scratch, &pending, row0, m, n, kp, pair, row_pair,
                         2 * row_pair + 1 < row_tiles, stream, row_major);
            }
        }
        amx_write_rows(scratch, bias, y, &pending, 32, n);
        _tile_release();
    }
}

int gemm_amx_bf16(const void *packed, const void *x, const void *bias, void *y, int64_t m, int64_t n, int64_t k,
                  int num_threads) {
    const int64_t kp = (k + 31) / 32 * 32;
    /* A tiles read x in place when its rows are whole 32-wide steps and its row count fills whole tiles
     * (up to 16 rows: one tile of m rows); otherwise from a zero-padded copy */
    const int64_t mp = m <= 16 ? m : (m + 15) / 16 * 16;
    const uint16_t *a = (const uint16_t *)x;
    uint16_t *padded = NULL;
    if (kp != k || mp != m) {
        padded = calloc((size_t)(mp * kp), sizeof(uint16_t));
        if (padded == NULL) return 0;
        for (int64_t r = 0; r < m; r++) memcpy(padded + r * kp, a + r * k, (size_t)k * sizeof(uint16_t));
        a = padded;
    }
    if (m <= 16)
        amx_few_rows(a, (const uint16_t *)packed, bias, y, m, n, kp, num_threads);
    else
        amx_many_rows(a, (const uint16_t *)packed, bias, y, m, n, kp, num_threads);
    free(padded);
    return 1;
}
#else
int amx_enable(void) { return 0; }
int gemm_amx_bf16(const void *packed, const void *x, const void *bias, void *y, int64_t m, int64_t n, int64_t k,
                  int num_threads) {
    (void)packed, (void)x, (void)bias, (void)y, (void)m, (void)n, (void)k, (void)num_threads;
    return 0;
}
#endif
#endif
