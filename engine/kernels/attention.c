/* Paged attention straight from the KV pool (paged_attention_bf16/_f32): a vector path (float32 scores, softmax
 * and FMA V sums) and, for bf16 where the process holds the AMX tile state, a tile path. */
#include "cpu_internal.h"

#if HAVE_AVX512
/* s[t] <- e^(s[t] * scale - max s * scale) for t < n (scale > 0; 1: the scores as they are); returns their
 * sum. The tail is padded with -inf lanes. */
INLINE float softmax_numerators(float *s, int64_t n, float scale) {
    const __m512 factor = _mm512_set1_ps(scale);
    __m512 top = _mm512_set1_ps(-INFINITY);
    for (int64_t t = 0; t < n; t += 16) {
        const __mmask16 live = tail_mask(n - t);
        top = _mm512_max_ps(top, _mm512_mul_ps(_mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), live, s + t), factor));
    }
    const __m512 shift = _mm512_set1_ps(_mm512_reduce_max_ps(top));
    __m512 total = _mm512_setzero_ps();
    for (int64_t t = 0; t < n; t += 16) {
        const __mmask16 live = tail_mask(n - t);
        const __m512 e = exp_clamped(_mm512_sub_ps(_mm512_mul_ps(_mm512_maskz_loadu_ps(live, s + t), factor), shift));
        _mm512_mask_storeu_ps(s + t, live, e);
        total = _mm512_add_ps(total, _mm512_maskz_mov_ps(live, e));
    }
    return _mm512_reduce_add_ps(total);
}

/* out[k] lane i <- in[i] lane k: a 16 x 16 transpose of 32-bit elements in place. */
INLINE void transpose16(__m512i *r) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 4) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
        t[i + 2] = _mm512_unpacklo_epi32(r[i + 2], r[i + 3]);
        t[i + 3] = _mm512_unpackhi_epi32(r[i + 2], r[i + 3]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int h = 0; h < 16; h += 8)
        for (int i = 0; i < 4; i++) {
            t[h + i] = _mm512_shuffle_i32x4(r[h + i], r[h + 4 + i], 0x88);
            t[h + 4 + i] = _mm512_shuffle_i32x4(r[h + i], r[h + 4 + i], 0xdd);
        }
    for (int i = 0; i < 8; i++) {
        r[i] = _mm512_shuffle_i32x4(t[i], t[8 + i], 0x88);
        r[8 + i] = _mm512_shuffle_i32x4(t[i], t[8 + i], 0xdd);
    }
}

/* Sixteen float32 sums, lane i holding _mm512_reduce_add_ps(a[i]) exactly: the same pairs added in the
 * same order (upper 256 bits + lower, then upper 128 + lower, then elements two apart, then neighbours),
 * sixteen reductions interleaved so the adds fill whole vectors (a reduction per key cost more than the
 * dot products themselves). */
INLINE __m512 reduce_add16(const __m512 *a) {
    __m512 s[8], u[4], w[2];
    for (int m = 0; m < 8; m++) /* lanes 0-7: key 2m's halves summed, 8-15: key 2m+1's */
        s[m] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * m], a[2 * m + 1], 0xEE), _mm512_shuffle_f32x4(a[2 * m], a[2 * m + 1], 0x44));
    for (int p = 0; p < 4; p++) /* 128-bit lane L: key 4p + L's quarters summed */
        u[p] = _mm512_add_ps(_mm512_shuffle_f32x4(s[2 * p], s[2 * p + 1], 0xDD), _mm512_shuffle_f32x4(s[2 * p], s[2 * p + 1], 0x88));
    for (int r = 0; r < 2; r++) /* lane L: [key 8r + L: e0 + e2, e1 + e3, key 8r + 4 + L: the same] */
        w[r] = _mm512_add_ps(_mm512_shuffle_ps(u[2 * r], u[2 * r + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(u[2 * r], u[2 * r + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    /* element 4L + e: key 4e + L; put key k at element k */
    const __m512 z = _mm512_add_ps(_mm512_shuffle_ps(w[0], w[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_ps(w[0], w[1], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), z);
}

/* dst[i] <- (q . key i) * scale for the sixteen key rows at `rows` (lanes `live` stored). Each key's
 * accumulator adds its head_dim chunks in ascending order; the sixteen keys advance together, so the
 * accumulators stay in registers and their chains overlap (one key at a time waits on each dot product). */
INLINE void score_block(const void *q, int64_t q_offset, const void *k_pool, const int64_t *rows, int64_t head_dim,
                        float scale, float *dst, __mmask16 live, const int bf16) {
    __m512 acc[16];
    for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps();
#if defined(__AVX512BF16__)
    if (bf16) { /* bf16 pair products summed in float32, without widening the key row */
        const uint16_t *qg = (const uint16_t *)q + q_offset, *k = (const uint16_t *)k_pool;
        int64_t d = 0;
        for (; d + 32 <= head_dim; d += 32) {
            const __m512bh qv = (__m512bh)_mm512_loadu_si512(qg + d);
            for (int i = 0; i < 16; i++)
                acc[i] = _mm512_dpbf16_ps(acc[i], qv, (__m512bh)_mm512_loadu_si512(k + rows[i] + d));
        }
        if (d < head_dim) { /* the last 16 of a head_dim = 16 (mod 32): zero pairs add +0 */
            const __m512bh qv = (__m512bh)_mm512_maskz_loadu_epi16(0xffff, qg + d);
            for (int i = 0; i < 16; i++)
                acc[i] = _mm512_dpbf16_ps(acc[i], qv, (__m512bh)_mm512_maskz_loadu_epi16(0xffff, k + rows[i] + d));
        }
        _mm512_mask_storeu_ps(dst, live, _mm512_mul_ps(reduce_add16(acc), _mm512_set1_ps(scale)));
        return;
    }
#endif
    for (int64_t d = 0; d < head_dim; d += 16) {
        const __m512 qv = load16(q, q_offset + d, bf16);
        for (int i = 0; i < 16; i++) acc[i] = _mm512_fmadd_ps(qv, load16(k_pool, rows[i] + d, bf16), acc[i]);
    }
    _mm512_mask_storeu_ps(dst, live, _mm512_mul_ps(reduce_add16(acc), _mm512_set1_ps(scale)));
}

#define V_QUERIES 8 /* queries whose 32-column output slices stay in registers: 24 of the 32 */

/* acc[c] += p_c[t] * V[t][d .. d + 32) for t in [from, to), each query c only over its keys [lo[c], hi[c])
 * (`masked`; else all of them see every key): in ascending t, one fused multiply-add per key, whichever
 * other queries share the pass. `upper` is 0 where the row ends at d + 16 (head_dim = 16 mod 32). */
INLINE void weigh_values(__m512 *acc, const void *v_pool, const int64_t *rows, int64_t d, __mmask16 upper,
                         const float *const *p, const int64_t *lo, const int64_t *hi, int64_t from, int64_t to,
                         const int count, const int masked, const int bf16) {
    for (int64_t t = from; t < to; t++) {
        const __m512 v0 = load16(v_pool, rows[t] + d, bf16), v1 = load16m(v_pool, rows[t] + d + 16, upper, bf16);
        for (int c = 0; c < count; c++) {
            const __m512 weight = _mm512_set1_ps(p[c][t]);
            const __mmask16 live = !masked || (t >= lo[c] && t < hi[c]) ? 0xffff : 0;
            acc[2 * c] = _mm512_mask3_fmadd_ps(weight, v0, acc[2 * c], live);
            acc[2 * c + 1] = _mm512_mask3_fmadd_ps(weight, v1, acc[2 * c + 1], live);
        }
    }
}

/* The weighted V sums of `count` queries (their score rows p[c], key ranges [lo[c], hi[c])), stored
 * divided by their softmax sums at out_offsets[c]: 32 output columns at a time, the keys every query
 * sees in a pass without masks. */
INLINE void attend_values(const void *v_pool, const int64_t *rows, int64_t head_dim, const float *const *p,
                          const int64_t *lo, const int64_t *hi, const float *inverse, void *out,
                          const int64_t *out_offsets, const int count, const int bf16) {
    int64_t first = lo[0], last = hi[0], common_from = lo[0], common_to = hi[0];
    for (int c = 1; c < count; c++) {
        first = lo[c] < first ? lo[c] : first, last = hi[c] > last ? hi[c] : last;
        common_from = lo[c] > common_from ? lo[c] : common_from, common_to = hi[c] < common_to ? hi[c] : common_to;
    }
    if (common_to < common_from) common_to = common_from = last;
    for (int64_t d = 0; d < head_dim; d += 32) {
        const __mmask16 upper = d + 32 <= head_dim ? 0xffff : 0;
        __m512 acc[2 * V_QUERIES];
        for (int c = 0; c < 2 * count; c++) acc[c] = _mm512_setzero_ps();
        weigh_values(acc, v_pool, rows, d, upper, p, lo, hi, first, common_from, count, 1, bf16);
        weigh_values(acc, v_pool, rows, d, upper, p, lo, hi, common_from, common_to, count, 0, bf16);
        weigh_values(acc, v_pool, rows, d, upper, p, lo, hi, common_to, last, count, 1, bf16);
        for (int c = 0; c < count; c++) {
            const __m512 scale = _mm512_set1_ps(inverse[c]);
            store16(out, out_offsets[c] + d, _mm512_mul_ps(acc[2 * c], scale), bf16);
            store16m(out, out_offsets[c] + d + 16, _mm512_mul_ps(acc[2 * c + 1], scale), upper, bf16);
        }
    }
}

/* attend_values with the query count a constant (the accumulators live in registers). */
INLINE void attend_values_of(const void *v_pool, const int64_t *rows, int64_t head_dim, const float *const *p,
                             const int64_t *lo, const int64_t *hi, const float *inverse, void *out,
                             const int64_t *out_offsets, int count, const int bf16) {
    switch (count) {
#define V_CASE(Q) case Q: attend_values(v_pool, rows, head_dim, p, lo, hi, inverse, out, out_offsets, Q, bf16); break;
        V_CASE(1) V_CASE(2) V_CASE(3) V_CASE(4) V_CASE(5) V_CASE(6) V_CASE(7) V_CASE(8)
#undef V_CASE
        default: break; /* never: callers pass 1 .. V_QUERIES */
    }
}

/* A work item of a paged_attention call: its query tokens are row `seq`'s tokens start .. start + count - 1, the
 * last seeing `len` keys, for the query group of KV head `head`; `table`: the row's blocks. */
typedef struct {
    int64_t head, count, len, start;
    const int64_t *table;
} WorkItem;

/* Work item `item`: the query group of KV head item % num_kv_heads for the tile of query tokens
 * item / num_kv_heads (row r's tiles are first_tile[r] .. first_tile[r + 1] - 1). */
INLINE WorkItem locate_item(const PagedCall *call, int64_t item) {
    const int64_t tile_index = item / call->num_kv_heads, *first_tile = call->first_tile;
    int64_t seq = 0, past = call->num_rows; /* first_tile[seq] <= tile_index < first_tile[seq + 1] */
    while (past - seq > 1) {
        const int64_t mid = (seq + past) / 2;
        if (first_tile[mid] <= tile_index) seq = mid; else past = mid;
    }
    const int64_t row_count = call->qlens != NULL ? call->qlens[seq] : 1;
    const int64_t j0 = (tile_index - first_tile[seq]) * call->tile;
    const int64_t count = row_count - j0 < call->tile ? row_count - j0 : call->tile;
    const WorkItem w = {item % call->num_kv_heads, count, call->lens[seq] - row_count + j0 + count,
                        (call->starts != NULL ? call->starts[seq] : seq) + j0, call->tables + seq * call->table_stride};
    return w;
}

#if HAVE_AMX_BF16
#define ATTENTION_CHUNK 32 /* keys per A tile of the weighted V sums, at positions that are multiples of 32 */

/* One work item's operands on AMX tiles, and its scratch (one allocation at `rows`). */
typedef struct {
    const uint16_t *k_pool, *v_pool;
    int64_t queries, groups, steps, base, n, padded, pair_stride, head_dim;
    int64_t *rows, *lo, *hi, *out_offsets; /* [padded]; [queries] x 3 */
    float *inverse, *scores;             /* [queries]; [queries][padded] */
    uint16_t *p, *qt, *keys, *pairs;     /* numerators, the queries' B tiles, staged K rows, V rows in pairs */
    float *c_tile;                       /* [16][16] */
} TileItem;

/* The item's key range [base, len) (base: its first key rounded down to a chunk), and its scratch: rows [padded];
 * lo, hi, out offsets [queries]; inverse [queries]; scores [queries][padded] float; p [groups * 16][padded],
 * qt [groups][steps][16][32], keys [2][steps][16][32], pairs [padded / 2][2 head_dim] bf16; c [16][16] float.
 * 0 without memory. */
INLINE int tile_item_alloc(TileItem *it, const PagedCall *call, const WorkItem *w) {
    const int64_t group = call->group, head_dim = call->head_dim, window = call->window;
    it->k_pool = (const uint16_t *)call->k_pool, it->v_pool = (const uint16_t *)call->v_pool;
    it->queries = w->count * group, it->groups = (it->queries + 15) / 16, it->steps = (head_dim + 31) / 32;
    const int64_t end0 = w->len - w->count + 1, first = (window > 0 && end0 > window) ? end0 - window : 0;
    it->base = first & ~(int64_t)(ATTENTION_CHUNK - 1); /* positions [base, len), t = position - base */
    it->n = w->len - it->base, it->padded = (it->n + ATTENTION_CHUNK - 1) & ~(int64_t)(ATTENTION_CHUNK - 1);
    it->pair_stride = 2 * head_dim, it->head_dim = head_dim; /* bf16 per V pair row */
    const int64_t queries = it->queries, padded = it->padded, groups = it->groups, steps = it->steps;
    const size_t bytes = sizeof(int64_t) * (size_t)(padded + 3 * queries)
                         + sizeof(float) * (size_t)(queries + queries * padded)
                         + 2 * (size_t)(groups * 16 * padded + groups * steps * 512 + 2 * steps * 512 + padded * head_dim)
                         + sizeof(float) * 256 + 64 * 4;
    it->rows = malloc(bytes);
    if (it->rows == NULL) return 0; /* not at these sizes */
    it->lo = it->rows + padded, it->hi = it->lo + queries, it->out_offsets = it->hi + queries;
    it->inverse = (float *)(it->out_offsets + queries), it->scores = it->inverse + queries;
    it->p = (uint16_t *)(((uintptr_t)(it->scores + queries * padded) + 63) & ~(uintptr_t)63);
    it->qt = it->p + groups * 16 * padded, it->keys = it->qt + groups * steps * 512;
    it->pairs = it->keys + 2 * steps * 512;
    it->c_tile = (float *)(((uintptr_t)(it->pairs + padded * head_dim) + 63) & ~(uintptr_t)63);
    return 1;
}

/* Each query's key range and output offset, each key's pool row (-1 past the keys: zeros), and the queries as B
 * tiles: qt[g][s][i][2 m + e] = query 16 g + m's element 32 s + 2 i + e (0 past them). */
INLINE void tile_item_operands(TileItem *it, const PagedCall *call, const WorkItem *w) {
    const int64_t group = call->group, head_dim = call->head_dim, window = call->window, end0 = w->len - w->count + 1;
    for (int64_t c = 0; c < it->queries; c++) {
        const int64_t j = c / group, end = end0 + j;
        it->lo[c] = ((window > 0 && end > window) ? end - window : 0) - it->base;
        it->hi[c] = end - it->base;
        it->out_offsets[c] = ((w->start + j) * call->num_heads + w->head * group + c % group) * head_dim;
    }
    for (int64_t t = 0; t < it->n; t++)
        it->rows[t] = pool_row(w->head * call->num_blocks, w->table, it->base + t, call->block_shift, call->block_size,
                               head_dim);
    for (int64_t t = it->n; t < it->padded; t++) it->rows[t] = -1;
    memset(it->qt, 0, 2 * (size_t)(it->groups * it->steps * 512));
    const uint16_t *q = (const uint16_t *)call->q;
    for (int64_t c = 0; c < it->queries; c++) {
        const uint16_t *row = q + (w->start + c / group) * call->q_stride + (w->head * group + c % group) * head_dim;
        uint16_t *dst = it->qt + (c / 16) * it->steps * 512 + 2 * (c % 16);
        for (int64_t d = 0; d < head_dim; d++) dst[(d / 32) * 512 + ((d % 32) / 2) * 32 + (d & 1)] = row[d];
    }
}

/* Keys [t, t + 32): the next 32 keys' K and V rows prefetched, and these keys' V rows in pairs:
 * pairs[u][2 d + e] = V[key 2 u + e][d]. */
INLINE void tile_value_pairs(const TileItem *it, int64_t t) {
    const __m512i low_pairs = _mm512_setr_epi32(0x200000, 0x210001, 0x220002, 0x230003, 0x240004, 0x250005, 0x260006, 0x270007,
                                                0x280008, 0x290009, 0x2a000a, 0x2b000b, 0x2c000c, 0x2d000d, 0x2e000e, 0x2f000f);
    const __m512i high_pairs = _mm512_add_epi16(low_pairs, _mm512_set1_epi16(16));
    const int64_t head_dim = it->head_dim, *rows = it->rows;
    for (int64_t ahead = t + 32; ahead < t + 64 && ahead < it->n; ahead++) {
        prefetch_row(it->k_pool, rows[ahead], head_dim, 1);
        prefetch_row(it->v_pool, rows[ahead], head_dim, 1);
    }
    for (int64_t u = t / 2; u < t / 2 + 16; u++) {
        const int64_t ra = rows[2 * u], rb = rows[2 * u + 1];
        for (int64_t d = 0; d < head_dim; d += 32) {
            const __mmask32 live = head_dim - d >= 32 ? 0xffffffffu : 0xffffu;
            const __m512i a = _mm512_maskz_loadu_epi16(ra < 0 ? 0 : live, it->v_pool + (ra < 0 ? 0 : ra) + d);
            const __m512i b = _mm512_maskz_loadu_epi16(rb < 0 ? 0 : live, it->v_pool + (rb < 0 ? 0 : rb) + d);
            _mm512_storeu_si512(it->pairs + u * it->pair_stride + 2 * d, _mm512_permutex2var_epi16(a, low_pairs, b));
            if (head_dim - d > 16)
                _mm512_storeu_si512(it->pairs + u * it->pair_stride + 2 * d + 32,
                                    _mm512_permutex2var_epi16(a, high_pairs, b));
        }
    }
}

/* The sixteen keys from t + 16 half as an A tile (rows *stride bytes apart, K steps *step apart): in place where
 * one block holds them (the same values), else staged. */
INLINE const uint16_t *tile_key_rows(const TileItem *it, const PagedCall *call, int64_t t, int half, int64_t *stride,
                                     int64_t *step) {
    const int64_t u = t + 16 * half, head_dim = it->head_dim, *rows = it->rows;
    if (head_dim % 32 == 0 && call->block_size >= 16 && u + 16 <= it->n) { /* base + u: a multiple of 16 */
        *stride = 2 * head_dim, *step = 32;
        return it->k_pool + rows[u];
    }
    uint16_t *staged = it->keys + half * it->steps * 512;
    for (int64_t i = 0; i < 16; i++)
        for (int64_t s = 0; s < it->steps; s++) {
            const __mmask32 live = rows[u + i] < 0 ? 0 : (head_dim - 32 * s >= 32 ? 0xffffffffu : 0xffffu);
            _mm512_storeu_si512(staged + s * 512 + i * 32,
                                _mm512_maskz_loadu_epi16(live, it->k_pool + (rows[u + i] < 0 ? 0 : rows[u + i]) + 32 * s));
        }
    *stride = 64, *step = 512;
    return staged;
}

/* C tile `tile` [16 keys x 16 queries] of query group g as score rows at scores[16 g + m][key]. */
INLINE void tile_store_scores(const TileItem *it, int tile, int64_t g, int64_t key) {
    const __m512i gather = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                              _mm512_set1_epi32(16));
    if (tile == 2) _tile_stored(2, it->c_tile, 64);
    else _tile_stored(3, it->c_tile, 64);
    float *dst = it->scores + 16 * g * it->padded + key;
    const int64_t live = it->queries - 16 * g < 16 ? it->queries - 16 * g : 16;
    if (live >= 6) { /* the tile's columns as rows: a transpose beats sixteen gathers */
        __m512i r[16];
        for (int i = 0; i < 16; i++) r[i] = _mm512_load_si512(it->c_tile + 16 * i);
        transpose16(r);
        for (int64_t m = 0; m < live; m++) _mm512_storeu_ps(dst + m * it->padded, _mm512_castsi512_ps(r[m]));
    } else
        for (int64_t m = 0; m < live; m++)
            _mm512_storeu_ps(dst + m * it->padded,
                             _mm512_i32gather_ps(_mm512_add_epi32(gather, _mm512_set1_epi32((int)m)), it->c_tile, 4));
}

/* Keys [t, t + 32) scored against every query group: C [16 keys x 16 queries] of both halves (tiles 2, 3: two
 * chains that overlap), A in tiles 0 and 4, B in 1. */
INLINE void tile_scores(const TileItem *it, const PagedCall *call, int64_t t) {
    const uint16_t *a[2];
    int64_t a_stride[2], a_step[2];
    for (int half = 0; half < 2; half++) a[half] = tile_key_rows(it, call, t, half, &a_stride[half], &a_step[half]);
    for (int64_t g = 0; g < it->groups; g++) {
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t s = 0; s < it->steps; s++) {
            _tile_loadd(1, it->qt + (g * it->steps + s) * 512, 64);
            _tile_loadd(0, a[0] + s * a_step[0], a_stride[0]);
            _tile_dpbf16ps(2, 0, 1);
            _tile_loadd(4, a[1] + s * a_step[1], a_stride[1]);
            _tile_dpbf16ps(3, 4, 1);
        }
        tile_store_scores(it, 2, g, t);
        tile_store_scores(it, 3, g, t + 16);
    }
}

/* Numerators in bf16, 0 outside each query's keys (rows past the queries are left as they are: an A row feeds its
 * own C row only, which is not read). */
INLINE void tile_numerators(const TileItem *it, float scale) {
    const int64_t padded = it->padded, *lo = it->lo, *hi = it->hi;
    for (int64_t c = 0; c < it->queries; c++) {
        float *row = it->scores + c * padded;
        const float total = softmax_numerators(row + lo[c], hi[c] - lo[c], scale);
        it->inverse[c] = total > 0.0f ? 1.0f / total : 0.0f;
        for (int64_t t = 0; t < padded; t += 32) {
            const __mmask16 low = _kand_mask16(~tail_mask(lo[c] - t > 0 ? lo[c] - t : 0), tail_mask(hi[c] - t > 0 ? hi[c] - t : 0));
            const __mmask16 high = _kand_mask16(~tail_mask(lo[c] - t - 16 > 0 ? lo[c] - t - 16 : 0),
                                                tail_mask(hi[c] - t - 16 > 0 ? hi[c] - t - 16 : 0));
            const __m512bh both = _mm512_cvtne2ps_pbh(_mm512_maskz_loadu_ps(high, row + t + 16), _mm512_maskz_loadu_ps(low, row + t));
            _mm512_storeu_si512(it->p + c * padded + t, (__m512i)both);
        }
    }
}

/* C tile 2 + j (16 queries x 16 dims of group g at d0 + 16 j) times 1 / each query's softmax sum, rounded out. */
INLINE void tile_store_values(const TileItem *it, int64_t g, int64_t d0, int64_t j, uint16_t *out) {
    if (j == 0) _tile_stored(2, it->c_tile, 64);
    if (j == 1) _tile_stored(3, it->c_tile, 64);
    if (j == 2) _tile_stored(4, it->c_tile, 64);
    if (j == 3) _tile_stored(5, it->c_tile, 64);
    for (int64_t m = 0; m < 16 && 16 * g + m < it->queries; m++)
        store16(out, it->out_offsets[16 * g + m] + d0 + 16 * j,
                _mm512_mul_ps(_mm512_loadu_ps(it->c_tile + 16 * m), _mm512_set1_ps(it->inverse[16 * g + m])), 1);
}

/* The weighted V sums: per query group and 64 output dims, C [16 queries x 16 dims] (tiles 2-5) += P (A, tile 0) x
 * V in key pairs (B, tile 1), ATTENTION_CHUNK keys a step in order from zero. */
INLINE void tile_values(const TileItem *it, uint16_t *out) {
    const int64_t padded = it->padded, pair_stride = it->pair_stride;
    for (int64_t g = 0; g < it->groups; g++)
        for (int64_t d0 = 0; d0 < it->head_dim; d0 += 64) {
            const int64_t tiles = (it->head_dim - d0) / 16 < 4 ? (it->head_dim - d0) / 16 : 4;
            _tile_zero(2);
            _tile_zero(3);
            _tile_zero(4);
            _tile_zero(5);
            for (int64_t t = 0; t < padded; t += ATTENTION_CHUNK) {
                const uint16_t *b = it->pairs + (t / 2) * pair_stride + 2 * d0;
                _tile_loadd(0, it->p + 16 * g * padded + t, 2 * padded);
                _tile_loadd(1, b, 2 * pair_stride);
                _tile_dpbf16ps(2, 0, 1);
                if (tiles > 1) {
                    _tile_loadd(1, b + 32, 2 * pair_stride);
                    _tile_dpbf16ps(3, 0, 1);
                }
                if (tiles > 2) {
                    _tile_loadd(1, b + 64, 2 * pair_stride);
                    _tile_dpbf16ps(4, 0, 1);
                }
                if (tiles > 3) {
                    _tile_loadd(1, b + 96, 2 * pair_stride);
                    _tile_dpbf16ps(5, 0, 1);
                }
            }
            for (int64_t j = 0; j < tiles; j++) tile_store_values(it, g, d0, j, out);
        }
}

/* One work item on AMX (bf16): its count x group query heads (c = j * group + g) of one KV head. Tiles 0 (A),
 * 1 (B), 2-5 (C), all 16 x 64 B.
 *   scores: C [16 keys x 16 queries] += K rows (A, 32 dims a step, in place in the pool where a block
 *           holds them) x the queries in bf16 pairs (B), the head_dim steps in order from zero: each score
 *           depends on its key and its query only;
 *   softmax: per query over its own keys, times the scale, as the vector path's (softmax_numerators);
 *   values:  C [16 queries x 16 dims] += P (A: the query's numerators rounded to bf16, 0 outside its keys)
 *           x V rows in pairs (B), 32 keys a step at positions that are multiples of 32, in order from zero,
 *           then times 1 / the softmax sum and one rounding. A step past a query's keys adds exact zeros.
 * So a query's output depends on its own keys and values only, not on the tile, the row or the batch:
 * a one-token decode computes the same (every bf16 query takes this path where tiles are granted). */
INLINE void attend_item_tiles(const PagedCall *call, const WorkItem *w) {
    TileItem it;
    if (!tile_item_alloc(&it, call, w)) return;
    tile_item_operands(&it, call, w);
    for (int64_t t = 0; t < it.padded; t += 32) {
        tile_value_pairs(&it, t);
        tile_scores(&it, call, t);
    }
    tile_numerators(&it, call->scale);
    tile_values(&it, (uint16_t *)call->out);
    free(it.rows);
}

HIDDEN void attention_tiles_load(void) {
    TileConfig config = {0};
    tile_shape(&config, 0, 6, 16, 64);
    _tile_loadconfig(&config);
}

HIDDEN int attention_tiles_available(void) { return amx_tiles_granted(); }
#else
HIDDEN void attention_tiles_load(void) {}
HIDDEN int attention_tiles_available(void) { return 0; }
#endif

/* Queries [from, to) of a work item's c = j * group + g on the vector path: float32 scores, softmax and FMA V sums,
 * each query over its own keys. */
INLINE void attend_item_vector(const PagedCall *call, const WorkItem *w, int64_t from, int64_t to, const int bf16) {
    const int64_t group = call->group, head_dim = call->head_dim, window = call->window, count = w->count;
    const void *k_pool = call->k_pool, *v_pool = call->v_pool;
    /* query j's keys are positions [first_j, end_j), both rising with j */
    const int64_t end0 = w->len - count + 1;
    const int64_t first = (window > 0 && end0 > window) ? end0 - window : 0;
    const int64_t n = w->len - first, padded = (n + 15) & ~(int64_t)15; /* positions [first, len) */
    const int64_t head_base = w->head * call->num_blocks, queries = count * group;
    if (to > queries) to = queries;
    if (from >= to) return;
    /* each key's row offset [padded] (the last repeated past n); per query (j, g), at c = j * group + g:
     * its key range [lo, hi) in t = position - first, its output offset, 1 / its softmax sum, its
     * score row, and the scores [queries][padded] */
    int64_t *rows = malloc(sizeof(int64_t) * (size_t)(padded + 3 * queries) + sizeof(float *) * (size_t)queries
                           + sizeof(float) * (size_t)(queries * (padded + 1)));
    if (rows == NULL) return; /* not at these sizes */
    int64_t *lo = rows + padded, *hi = lo + queries, *out_offsets = hi + queries;
    const float **p = (const float **)(out_offsets + queries);
    float *inverse = (float *)(p + queries), *scores = inverse + queries;
    for (int64_t c = 0; c < queries; c++) {
        const int64_t j = c / group, end = end0 + j;
        lo[c] = ((window > 0 && end > window) ? end - window : 0) - first;
        hi[c] = end - first;
        out_offsets[c] = ((w->start + j) * call->num_heads + w->head * group + c % group) * head_dim;
        p[c] = scores + c * padded;
    }
    for (int64_t t = 0; t < n; t++)
        rows[t] = pool_row(head_base, w->table, first + t, call->block_shift, call->block_size, head_dim);
    for (int64_t t = n; t < padded; t++) rows[t] = rows[n - 1];
    /* every query scores every key of the row (a few past its own range, unused) */
    for (int64_t t = 0; t < n; t += 16) {
        for (int64_t ahead = t + 16; ahead < t + 16 + PREFETCH_ROWS && ahead < n; ahead++) { /* and their V rows */
            prefetch_row(k_pool, rows[ahead], head_dim, bf16);
            prefetch_row(v_pool, rows[ahead], head_dim, bf16);
        }
        const __mmask16 live = tail_mask(n - t);
        for (int64_t c = from; c < to; c++)
            score_block(call->q, (w->start + c / group) * call->q_stride + (w->head * group + c % group) * head_dim,
                        k_pool, rows + t, head_dim, call->scale, scores + c * padded + t, live, bf16);
    }
    for (int64_t c = from; c < to; c++) {
        const float total = softmax_numerators(scores + c * padded + lo[c], hi[c] - lo[c], 1.0f);
        inverse[c] = total > 0.0f ? 1.0f / total : 0.0f;
    }
    for (int64_t c = from; c < to; c += V_QUERIES)
        attend_values_of(v_pool, rows, head_dim, p + c, lo + c, hi + c, inverse + c, call->out, out_offsets + c,
                         (int)(to - c < V_QUERIES ? to - c : V_QUERIES), bf16);
    free(rows);
}

/* Work item `item` of a paged_attention call; of its queries c = j * group + g only those in [from, to) on the
 * vector path (each query's output is its own: the same bits whoever computes the others), all of them on AMX
 * tiles. */
INLINE void attend_queries(const PagedCall *call, int64_t item, int64_t from, int64_t to, const int bf16) {
    const WorkItem w = locate_item(call, item);
#if HAVE_AMX_BF16
    if (call->tiles) {
        attend_item_tiles(call, &w);
        return;
    }
#endif
    attend_item_vector(call, &w, from, to, bf16);
}

HIDDEN void attend_queries_bf16(const PagedCall *call, int64_t item, int64_t from, int64_t to) {
    attend_queries(call, item, from, to, 1);
}

INLINE void attend_item(const PagedCall *call, int64_t item, const int bf16) {
    attend_queries(call, item, 0, INT64_MAX, bf16);
}

/* Paged attention straight from the pool for rows of any number of query tokens (decodes, speculative
 * verify rows, prefill chunks), each query computed exactly as a one-token decode at its position.
 *   q       [tokens, num_heads, head_dim], token rows `q_stride` elements apart (a view into a fused qkv
 *           output needs no copy; head_dim % 16 == 0, num_heads / num_kv_heads <= 16)
 *   k_pool, v_pool  [num_kv_heads, num_blocks, block_size, head_dim] (the torch backend's layout;
 *           block_size a power of two)
 *   tables  [num_rows, table_stride] block ids;  lens [num_rows] context lengths (new tokens included)
 *   starts, qlens [num_rows]: row r's queries are tokens starts[r] .. starts[r] + qlens[r] - 1 of q and
 *           out; query j sees the first lens[r] - qlens[r] + j + 1 keys (causal). NULL: row r is one
 *           query, token r.
 *   out     [tokens, num_heads, head_dim] (only the rows' tokens written)
 * One work item per (row, KV head, tile of up to TILE_QUERIES / group query tokens) serves the head's
 * query group of each of the tile's tokens, so each K/V row is read from memory once per tile and a
 * tile scores only the keys up to its last query's (causal: a prefill chunk's tiles see half the
 * keys of the chunk on average, and a long row spreads over the threads). bf16 where the process holds
 * the AMX tile state: attend_item_tiles (a prompt's row at about SDPA's CPU time); else the vector
 * path (float32 scores, softmax and FMA V sums). `window` > 0 keeps
 * each query's last `window` keys. Either way a query's scores, softmax sums and weighted V sums run over
 * its own keys in the same order and chunking whatever the row's other queries: a verify row's outputs
 * are bitwise those of one-token decodes at its positions, and a prompt's outputs (so its K/V in the next
 * layer) do not depend on how it was chunked or batched (what makes greedy speculation exact in bf16). */
INLINE void paged_attention(const void *q, int64_t q_stride, const void *k_pool, const void *v_pool, const int64_t *tables,
                            int64_t table_stride, const int64_t *lens, const int64_t *starts, const int64_t *qlens,
                            void *out, int64_t num_rows, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                            int64_t num_blocks, int64_t block_size, float scale, int64_t window, int num_threads,
                            const int bf16) {
    const int64_t group = num_heads / num_kv_heads;
    const int block_shift = __builtin_ctzll((unsigned long long)block_size);
    const int64_t tile = group >= TILE_QUERIES ? 1 : TILE_QUERIES / group; /* query tokens per work item */
    /* row r's tiles are items [first_tile[r], first_tile[r + 1]) (times the KV heads) */
    int64_t *first_tile = malloc(sizeof(int64_t) * (size_t)(num_rows + 1));
    if (first_tile == NULL) return; /* not at these sizes */
    first_tile[0] = 0;
    for (int64_t r = 0; r < num_rows; r++) first_tile[r + 1] = first_tile[r] + ((qlens != NULL ? qlens[r] : 1) + tile - 1) / tile;
    const int tiles = bf16 && attention_tiles_available();
    const PagedCall call = {q, k_pool, v_pool, out, tables, lens, starts, qlens, first_tile, q_stride, table_stride,
                            num_rows, num_heads, num_kv_heads, head_dim, num_blocks, block_size, window, group, tile,
                            scale, block_shift, tiles};
#pragma omp parallel num_threads(num_threads)
    {
    if (tiles) attention_tiles_load();
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < first_tile[num_rows] * num_kv_heads; item++) attend_item(&call, item, bf16);
    }
    free(first_tile);
}

#define PAGED_ARGS                                                                                            \
    const void *q, int64_t q_stride, const void *k_pool, const void *v_pool, const int64_t *tables, int64_t table_stride,      \
        const int64_t *lens, const int64_t *starts, const int64_t *qlens, void *out, int64_t num_rows, int64_t num_heads,   \
        int64_t num_kv_heads, int64_t head_dim, int64_t num_blocks, int64_t block_size, float scale, int64_t window,        \
        int num_threads
#define PAGED_PASS                                                                                            \
    q, q_stride, k_pool, v_pool, tables, table_stride, lens, starts, qlens, out, num_rows, num_heads, num_kv_heads,     \
        head_dim, num_blocks, block_size, scale, window, num_threads

void paged_attention_bf16(PAGED_ARGS) { paged_attention(PAGED_PASS, 1); }
void paged_attention_f32(PAGED_ARGS) { paged_attention(PAGED_PASS, 0); }
#endif
