/* CPU kernels for llmctl's engine, built on first use by kernels/__init__.py with the host's C
 * compiler (-O3 -march=native -fopenmp) and called through ctypes. Plain C on purpose: no torch
 * headers, so a build takes about a second.
 *
 * The kernels exist only where the target has AVX-512 F/BW/VL (`kernel_vector_bits()` says so); elsewhere
 * the library builds empty and the engine keeps its torch paths.
 *
 * OpenMP: torch already loaded its libgomp (SONAME libgomp.so.1), so this library shares torch's
 * runtime and thread pool instead of starting a second one; callers pass the thread count.
 *
 * Element types: `bf16` selects bfloat16 (uint16_t bits) over float32 storage. Both variants are
 * compiled from one always-inlined body with the flag constant.
 */
#include <math.h>
#include <omp.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define INLINE static inline __attribute__((always_inline))

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>

int kernel_vector_bits(void) { return 512; }

/* Float32 lanes rounded to bfloat16 precision (nearest even, NaN kept), still as float32: the torch
 * path rounds after every bf16 op, and the fused kernels round where it does to give its results. */
INLINE __m512 round_bf16(__m512 x) {
    const __m512i bits = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_and_si512(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))),
                                             _mm512_set1_epi32((int)0xffff0000u));
    return _mm512_mask_mov_ps(_mm512_castsi512_ps(rounded), _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), x);
}

INLINE __mmask16 tail_mask(int64_t remaining) {
    return remaining >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << remaining) - 1u);
}

/* Up to sixteen bf16 (or float) values at `src` + `offset`, widened to float32 (masked lanes 0). */
INLINE __m512 load16m(const void *src, int64_t offset, __mmask16 live, const int bf16) {
    if (bf16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(live, (const uint16_t *)src + offset)), 16));
    return _mm512_maskz_loadu_ps(live, (const float *)src + offset);
}

INLINE __m512 load16(const void *src, int64_t offset, const int bf16) { return load16m(src, offset, 0xffff, bf16); }

INLINE void store16m(void *dst, int64_t offset, __m512 values, __mmask16 live, const int bf16) {
    if (!bf16) {
        _mm512_mask_storeu_ps((float *)dst + offset, live, values);
        return;
    }
    const __m512i high = _mm512_srli_epi32(_mm512_castps_si512(round_bf16(values)), 16);
    _mm256_mask_storeu_epi16((uint16_t *)dst + offset, live, _mm512_cvtepi32_epi16(high));
}

INLINE void store16(void *dst, int64_t offset, __m512 values, const int bf16) { store16m(dst, offset, values, 0xffff, bf16); }

/* What the torch path stores after one op: bf16-rounded in bf16 mode, unchanged in float32. */
INLINE __m512 as_stored(__m512 x, const int bf16) { return bf16 ? round_bf16(x) : x; }

/* Decode attention is memory-bound with little work per row: without prefetching the next rows
 * the kernel stalls on DRAM latency (measured: 2.2 ms against 1.6 ms per 64-sequence layer). */
#define PREFETCH_ROWS 16 /* the next block of key rows, while this one is scored */
/* The element offset of position `pos`'s row of a KV head in a pool [num_kv_heads, num_blocks, block_size, head_dim]
 * (head_base: the head's first block, head * num_blocks; block_size = 2^block_shift: no division, where a 64-bit
 * idiv per row cost more than the memory traffic). */
INLINE int64_t pool_row(int64_t head_base, const int64_t *table, int64_t pos, int block_shift, int64_t block_size,
                        int64_t head_dim) {
    return (((head_base + table[pos >> block_shift]) << block_shift) + (pos & (block_size - 1))) * head_dim;
}

INLINE void prefetch_row(const void *src, int64_t offset, int64_t n, const int bf16) {
    const char *start = bf16 ? (const char *)((const uint16_t *)src + offset) : (const char *)((const float *)src + offset);
    for (int64_t b = 0; b < n * (bf16 ? 2 : 4); b += 64) _mm_prefetch(start + b, _MM_HINT_T0);
}

/* e^x for x in [-87, 88] (clamped outside): 2^k * e^f with k = round(x / ln2) and |f| <= ln2/2,
 * e^f from a degree-7 Taylor polynomial (relative error about 1e-8). */
INLINE __m512 exp_clamped(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
    const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.4426950408889634f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.6931471805599453f), x);
    static const float taylor[] = {1.0f / 720, 1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f};
    __m512 p = _mm512_set1_ps(1.0f / 5040);
    for (int i = 0; i < 7; i++) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(taylor[i]));
    return _mm512_scalef_ps(p, k);
}

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
 * accumulators stay in registers and their chains overlap (one key at a time waited on each chunk's
 * dot product: a prefill tile ran 2-3x slower). */
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

#define MAX_GROUP 16
#define TILE_QUERIES 48 /* query heads (tokens x group) per paged-attention work item */
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

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <sys/syscall.h>
long syscall(long number, ...); /* unistd.h declares it only outside strict C11 */

/* Whether this process holds AMX's tile state (arch_prctl ARCH_GET_XCOMP_PERM, XFEATURE_XTILEDATA): the
 * loader asks for it (amx_enable) before any kernel call, and a grant is never taken back. */
static int attention_tiles_granted(void) {
    unsigned long features = 0;
    return syscall(SYS_arch_prctl, 0x1022, &features) == 0 && ((features >> 18) & 1);
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed, aligned(64))) attention_tile_config;

#define ATTENTION_CHUNK 32 /* keys per A tile of the weighted V sums, at positions that are multiples of 32 */

/* One work item on AMX (bf16): `queries` = count x group query heads (c = j * group + g) of one KV head,
 * tokens start .. start + count - 1, the last seeing `len` keys. Tiles 0 (A), 1 (B), 2-5 (C), all 16 x 64 B.
 *   scores: C [16 keys x 16 queries] += K rows (A, 32 dims a step, in place in the pool where a block
 *           holds them) x the queries in bf16 pairs (B), the head_dim steps in order from zero: each score
 *           depends on its key and its query only;
 *   softmax: per query over its own keys, times the scale, as the vector path's (softmax_numerators);
 *   values:  C [16 queries x 16 dims] += P (A: the query's numerators rounded to bf16, 0 outside its keys)
 *           x V rows in pairs (B), 32 keys a step at positions that are multiples of 32, in order from zero,
 *           then times 1 / the softmax sum and one rounding. A step past a query's keys adds exact zeros.
 * So a query's output depends on its own keys and values only, not on the tile, the row or the batch:
 * a one-token decode computes the same (every bf16 query takes this path where tiles are granted). */
INLINE void attend_item_tiles(const uint16_t *q, int64_t q_stride, const uint16_t *k_pool, const uint16_t *v_pool,
                              const int64_t *table, int64_t head_base, int block_shift, int64_t block_size,
                              int64_t len, int64_t count, int64_t start, int64_t head, int64_t group,
                              int64_t num_heads, int64_t head_dim, float scale, int64_t window, uint16_t *out) {
    const int64_t queries = count * group, groups = (queries + 15) / 16, steps = (head_dim + 31) / 32;
    const int64_t end0 = len - count + 1;
    const int64_t first = (window > 0 && end0 > window) ? end0 - window : 0;
    const int64_t base = first & ~(int64_t)(ATTENTION_CHUNK - 1); /* positions [base, len), t = position - base */
    const int64_t n = len - base, padded = (n + ATTENTION_CHUNK - 1) & ~(int64_t)(ATTENTION_CHUNK - 1);
    const int64_t pair_stride = 2 * head_dim; /* bf16 per V pair row */
    /* rows [padded]; lo, hi, out offsets [queries]; inverse [queries]; scores [queries][padded] float;
     * p [groups * 16][padded], qt [groups][steps][16][32], keys [2][steps][16][32], pairs [padded / 2][2 head_dim]
     * bf16; c [16][16] float */
    const size_t bytes = sizeof(int64_t) * (size_t)(padded + 3 * queries)
                         + sizeof(float) * (size_t)(queries + queries * padded)
                         + 2 * (size_t)(groups * 16 * padded + groups * steps * 512 + 2 * steps * 512 + padded * head_dim)
                         + sizeof(float) * 256 + 64 * 4;
    int64_t *rows = malloc(bytes);
    if (rows == NULL) return; /* not at these sizes */
    int64_t *lo = rows + padded, *hi = lo + queries, *out_offsets = hi + queries;
    float *inverse = (float *)(out_offsets + queries), *scores = inverse + queries;
    uint16_t *p = (uint16_t *)(((uintptr_t)(scores + queries * padded) + 63) & ~(uintptr_t)63);
    uint16_t *qt = p + groups * 16 * padded, *keys = qt + groups * steps * 512, *pairs = keys + 2 * steps * 512;
    float *c_tile = (float *)(((uintptr_t)(pairs + padded * head_dim) + 63) & ~(uintptr_t)63);
    for (int64_t c = 0; c < queries; c++) {
        const int64_t j = c / group, end = end0 + j;
        lo[c] = ((window > 0 && end > window) ? end - window : 0) - base;
        hi[c] = end - base;
        out_offsets[c] = ((start + j) * num_heads + head * group + c % group) * head_dim;
    }
    for (int64_t t = 0; t < n; t++) {
        const int64_t pos = base + t;
        rows[t] = pool_row(head_base, table, pos, block_shift, block_size, head_dim);
    }
    for (int64_t t = n; t < padded; t++) rows[t] = -1; /* no key: zeros */
    const __m512i low_pairs = _mm512_setr_epi32(0x200000, 0x210001, 0x220002, 0x230003, 0x240004, 0x250005, 0x260006, 0x270007,
                                                0x280008, 0x290009, 0x2a000a, 0x2b000b, 0x2c000c, 0x2d000d, 0x2e000e, 0x2f000f);
    const __m512i high_pairs = _mm512_add_epi16(low_pairs, _mm512_set1_epi16(16));
    const __m512i gather = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                              _mm512_set1_epi32(16));
    /* the queries as B tiles: qt[g][s][i][2 m + e] = query 16 g + m's element 32 s + 2 i + e (0 past them) */
    memset(qt, 0, 2 * (size_t)(groups * steps * 512));
    for (int64_t c = 0; c < queries; c++) {
        const uint16_t *row = q + (start + c / group) * q_stride + (head * group + c % group) * head_dim;
        uint16_t *dst = qt + (c / 16) * steps * 512 + 2 * (c % 16);
        for (int64_t d = 0; d < head_dim; d++) dst[(d / 32) * 512 + ((d % 32) / 2) * 32 + (d & 1)] = row[d];
    }
    for (int64_t t = 0; t < padded; t += 32) {
        for (int64_t ahead = t + 32; ahead < t + 64 && ahead < n; ahead++) { /* the next 32 keys, and their V rows */
            prefetch_row(k_pool, rows[ahead], head_dim, 1);
            prefetch_row(v_pool, rows[ahead], head_dim, 1);
        }
        for (int64_t u = t / 2; u < t / 2 + 16; u++) { /* V rows in pairs: pairs[u][2 d + e] = V[key 2 u + e][d] */
            const int64_t ra = rows[2 * u], rb = rows[2 * u + 1];
            for (int64_t d = 0; d < head_dim; d += 32) {
                const __mmask32 live = head_dim - d >= 32 ? 0xffffffffu : 0xffffu;
                const __m512i a = _mm512_maskz_loadu_epi16(ra < 0 ? 0 : live, v_pool + (ra < 0 ? 0 : ra) + d);
                const __m512i b = _mm512_maskz_loadu_epi16(rb < 0 ? 0 : live, v_pool + (rb < 0 ? 0 : rb) + d);
                _mm512_storeu_si512(pairs + u * pair_stride + 2 * d, _mm512_permutex2var_epi16(a, low_pairs, b));
                if (head_dim - d > 16)
                    _mm512_storeu_si512(pairs + u * pair_stride + 2 * d + 32, _mm512_permutex2var_epi16(a, high_pairs, b));
            }
        }
        /* the two halves' sixteen keys as A tiles (a[half], rows a_stride bytes apart, K steps a_step apart):
         * in place where one block holds them (the same values), else staged */
        const uint16_t *a[2];
        int64_t a_stride[2], a_step[2];
        for (int half = 0; half < 2; half++) {
            const int64_t u = t + 16 * half;
            if (head_dim % 32 == 0 && block_size >= 16 && u + 16 <= n) { /* base + u: a multiple of 16 */
                a[half] = k_pool + rows[u], a_stride[half] = 2 * head_dim, a_step[half] = 32;
                continue;
            }
            uint16_t *staged = keys + half * steps * 512;
            for (int64_t i = 0; i < 16; i++)
                for (int64_t s = 0; s < steps; s++) {
                    const __mmask32 live = rows[u + i] < 0 ? 0 : (head_dim - 32 * s >= 32 ? 0xffffffffu : 0xffffu);
                    _mm512_storeu_si512(staged + s * 512 + i * 32,
                                        _mm512_maskz_loadu_epi16(live, k_pool + (rows[u + i] < 0 ? 0 : rows[u + i]) + 32 * s));
                }
            a[half] = staged, a_stride[half] = 64, a_step[half] = 512;
        }
        /* per query group: C [16 keys x 16 queries] of both halves (tiles 2, 3: two chains that overlap), A in
         * tiles 0 and 4, B in 1 */
        for (int64_t g = 0; g < groups; g++) {
            _tile_zero(2);
            _tile_zero(3);
            for (int64_t s = 0; s < steps; s++) {
                _tile_loadd(1, qt + (g * steps + s) * 512, 64);
                _tile_loadd(0, a[0] + s * a_step[0], a_stride[0]);
                _tile_dpbf16ps(2, 0, 1);
                _tile_loadd(4, a[1] + s * a_step[1], a_stride[1]);
                _tile_dpbf16ps(3, 4, 1);
            }
            for (int half = 0; half < 2; half++) {
                if (half == 0) _tile_stored(2, c_tile, 64);
                else _tile_stored(3, c_tile, 64);
                float *dst = scores + 16 * g * padded + t + 16 * half;
                const int64_t live = queries - 16 * g < 16 ? queries - 16 * g : 16;
                if (live >= 6) { /* the tile's columns as rows: a transpose beats sixteen gathers */
                    __m512i r[16];
                    for (int i = 0; i < 16; i++) r[i] = _mm512_load_si512(c_tile + 16 * i);
                    transpose16(r);
                    for (int64_t m = 0; m < live; m++) _mm512_storeu_ps(dst + m * padded, _mm512_castsi512_ps(r[m]));
                } else
                    for (int64_t m = 0; m < live; m++)
                        _mm512_storeu_ps(dst + m * padded,
                                         _mm512_i32gather_ps(_mm512_add_epi32(gather, _mm512_set1_epi32((int)m)), c_tile, 4));
            }
        }
    }
    /* numerators in bf16, 0 outside each query's keys (rows past the queries are left as they are: an A row
     * feeds its own C row only, which is not read) */
    for (int64_t c = 0; c < queries; c++) {
        float *row = scores + c * padded;
        const float total = softmax_numerators(row + lo[c], hi[c] - lo[c], scale);
        inverse[c] = total > 0.0f ? 1.0f / total : 0.0f;
        for (int64_t t = 0; t < padded; t += 32) {
            const __mmask16 low = _kand_mask16(~tail_mask(lo[c] - t > 0 ? lo[c] - t : 0), tail_mask(hi[c] - t > 0 ? hi[c] - t : 0));
            const __mmask16 high = _kand_mask16(~tail_mask(lo[c] - t - 16 > 0 ? lo[c] - t - 16 : 0),
                                                tail_mask(hi[c] - t - 16 > 0 ? hi[c] - t - 16 : 0));
            const __m512bh both = _mm512_cvtne2ps_pbh(_mm512_maskz_loadu_ps(high, row + t + 16), _mm512_maskz_loadu_ps(low, row + t));
            _mm512_storeu_si512(p + c * padded + t, (__m512i)both);
        }
    }
    for (int64_t g = 0; g < groups; g++)
        for (int64_t d0 = 0; d0 < head_dim; d0 += 64) {
            const int64_t tiles = (head_dim - d0) / 16 < 4 ? (head_dim - d0) / 16 : 4;
            _tile_zero(2);
            _tile_zero(3);
            _tile_zero(4);
            _tile_zero(5);
            for (int64_t t = 0; t < padded; t += ATTENTION_CHUNK) {
                const uint16_t *b = pairs + (t / 2) * pair_stride + 2 * d0;
                _tile_loadd(0, p + 16 * g * padded + t, 2 * padded);
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
            for (int64_t j = 0; j < tiles; j++) {
                if (j == 0) _tile_stored(2, c_tile, 64);
                if (j == 1) _tile_stored(3, c_tile, 64);
                if (j == 2) _tile_stored(4, c_tile, 64);
                if (j == 3) _tile_stored(5, c_tile, 64);
                for (int64_t m = 0; m < 16 && 16 * g + m < queries; m++)
                    store16(out, out_offsets[16 * g + m] + d0 + 16 * j,
                            _mm512_mul_ps(_mm512_loadu_ps(c_tile + 16 * m), _mm512_set1_ps(inverse[16 * g + m])), 1);
            }
        }
    free(rows);
}

INLINE void load_attention_tiles(void) {
    attention_tile_config config = {0};
    config.palette = 1;
    for (int t = 0; t < 6; t++) config.rows[t] = 16, config.colsb[t] = 64;
    _tile_loadconfig(&config);
}
#define ATTENTION_TILES 1
#else
#define ATTENTION_TILES 0
#endif

/* One paged_attention call's operands, and what it derives from them once. */
typedef struct {
    const void *q, *k_pool, *v_pool;
    void *out;
    const int64_t *tables, *lens, *starts, *qlens, *first_tile;
    int64_t q_stride, table_stride, num_rows, num_heads, num_kv_heads, head_dim, num_blocks, block_size, window;
    int64_t group, tile; /* query heads a KV head, query tokens a work item */
    float scale;
    int block_shift, tiles;
} PagedCall;

/* Work item `item` of a paged_attention call: the query group of KV head item % num_kv_heads for the tile of query
 * tokens item / num_kv_heads (row r's tiles are first_tile[r] .. first_tile[r + 1] - 1); of its queries
 * c = j * group + g only those in [from, to) on the vector path (each query's output is its own: the same bits
 * whoever computes the others), all of them on AMX tiles. */
INLINE void attend_queries(const PagedCall *call, int64_t item, int64_t from, int64_t to, const int bf16) {
    const void *q = call->q, *k_pool = call->k_pool, *v_pool = call->v_pool;
    void *out = call->out;
    const int64_t *tables = call->tables, *lens = call->lens, *starts = call->starts, *qlens = call->qlens;
    const int64_t *first_tile = call->first_tile, q_stride = call->q_stride, table_stride = call->table_stride;
    const int64_t num_rows = call->num_rows, num_heads = call->num_heads, num_kv_heads = call->num_kv_heads;
    const int64_t head_dim = call->head_dim, num_blocks = call->num_blocks, block_size = call->block_size;
    const int64_t window = call->window, group = call->group, tile = call->tile;
    const float scale = call->scale;
    const int block_shift = call->block_shift;
#if ATTENTION_TILES
    const int tiles = call->tiles;
#endif

    const int64_t tile_index = item / num_kv_heads, head = item % num_kv_heads;
    int64_t seq = 0, past = num_rows; /* the row holding this tile: first_tile[seq] <= tile_index < first_tile[seq + 1] */
    while (past - seq > 1) {
        const int64_t mid = (seq + past) / 2;
        if (first_tile[mid] <= tile_index) seq = mid; else past = mid;
    }
    /* the tile's queries are the row's tokens j0 .. j0 + count - 1: a row of `count` queries whose last
     * query sees `len` keys, starting at token `start` */
    const int64_t row_count = qlens != NULL ? qlens[seq] : 1, j0 = (tile_index - first_tile[seq]) * tile;
    const int64_t count = row_count - j0 < tile ? row_count - j0 : tile;
    const int64_t len = lens[seq] - row_count + j0 + count, start = (starts != NULL ? starts[seq] : seq) + j0;
    const int64_t *table = tables + seq * table_stride;
#if ATTENTION_TILES
    if (tiles) {
        attend_item_tiles((const uint16_t *)q, q_stride, (const uint16_t *)k_pool, (const uint16_t *)v_pool, table,
                          head * num_blocks, block_shift, block_size, len, count, start, head, group, num_heads,
                          head_dim, scale, window, (uint16_t *)out);
        return;
    }
#endif
    /* query j's keys are positions [first_j, end_j), both rising with j */
    const int64_t end0 = len - count + 1;
    const int64_t first = (window > 0 && end0 > window) ? end0 - window : 0;
    const int64_t n = len - first, padded = (n + 15) & ~(int64_t)15; /* positions [first, len) */
    const int64_t head_base = head * num_blocks, queries = count * group;
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
        out_offsets[c] = ((start + j) * num_heads + head * group + c % group) * head_dim;
        p[c] = scores + c * padded;
    }
    for (int64_t t = 0; t < n; t++) {
        const int64_t pos = first + t;
        rows[t] = pool_row(head_base, table, pos, block_shift, block_size, head_dim);
    }
    for (int64_t t = n; t < padded; t++) rows[t] = rows[n - 1];
    /* every query scores every key of the row (a few past its own range, unused) */
    for (int64_t t = 0; t < n; t += 16) {
        for (int64_t ahead = t + 16; ahead < t + 16 + PREFETCH_ROWS && ahead < n; ahead++) { /* and their V rows */
            prefetch_row(k_pool, rows[ahead], head_dim, bf16);
            prefetch_row(v_pool, rows[ahead], head_dim, bf16);
        }
        const __mmask16 live = tail_mask(n - t);
        for (int64_t c = from; c < to; c++)
            score_block(q, (start + c / group) * q_stride + (head * group + c % group) * head_dim, k_pool, rows + t,
                        head_dim, scale, scores + c * padded + t, live, bf16);
    }
    for (int64_t c = from; c < to; c++) {
        const float total = softmax_numerators(scores + c * padded + lo[c], hi[c] - lo[c], 1.0f);
        inverse[c] = total > 0.0f ? 1.0f / total : 0.0f;
    }
    for (int64_t c = from; c < to; c += V_QUERIES)
        attend_values_of(v_pool, rows, head_dim, p + c, lo + c, hi + c, inverse + c, out, out_offsets + c,
                         (int)(to - c < V_QUERIES ? to - c : V_QUERIES), bf16);
    free(rows);
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
 * the AMX tile state: attend_item_tiles (a prompt's row at 0.8-1.1x SDPA's CPU time); else the vector
 * path below (float32 scores, softmax and FMA V sums; 2-3x SDPA's for a long row). `window` > 0 keeps
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
#if ATTENTION_TILES
    const int tiles = bf16 && attention_tiles_granted();
#else
    const int tiles = 0;
#endif
    const PagedCall call = {q, k_pool, v_pool, out, tables, lens, starts, qlens, first_tile, q_stride, table_stride,
                            num_rows, num_heads, num_kv_heads, head_dim, num_blocks, block_size, window, group, tile,
                            scale, block_shift, tiles};
#pragma omp parallel num_threads(num_threads)
    {
#if ATTENTION_TILES
    if (tiles) load_attention_tiles();
#endif
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

/* ---- fused elementwise ops: one pass over memory instead of torch's 3-8 ops, same rounding ---- */

/* out = RMSNorm(x) * weight, or with `residual`: residual <- residual + x, out = RMSNorm(residual) *
 * weight. Rows [rows, dim] contiguous. Like Hugging Face's Llama: the normalised row is cast to the
 * storage dtype before the weight multiplies it. */
INLINE void rms_norm_row(const void *x, void *residual, const void *weight, void *out, int64_t base, int64_t dim,
                         float eps, const int bf16) {
    __m512 squares = _mm512_setzero_ps();
    for (int64_t d = 0; d < dim; d += 16) {
        const __mmask16 live = tail_mask(dim - d);
        __m512 v = load16m(x, base + d, live, bf16);
        if (residual != NULL) {
            v = as_stored(_mm512_add_ps(load16m(residual, base + d, live, bf16), v), bf16);
            store16m(residual, base + d, v, live, bf16);
        }
        squares = _mm512_fmadd_ps(v, v, squares);
    }
    const void *source = residual != NULL ? residual : x;
    const __m512 inverse = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(squares) / (float)dim + eps));
    for (int64_t d = 0; d < dim; d += 16) {
        const __mmask16 live = tail_mask(dim - d);
        const __m512 normed = as_stored(_mm512_mul_ps(load16m(source, base + d, live, bf16), inverse), bf16);
        store16m(out, base + d, _mm512_mul_ps(normed, load16m(weight, d, live, bf16)), live, bf16);
    }
}

INLINE void rms_norm(const void *x, void *residual, const void *weight, void *out, int64_t rows, int64_t dim,
                     float eps, int num_threads, const int bf16) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows > 8)
    for (int64_t r = 0; r < rows; r++) rms_norm_row(x, residual, weight, out, r * dim, dim, eps, bf16);
}

/* out[r] = silu(gate[r]) * up[r] where gate_up[r] = [gate | up], each `size` wide. */
INLINE void silu_and_mul_row(const void *gate_up, void *out, int64_t r, int64_t size, const int bf16) {
    for (int64_t d = 0; d < size; d += 16) {
        const __mmask16 live = tail_mask(size - d);
        const __m512 gate = load16m(gate_up, 2 * r * size + d, live, bf16);
        const __m512 up = load16m(gate_up, 2 * r * size + size + d, live, bf16);
        const __m512 denominator = _mm512_add_ps(_mm512_set1_ps(1.0f), exp_clamped(_mm512_sub_ps(_mm512_setzero_ps(), gate)));
        const __m512 silu = as_stored(_mm512_div_ps(gate, denominator), bf16);
        store16m(out, r * size + d, _mm512_mul_ps(silu, up), live, bf16);
    }
}

INLINE void silu_and_mul(const void *gate_up, void *out, int64_t rows, int64_t size, int num_threads, const int bf16) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows > 8)
    for (int64_t r = 0; r < rows; r++) silu_and_mul_row(gate_up, out, r, size, bf16);
}

/* Rotate-half RoPE in place on `heads` heads at the start of each row of x (row stride
 * `row_stride` elements); cos/sin [rows, head_dim / 2] in x's dtype, one row per token. */
/* Heads [first_head, last_head) of row r (each element's rotation is its own: any split of the heads gives
 * the same values). */
INLINE void rotary_heads(void *x, int64_t r, int64_t row_stride, int64_t first_head, int64_t last_head,
                         int64_t head_dim, const void *cos, const void *sin, const int bf16) {
    const int64_t half = head_dim / 2;
    for (int64_t d = 0; d < half; d += 16) {
        const __mmask16 live = tail_mask(half - d);
        const __m512 c = load16m(cos, r * half + d, live, bf16), s = load16m(sin, r * half + d, live, bf16);
        for (int64_t h = first_head; h < last_head; h++) {
            const int64_t first = r * row_stride + h * head_dim + d;
            const __m512 x1 = load16m(x, first, live, bf16), x2 = load16m(x, first + half, live, bf16);
            const __m512 low = _mm512_sub_ps(as_stored(_mm512_mul_ps(x1, c), bf16), as_stored(_mm512_mul_ps(x2, s), bf16));
            const __m512 high = _mm512_add_ps(as_stored(_mm512_mul_ps(x2, c), bf16), as_stored(_mm512_mul_ps(x1, s), bf16));
            store16m(x, first, low, live, bf16);
            store16m(x, first + half, high, live, bf16);
        }
    }
}

INLINE void rotary(void *x, int64_t rows, int64_t row_stride, int64_t heads, int64_t head_dim, const void *cos,
                   const void *sin, int num_threads, const int bf16) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows > 8)
    for (int64_t r = 0; r < rows; r++) rotary_heads(x, r, row_stride, 0, heads, head_dim, cos, sin, bf16);
}

/* Scatter this step's keys and values into the head-major pools [kv_heads, pool_slots, head_dim]:
 * row r's heads go to slot slots[r]. Sources are [rows, kv_heads, head_dim] with rows `k_stride` and
 * `v_stride` elements apart (views into a fused qkv output). Replaces two transposing index_copy_ calls. */
INLINE void write_kv(const void *k, int64_t k_stride, const void *v, int64_t v_stride, void *k_pool, void *v_pool, const int64_t *slots,
                     int64_t rows, int64_t kv_heads, int64_t head_dim, int64_t pool_slots, int num_threads, const int bf16) {
    const size_t element = bf16 ? 2 : 4, bytes = (size_t)head_dim * element;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows > 64)
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t h = 0; h < kv_heads; h++) {
            const size_t to = (size_t)((h * pool_slots + slots[r]) * head_dim) * element;
            memcpy((char *)k_pool + to, (const char *)k + (size_t)(r * k_stride + h * head_dim) * element, bytes);
            memcpy((char *)v_pool + to, (const char *)v + (size_t)(r * v_stride + h * head_dim) * element, bytes);
        }
    }
}

#define WRITE_KV_ARGS const void *k, int64_t k_stride, const void *v, int64_t v_stride, void *k_pool, void *v_pool, const int64_t *slots, \
    int64_t rows, int64_t kv_heads, int64_t head_dim, int64_t pool_slots, int num_threads
#define WRITE_KV_PASS k, k_stride, v, v_stride, k_pool, v_pool, slots, rows, kv_heads, head_dim, pool_slots, num_threads
void write_kv_bf16(WRITE_KV_ARGS) { write_kv(WRITE_KV_PASS, 1); }
void write_kv_f32(WRITE_KV_ARGS) { write_kv(WRITE_KV_PASS, 0); }

/* y = W x (+ bias) for one bfloat16 row x [K] and W [N, K] row-major, in one pass over W: the
 * batch-1 decode step is these GEMVs, and torch.mv streams bf16 weights at ~11 GB/s here. Each thread reads
 * its contiguous share of W row after row, one sequential stream (x stays in L1), with products of bf16 pairs
 * in four float32 accumulators (dpbf16) and the stream prefetched GEMV_AHEAD elements (8 KiB) ahead at the
 * rate it is read. Measured on Zen 5 (2 vCPUs, cold, a SmolLM-135M token's 121 GEMVs, variants alternated in
 * one process): four rows read side by side (four interleaved streams a few hundred bytes long) took
 * 7.4-8.0 ms on two threads when the host's memory was contended, one stream 5.5-5.7 ms; 3.7 ms against 3.7
 * when it was not; one thread 6.8-7.0 ms either way. Without the prefetch the cold lm_head (49152x576, one
 * thread) of the four-stream reading ran at 7.1 against 36-40 GB/s; 2048 and 8192 elements ahead did as
 * well or a little worse. The prefetch is non-temporal, as the quantised streams' are (quant_kernels.c): the weights
 * are read once a token, and lines fetched into L1 and L2 would reach L3 on eviction and push the KV pool out of it.
 * The engine's bf16 batch-1 step (`decode_overhead.py --streaming`, two threads, Zen 5, alternated processes, a
 * 48-55 GB/s read figure): 5.35-5.49 -> 5.12-5.38 ms (medians 5.43 -> 5.27 over six and eight runs). */
#if defined(__AVX512BF16__)
#define GEMV_AHEAD 4096
/* `end`: where the thread's rows end; its stream prefetches no further (past it the lines were the other thread's,
 * already read and not kept in L3, or another tensor's: 8 KiB a call a thread fetched for nothing, ~2.5 % of a
 * 576x576 weight). A token's 121 GEMVs (C driver, 2 MiB pages, two threads, Zen 4, three alternated runs of 8
 * passes, two rows each): mean 30.6 -> 33.1, 33.8 -> 33.7, 32.4 -> 32.6 GB/s. */
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
INLINE void gemv_bf16_share(const uint16_t *weight, const uint16_t *vector, const void *bias, void *y, int64_t n,
                            int64_t k, int64_t me, int64_t threads) {
    const int64_t first = n * me / threads, last = n * (me + 1) / threads;
    for (int64_t r = first; r < last; r++) {
        float value = gemv_row(weight + r * k, vector, k, weight + last * k);
        if (bias != NULL) value += _mm512_cvtss_f32(load16m(bias, r, 1, 1));
        store16m(y, r, _mm512_set1_ps(value), 1, 1);
    }
}

int gemv_bf16(const void *w, const void *x, const void *bias, void *y, int64_t n, int64_t k, int num_threads) {
#pragma omp parallel num_threads(num_threads)
    gemv_bf16_share((const uint16_t *)w, (const uint16_t *)x, bias, y, n, k, omp_get_thread_num(), omp_get_num_threads());
    return 1;
}
#else
int gemv_bf16(const void *w, const void *x, const void *bias, void *y, int64_t n, int64_t k, int num_threads) {
    (void)w, (void)x, (void)bias, (void)y, (void)n, (void)k, (void)num_threads;
    return 0; /* no AVX512-BF16: the caller keeps torch.mv */
}
#endif

/* y = x W^T (+ bias) on AMX (Sapphire Rapids and later) from a weight packed by kernels/__init__.py's
 * `pack_amx`: N padded to 64 and K to 32, tiles [N / 32][K / 32][2][16 pairs][16 outputs][2] (a 16 x 16
 * B tile of bf16 pairs, 1 KiB, for each 16 outputs x 32 inputs; a 32-output pair's two side by side, each
 * pair's K steps one contiguous stream: strided 4 KiB steps defeated the prefetcher, gate_up at M = 2048
 * 1.42x oneDNN's time).
 * Measured here (one thread, hot): the dpbf16 kernel above runs ~0.9 G dot products/s, so each row of M
 * costs a whole pass of compute (qkv 960x576: 31 us at M = 1, 100 us at M = 5) while oneDNN's AMX kernel
 * is flat (37 us) from M = 1 to 8. One work item is 16 rows of x (one A tile) against a 64-output group
 * (four C tiles), K in order; tiles 0-3 accumulate, 4 holds A, 6-7 B.
 *
 * Each output element is its C tile element, fed K in 32-wide steps in order from zero, then the bias
 * added in float32 and one rounding to bf16: it depends on its own row of x and column of W only, so any
 * row of an M-row call is bitwise that row's one-row call (verify rows equal one-token decodes, and a
 * decode row's value does not depend on what else shares the batch). */
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <omp.h>
#include <sys/syscall.h>
long syscall(long number, ...); /* unistd.h declares it only outside strict C11 */

/* Linux hands AMX's 8 KiB tile state to a process only after it asks (arch_prctl ARCH_REQ_XCOMP_PERM for
 * XFEATURE_XTILEDATA); 1 when granted. The permission is the process's, for all its threads. */
int amx_enable(void) { return syscall(SYS_arch_prctl, 0x1023, 18) == 0; }

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed, aligned(64))) tile_config;

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
 * streams from DRAM here (decode): its tiles two steps ahead are prefetched (cold, one thread, M = 1:
 * gate_up 242 -> 228 us, qkv 80 -> 76 us, lm_head 3605 -> 3452 us; 4 or 8 steps no better). */
#define AMX_PREFETCH_STEPS 2
INLINE void amx_few_rows(const uint16_t *a, const uint16_t *w, const void *bias, void *y, int64_t m, int64_t n,
                         int64_t kp, int num_threads) {
    const int64_t steps = kp / 32, groups = (n + 63) / 64;
    tile_config config = {0};
    config.palette = 1;
    for (int t = 0; t < 5; t++) config.rows[t] = (uint8_t)m, config.colsb[t] = 64; /* C 0-3, A 4 */
    for (int t = 6; t < 8; t++) config.rows[t] = 16, config.colsb[t] = 64;       /* B 6-7 */
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
 * are padded to 16, not 32. Rows go in passes of AMX_PASS (gate_up at M = 2048 in one pass of the first
 * order took 5.2x its M = 512 time); a pass's items by blocks of AMX_COLS outputs, then chunks of AMX_ROWS
 * rows: a block's weight (1.2 MB at K = 576) and a chunk's rows stay in L2. Inside a chunk:
 * - pair-major (a pair's row pairs in turn: its B tiles in L1 across them) up to one chunk of rows (decode
 *   batches: the weight streams from DRAM once, on each pair's first row pair, prefetched two K steps ahead
 *   as for few rows; on its later row pairs the next pair's tiles go to L2, so DRAM keeps streaming while
 *   the pair's B tiles are re-read from L1: lm_head and gate_up cold at M = 64-128 1-5 % faster), and where
 *   a row pair's A tiles do not fit L1 (K > AMX_ROW_MAJOR_K: down 576x1536 at M = 2048 1.3x slower
 *   row-major);
 * - row-major (the block's pairs in turn against one row pair, its A tiles in L1, B streaming from L2 with
 *   the same prefetch) for more rows at K <= AMX_ROW_MAJOR_K: gate_up 3072x576 at M = 2048 9.0 -> 8.0 ms.
 * The epilogue (C + bias, rounded, to y) waits for the item's dot products if it runs after them: row-major,
 * an item's C tiles go to `scratch` and are written out a few rows per K step while the next item's dot
 * products run (pair-major that measured slower: its consecutive items write other rows of y).
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
        _tile_loadd(4, a0 + s * 32, kp * 2);
        _tile_loadd(6, b, 64);
        _tile_loadd(7, b + 512, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        if (both) {
            _tile_loadd(5, a1 + s * 32, kp * 2);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
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
    tile_config config = {0};
    config.palette = 1;
    for (int t = 0; t < 8; t++) config.rows[t] = 16, config.colsb[t] = 64;
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

#define NORM_ARGS const void *x, void *residual, const void *weight, void *out, int64_t rows, int64_t dim, float eps, int num_threads
void rms_norm_bf16(NORM_ARGS) { rms_norm(x, residual, weight, out, rows, dim, eps, num_threads, 1); }
void rms_norm_f32(NORM_ARGS) { rms_norm(x, residual, weight, out, rows, dim, eps, num_threads, 0); }
void silu_and_mul_bf16(const void *gate_up, void *out, int64_t rows, int64_t size, int num_threads) {
    silu_and_mul(gate_up, out, rows, size, num_threads, 1);
}
void silu_and_mul_f32(const void *gate_up, void *out, int64_t rows, int64_t size, int num_threads) {
    silu_and_mul(gate_up, out, rows, size, num_threads, 0);
}
#define ROTARY_ARGS void *x, int64_t rows, int64_t row_stride, int64_t heads, int64_t head_dim, const void *cos, const void *sin, int num_threads
void rotary_bf16(ROTARY_ARGS) { rotary(x, rows, row_stride, heads, head_dim, cos, sin, num_threads, 1); }
void rotary_f32(ROTARY_ARGS) { rotary(x, rows, row_stride, heads, head_dim, cos, sin, num_threads, 0); }

/* ---- a batch-1 decode step through the whole model in one call -------------------------------------
 * One sequence, one new token: the embedding row, every decoder layer (norm, fused qkv linear, RoPE, K/V
 * write, paged attention, o linear, add+norm, gate_up linear, SiLU*mul, down linear), the final norm and
 * the lm_head, with the kernels above (each linear's single-row kernel: gemv_bf16, gemm_amx_bf16, or the
 * quantised GEMV of quant_kernels.c) called in the order, on the operands and with the arguments the
 * model's Python forward gives them, so the logits are bitwise those of that forward. What it saves
 * is the Python between them: ~15 ctypes/torch calls per layer, each 3-4x its hot cost in a real step
 * because the weight stream has evicted the interpreter's working set (thread CPU time, SmolLM-135M
 * shape, one thread: ~8 ms of a ~40 ms step on a loaded host; int4-g32: 6.8 ms of a 17.2 ms step). */

/* Per layer, `STACK_LAYER_FIELDS` addresses in this order (0 for an absent bias); a linear's is the address
 * of its descriptor (below). */
enum { STACK_INPUT_NORM, STACK_QKV, STACK_QKV_BIAS, STACK_O, STACK_O_BIAS, STACK_POST_NORM, STACK_GATE_UP,
       STACK_GATE_UP_BIAS, STACK_DOWN, STACK_DOWN_BIAS, STACK_K_POOL, STACK_V_POOL, STACK_LAYER_FIELDS };
/* The model's sizes, in this order. */
enum { STACK_LAYERS, STACK_HIDDEN, STACK_HEADS, STACK_KV_HEADS, STACK_HEAD_DIM, STACK_INTERMEDIATE, STACK_VOCAB,
       STACK_NUM_BLOCKS, STACK_BLOCK_SIZE, STACK_WINDOW, STACK_SIZE_FIELDS };
/* A linear's descriptor: `STACK_LINEAR_FIELDS` int64 in this order, the kernel its rows run and that kernel's
 * weight operands. STACK_GEMV: gemv_bf16 on the plain weight [N, K]; STACK_AMX: gemm_amx_bf16 on its pack_amx
 * tiles; STACK_QUANT: quant_gemv_bf16_chain of the quantised library (a separate .so, also built for AVX2, so
 * its address comes with the weight: the Python forward's quant_gemv_bf16, then the next linear's prefetch) on
 * codes, scales, zeros (0: the midpoint), code format and group size in its layout, for STACK_ROWS output rows,
 * and that library's quant_gemv_bf16_share (one thread's share of the same, for the one-region step below);
 * a quantised weight in parts (kernels/quant.py KernelParts: runs of rows in different code formats) is a chain
 * of such descriptors, each naming the next part's (STACK_NEXT_PART; 0: the last). Scales, zeros, bits, group,
 * functions and next part are 0 for the others (their STACK_ROWS: the linear's). */
enum { STACK_KIND, STACK_WEIGHT, STACK_SCALES, STACK_ZEROS, STACK_BITS, STACK_GROUP, STACK_QUANT_GEMV,
       STACK_QUANT_SHARE, STACK_ROWS, STACK_NEXT_PART, STACK_LINEAR_FIELDS };
enum { STACK_GEMV, STACK_AMX, STACK_QUANT };
typedef int (*stack_quant_gemv)(const void *codes, const void *scales, const void *zeros, int bits, const void *x,
                                const void *bias, void *y, int64_t m, int64_t n, int64_t k, int64_t group,
                                int num_threads, const void *next_codes, const void *next_scales,
                                const void *next_zeros, int next_bits, int64_t next_n, int64_t next_k,
                                int64_t next_group);
/* bfloat16 scratch the caller owns, in this order, each for `max_tokens` rows: [hidden] x 3, [q + 2 kv],
 * [heads * head_dim], [2 * intermediate], [intermediate], [vocab], [head_dim / 2] x 2 (RoPE rows),
 * [hidden] x 2 (the logits rows' stream). */
enum { STACK_HIDDEN_BUF, STACK_RESIDUAL_BUF, STACK_NORMED_BUF, STACK_QKV_BUF, STACK_ATTENDED_BUF, STACK_GATE_UP_BUF,
       STACK_ACT_BUF, STACK_LOGITS_BUF, STACK_COS_BUF, STACK_SIN_BUF, STACK_LAST_X_BUF, STACK_LAST_RESIDUAL_BUF,
       STACK_BUFFERS };

/* The argmax of a float32 row of `width` >= 1: torch.argmax's answer, the first maximum, or the first NaN of a row
 * that holds one; two vector passes instead of torch's scalar loop (the greedy sampler's argmax over 49152 logits:
 * torch.argmax ~110 us, these passes ~35 us hot). */
INLINE int64_t argmax_row(const float *row, int64_t width) {
    /* pass 1: the maximum, four independent accumulators; a NaN anywhere is found in pass 2 */
    __m512 best[4] = {_mm512_set1_ps(-INFINITY), _mm512_set1_ps(-INFINITY), _mm512_set1_ps(-INFINITY),
                      _mm512_set1_ps(-INFINITY)};
    __mmask16 nan = 0;
    int64_t d = 0;
    for (; d + 64 <= width; d += 64)
        for (int u = 0; u < 4; u++) {
            const __m512 v = _mm512_loadu_ps(row + d + 16 * u);
            nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
            best[u] = _mm512_max_ps(best[u], v);
        }
    for (; d < width; d += 16) {
        const __mmask16 live = tail_mask(width - d);
        const __m512 v = _mm512_maskz_loadu_ps(live, row + d);
        nan |= _mm512_mask_cmp_ps_mask(live, v, v, _CMP_UNORD_Q);
        best[0] = _mm512_mask_max_ps(best[0], live, best[0], v);
    }
    const __m512 top = _mm512_set1_ps(
        _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(best[0], best[1]), _mm512_max_ps(best[2], best[3]))));
    /* pass 2: the first NaN if there is one, else the first element equal to the maximum */
    for (d = 0; d < width; d += 16) {
        const __mmask16 live = tail_mask(width - d);
        const __m512 v = _mm512_maskz_loadu_ps(live, row + d);
        const __mmask16 hit = nan ? _mm512_mask_cmp_ps_mask(live, v, v, _CMP_UNORD_Q)
                                  : _mm512_mask_cmp_ps_mask(live, v, top, _CMP_EQ_OQ);
        if (hit) return d + __builtin_ctz(hit);
    }
    return -1; /* never: width >= 1 */
}

/* Row-wise argmax_row of float32 rows [rows, width] (width >= 1). */
void argmax_f32(const float *x, int64_t rows, int64_t width, int64_t *out) {
    for (int64_t r = 0; r < rows; r++) out[r] = argmax_row(x + r * width, width);
}

#if defined(__AVX512BF16__)
/* One part of a quantised linear (its STACK_ROWS rows of y and bias from `offset`), then each thread prefetches
 * the start of its share of `next` (NULL, or not quantised: nothing), whose inputs are next_k. */
INLINE int stack_quant_part(const int64_t *part, const void *x, const void *bias, void *y, int64_t m, int64_t offset,
                            int64_t k, int num_threads, const int64_t *next, int64_t next_k) {
    const int chained = next != NULL && next[STACK_KIND] == STACK_QUANT;
#define STACK_NEXT(field) (chained ? (const void *)(intptr_t)next[field] : NULL)
    return ((stack_quant_gemv)(intptr_t)part[STACK_QUANT_GEMV])(
        (const void *)(intptr_t)part[STACK_WEIGHT], (const void *)(intptr_t)part[STACK_SCALES],
        (const void *)(intptr_t)part[STACK_ZEROS], (int)part[STACK_BITS], x,
        bias != NULL ? (const void *)((const uint16_t *)bias + offset) : NULL, (uint16_t *)y + offset, m,
        part[STACK_ROWS], k, part[STACK_GROUP], num_threads, STACK_NEXT(STACK_WEIGHT), STACK_NEXT(STACK_SCALES),
        STACK_NEXT(STACK_ZEROS), chained ? (int)next[STACK_BITS] : 0, chained ? next[STACK_ROWS] : 0, next_k,
        chained ? next[STACK_GROUP] : 0);
#undef STACK_NEXT
}

/* Rows through a linear's kernel: 0 where gemm_amx_bf16 or the quantised GEMV found no memory for its
 * prepared input. gemv_bf16 serves one row only (the caller never sends it more), and so do a quantised
 * weight's parts (each writes its columns of y as one row; DecodeStack runs quantised linears one token a step).
 * `next` (next_k inputs) is the linear the step runs after this one: a quantised GEMV followed by another (the
 * library's quant_gemv_bf16_chain) ends with its threads prefetching the start of their shares of it (a part, of
 * the part after it). */
INLINE int stack_linear(const int64_t *linear, const void *x, const void *bias, void *y, int64_t m, int64_t n,
                        int64_t k, int num_threads, const int64_t *next, int64_t next_k) {
    const void *w = (const void *)(intptr_t)linear[STACK_WEIGHT];
    switch (linear[STACK_KIND]) {
    case STACK_AMX: return gemm_amx_bf16(w, x, bias, y, m, n, k, num_threads);
    case STACK_GEMV: return m == 1 && gemv_bf16(w, x, bias, y, n, k, num_threads);
    case STACK_QUANT: {
        if (linear[STACK_NEXT_PART] != 0 && m != 1) return 0;
        int64_t offset = 0;
        for (const int64_t *part = linear; part != NULL;) {
            const int64_t *after = (const int64_t *)(intptr_t)part[STACK_NEXT_PART];
            if (!stack_quant_part(part, x, bias, y, m, offset, k, num_threads, after != NULL ? after : next,
                                  after != NULL ? k : next_k))
                return 0;
            offset += part[STACK_ROWS], part = after;
        }
        return offset == n;
    }
    }
    return 0;
}

/* The first ATTENTION_PREFETCH_ROWS key and value rows each row's attention reads, prefetched before the qkv GEMV
 * (the pool is cold: the weights streamed since the last step evicted it), so the attention starts on them while
 * its own prefetching gets ahead. A SmolLM-135M int4-g32 step, Zen 5, two threads, timers around each part,
 * alternated builds: attention 235-271 -> 166-171 us, the qkv GEMV 250-273 -> 263-274 us; 16 rows gave 181-208 us,
 * all of them 154-202 us with the qkv GEMV at 288-317 us. */
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

INLINE void stack_prefetch_keys(const void *k_pool, const void *v_pool, const int64_t *tables, int64_t table_width,
                                const int64_t *lens, int64_t num_rows, int64_t kv_heads, int64_t head_dim,
                                int64_t num_blocks, int64_t block_size, int64_t window) {
    for (int64_t r = 0; r < num_rows; r++)
        for (int64_t h = 0; h < kv_heads; h++)
            stack_prefetch_head_keys(k_pool, v_pool, tables + r * table_width, lens[r], h, head_dim, num_blocks,
                                     block_size, window);
}

/* ---- the one-token step in one parallel region ----
 * A step of one token through linears that all have a one-row kernel a thread can run its share of
 * (gemv_bf16_share, the quantised library's quant_gemv_bf16_share) runs in a single parallel region: the
 * threads meet at a spin barrier (team_wait) after each linear, the K/V writes and the attention, six a layer, where
 * the step above opens and joins a region per linear and per attention. A libgomp region's start and join
 * move several cache lines between the cores, a barrier on one line moves it twice: two threads of a Zen 4 VM,
 * 100 000 in a row, 0.54 us a region against 0.03 us a barrier with both vCPUs on one CCD, 1.17 against 0.17
 * with the two on two CCDs (a line ~190 ns each way). The small work between the linears is done by every
 * thread on its own copies (norms, the residual stream, SiLU*mul: the next linear's input then lies in the
 * thread's own cache) or split between the threads: each writes the new K/V rows of its KV heads (RoPE on K) and
 * attends its share of the query heads (their RoPE, paged_attention's item h for KV head h restricted to them, their
 * key rows prefetched by it). Same kernels, same operands, same order
 * within each output: the logits are bitwise the step above's. SmolLM-135M shape, two threads, the engine's whole
 * step (its Python included), both paths alternated pass by pass in one process, passes sorted by a read probe
 * before and after: vCPUs on two CCDs int4-g32 2.475 -> 2.068 ms (69 passes, faster in all), int8 3.395 -> 3.055,
 * bf16 7.285 -> 6.125; on one CCD int4-g32 2.501 -> 2.346 (faster in 37 of 41), bf16 8.684 -> 8.266. The query
 * heads split evenly, where a thread attended whole KV groups (one of two threads three of nine query heads, the
 * other six): int4-g32 on one CCD 2.551 -> 2.538 and 2.723 -> 2.660 ms (paired 0.987 and 0.980, 40 and 22 passes). */

/* A barrier for the threads of one region, on its own line: each arrival counts, and a thread leaves when the
 * count reaches its goal (threads a barrier; never reset, compared modulo 2^32). A waiting thread spins
 * `spins` times (prefetching its next attention's rows, then pausing), then sleeps on the count (a futex) until
 * the last arrival wakes it: with more threads than
 * cores a spinning thread holds the core the one it waits for needs (int4-g32, three threads on two cores:
 * 344 ms a step spinning and yielding, 7.8 ms with a region per linear, whose libgomp sleeps likewise). */
#include <linux/futex.h>
#include <sys/syscall.h>
long syscall(long number, ...); /* unistd.h declares it only outside strict C11 */
/* Pauses before sleeping: ~250 us on Zen 4 (25 ns a pause), far above a step's longest wait (~10 us at an
 * attention), far below a scheduler's time slice; 1000 with more threads than the cores they may run on (as
 * libgomp throttles its own spinning). */
#define TEAM_SPINS 10000
#define TEAM_SPINS_CROWDED 1000
typedef struct {
    _Alignas(128) _Atomic uint32_t arrived;
    _Atomic uint32_t sleepers;
    char line[120];
} TeamBarrier;

/* The key and value rows of the KV heads [head, head_end) at positions [first, end) of one layer's pool, which a
 * thread's next attention reads: the thread prefetches them a row at a time while it waits at a barrier (pos: the
 * next row's position). The pool is cold at each attention (the weights streamed since the last step evicted it),
 * and half an attention's time went to those misses (a second attention over the same rows at once took ~110 of
 * ~215 us a step); prefetched before the layer's first GEMV, its rows came back only as that stream let them
 * (all of them there: 1.017-1.020x slower than the first 64). */
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

typedef int (*stack_quant_share)(const void *codes, const void *scales, const void *zeros, int bits, const void *x,
                                 const void *bias, void *y, int64_t n, int64_t k, int64_t group, int me, int threads,
                                 const void *next_codes, const void *next_scales, const void *next_zeros,
                                 int next_bits, int64_t next_n, int64_t next_k, int64_t next_group);

/* Whether a linear (each of its parts) has a kernel a thread of the region can run its share of. */
INLINE int team_can_run(const int64_t *linear) {
    for (const int64_t *part = linear; part != NULL; part = (const int64_t *)(intptr_t)part[STACK_NEXT_PART]) {
        if (part[STACK_KIND] == STACK_GEMV && part == linear && part[STACK_NEXT_PART] == 0) continue;
        if (part[STACK_KIND] != STACK_QUANT || part[STACK_QUANT_SHARE] == 0) return 0;
    }
    return 1;
}

/* Thread `me`'s share (of `threads`) of a linear on one row: stack_linear's kernels, each part's rows from its
 * offset; a quantised part then prefetches the thread's share of the next (`next`, next_k inputs, after the last
 * part). 0 where a quantised kernel found no memory for its prepared input. */
INLINE int team_linear(const int64_t *linear, const uint16_t *x, const uint16_t *bias, uint16_t *y, int64_t k,
                       int me, int threads, const int64_t *next, int64_t next_k) {
    if (linear[STACK_KIND] == STACK_GEMV) {
        gemv_bf16_share((const uint16_t *)(intptr_t)linear[STACK_WEIGHT], x, bias, y, linear[STACK_ROWS], k, me,
                        threads);
        return 1;
    }
    int ok = 1;
    int64_t offset = 0;
    for (const int64_t *part = linear; part != NULL;) {
        const int64_t *after = (const int64_t *)(intptr_t)part[STACK_NEXT_PART], *then = after != NULL ? after : next;
        const int chained = then != NULL && then[STACK_KIND] == STACK_QUANT;
#define TEAM_NEXT(field) (chained ? (const void *)(intptr_t)then[field] : NULL)
        ok &= ((stack_quant_share)(intptr_t)part[STACK_QUANT_SHARE])(
            (const void *)(intptr_t)part[STACK_WEIGHT], (const void *)(intptr_t)part[STACK_SCALES],
            (const void *)(intptr_t)part[STACK_ZEROS], (int)part[STACK_BITS], x, bias != NULL ? bias + offset : NULL,
            y + offset, part[STACK_ROWS], k, part[STACK_GROUP], me, threads, TEAM_NEXT(STACK_WEIGHT),
            TEAM_NEXT(STACK_SCALES), TEAM_NEXT(STACK_ZEROS), chained ? (int)then[STACK_BITS] : 0,
            chained ? then[STACK_ROWS] : 0, after != NULL ? k : next_k, chained ? then[STACK_GROUP] : 0);
#undef TEAM_NEXT
        offset += part[STACK_ROWS], part = after;
    }
    return ok;
}

/* decode_stack_bf16 for one token in one row, its logits row 0 (team_can_run holds for every linear), and that
 * row's argmax_row into argmax[0]: each thread's of the slice it converts (hot in its cache), the first slice's on
 * ties (an argmax after the step read half the row from the other core's cache: with the vCPUs on two CCDs an
 * int4-g32 SmolLM-135M step took 2.194 -> 2.149 ms, paired 0.982 over 169 alternated passes).
 * Returns 0 where the threads' copies or a linear's prepared input found no memory. */
static int decode_team(const int64_t *layers, const int64_t *sizes, void *const *buffers, const void *embedding,
                       const void *final_norm, const int64_t *lm_head, const void *cos_table, const void *sin_table,
                       int64_t token, int64_t position, int64_t slot, const int64_t *table, const int64_t *lens,
                       const int64_t *starts, const int64_t *qlens, float eps, float scale, float *logits,
                       int64_t *argmax, int num_threads) {
    const int64_t hidden = sizes[STACK_HIDDEN], heads = sizes[STACK_HEADS], kv_heads = sizes[STACK_KV_HEADS];
    const int64_t head_dim = sizes[STACK_HEAD_DIM], intermediate = sizes[STACK_INTERMEDIATE], half = head_dim / 2;
    const int64_t num_blocks = sizes[STACK_NUM_BLOCKS], block_size = sizes[STACK_BLOCK_SIZE];
    const int64_t vocab = sizes[STACK_VOCAB], window = sizes[STACK_WINDOW], group = heads / kv_heads;
    const int64_t q_size = heads * head_dim, kv_size = kv_heads * head_dim, qkv_size = q_size + 2 * kv_size;
    uint16_t *x = buffers[STACK_HIDDEN_BUF], *qkv = buffers[STACK_QKV_BUF], *attended = buffers[STACK_ATTENDED_BUF];
    uint16_t *gate_up = buffers[STACK_GATE_UP_BUF], *rounded = buffers[STACK_LOGITS_BUF];
    const uint16_t *cos = (const uint16_t *)cos_table + position * half, *sin = (const uint16_t *)sin_table + position * half;
    /* each thread's residual stream, normed row and SiLU*mul row, 64-byte aligned */
    const int64_t own = (2 * hidden + intermediate + 31) / 32 * 32;
    const int slots = num_threads < 1 ? 1 : num_threads; /* threads the region may have */
    uint16_t *copies = aligned_alloc(64, sizeof(uint16_t) * (size_t)(own * slots));
    if (copies == NULL) return 0;
    TeamBarrier barrier = {0};
    const int64_t spins = num_threads > omp_get_num_procs() ? TEAM_SPINS_CROWDED : TEAM_SPINS;
    const int64_t first_tile[2] = {0, 1};
    int64_t picks[slots]; /* each thread's slice's argmax, -1: none */
    for (int t = 0; t < slots; t++) picks[t] = -1;
    int failed = 0;
#if ATTENTION_TILES
    const int tiles = attention_tiles_granted();
#else
    const int tiles = 0;
#endif
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        const int me = omp_get_thread_num(), threads = omp_get_num_threads();
#if ATTENTION_TILES
        if (tiles) load_attention_tiles();
#endif
        uint32_t goal = 0;
        KeyTrickle ahead = {0}; /* the rows of the thread's next attention, from the last one on (none in layer 0) */
        uint16_t *residual = copies + me * own, *normed = residual + hidden, *act = normed + hidden;
        /* the KV heads whose new K/V rows the thread writes, and the query heads [q_from, q_to) it attends: an even
         * split of the query heads (by KV head, one SmolLM-135M thread attended two of three, the other waited
         * ~110 us a step), whole query groups on AMX tiles (a tile serves its work item's queries together) */
        const int64_t kv_from = kv_heads * me / threads, kv_to = kv_heads * (me + 1) / threads;
        const int64_t unit = tiles ? group : 1, units = heads / unit;
        const int64_t q_from = unit * (units * me / threads), q_to = unit * (units * (me + 1) / threads);
        PagedCall call = {qkv, NULL, NULL, attended, table, lens, starts, qlens, first_tile, qkv_size, 0, 1, heads,
                          kv_heads, head_dim, num_blocks, block_size, window, group,
                          group >= TILE_QUERIES ? 1 : TILE_QUERIES / group, scale,
                          __builtin_ctzll((unsigned long long)block_size), tiles};
        memcpy(residual, (const uint16_t *)embedding + token * hidden, (size_t)hidden * sizeof(uint16_t));
        for (int64_t l = 0; l < sizes[STACK_LAYERS]; l++) {
            const int64_t *layer = layers + l * STACK_LAYER_FIELDS;
#define TEAM_PTR(field) ((const uint16_t *)(intptr_t)layer[field])
#define TEAM_LINEAR(field) ((const int64_t *)(intptr_t)layer[field])
            if (l == 0) rms_norm_row(residual, NULL, TEAM_PTR(STACK_INPUT_NORM), normed, 0, hidden, eps, 1);
            else rms_norm_row(x, residual, TEAM_PTR(STACK_INPUT_NORM), normed, 0, hidden, eps, 1);
            call.k_pool = (const void *)(intptr_t)layer[STACK_K_POOL], call.v_pool = (const void *)(intptr_t)layer[STACK_V_POOL];
            uint16_t *k_pool = (uint16_t *)(intptr_t)layer[STACK_K_POOL], *v_pool = (uint16_t *)(intptr_t)layer[STACK_V_POOL];
            for (int64_t h = kv_from; h < kv_to; h++) { /* the thread's rows: see decode_stack_bf16's prefetches */
                prefetch_row(k_pool, (h * num_blocks * block_size + slot) * head_dim, head_dim, 1);
                prefetch_row(v_pool, (h * num_blocks * block_size + slot) * head_dim, head_dim, 1);
            }
            for (int64_t h = ahead.head_end > 0 ? ahead.head : q_from / group; h * group < q_to; h++) /* not yet */
                stack_prefetch_head_keys(k_pool, v_pool, table, lens[0], h, head_dim, num_blocks, block_size, window);
            failed |= !team_linear(TEAM_LINEAR(STACK_QKV), normed, TEAM_PTR(STACK_QKV_BIAS), qkv, hidden, me, threads,
                                   TEAM_LINEAR(STACK_O), q_size);
            team_wait(&barrier, &goal, (uint32_t)threads, spins, &ahead);
            for (int64_t h = kv_from; h < kv_to; h++) {
                rotary_heads(qkv, 0, qkv_size, heads + h, heads + h + 1, head_dim, cos, sin, 1);
                const size_t to = (size_t)((h * num_blocks * block_size + slot) * head_dim);
                memcpy(k_pool + to, qkv + q_size + h * head_dim, (size_t)head_dim * sizeof(uint16_t));
                memcpy(v_pool + to, qkv + q_size + kv_size + h * head_dim, (size_t)head_dim * sizeof(uint16_t));
            }
            team_wait(&barrier, &goal, (uint32_t)threads, spins, &ahead); /* every head's new K/V row in the pool */
            for (int64_t h = q_from / group; h * group < q_to; h++) { /* item h: tile 0 of row 0, KV head h */
                const int64_t from = (q_from > h * group ? q_from : h * group) - h * group;
                const int64_t to = (q_to < (h + 1) * group ? q_to : (h + 1) * group) - h * group;
                rotary_heads(qkv, 0, qkv_size, h * group + from, h * group + to, head_dim, cos, sin, 1);
                attend_queries(&call, h, from, to, 1);
            }
            if (l + 1 < sizes[STACK_LAYERS] && q_from < q_to) { /* the next layer's rows but the one it writes */
                const int64_t len = lens[0], first = window > 0 && len > window ? len - window : 0;
                const int64_t *next_layer = layer + STACK_LAYER_FIELDS;
                ahead = (KeyTrickle){(const uint16_t *)(intptr_t)next_layer[STACK_K_POOL],
                                     (const uint16_t *)(intptr_t)next_layer[STACK_V_POOL], table, num_blocks,
                                     block_size, head_dim, q_from / group,
                                     first < len - 1 ? (q_to - 1) / group + 1 : 0, first, first, len - 1};
            } else ahead.head_end = 0;
            team_wait(&barrier, &goal, (uint32_t)threads, spins, &ahead);
            prefetch_row(TEAM_PTR(STACK_POST_NORM), 0, hidden, 1);
            failed |= !team_linear(TEAM_LINEAR(STACK_O), attended, TEAM_PTR(STACK_O_BIAS), x, q_size, me, threads,
                                   TEAM_LINEAR(STACK_GATE_UP), hidden);
            team_wait(&barrier, &goal, (uint32_t)threads, spins, &ahead);
            rms_norm_row(x, residual, TEAM_PTR(STACK_POST_NORM), normed, 0, hidden, eps, 1);
            failed |= !team_linear(TEAM_LINEAR(STACK_GATE_UP), normed, TEAM_PTR(STACK_GATE_UP_BIAS), gate_up, hidden, me,
                                   threads, TEAM_LINEAR(STACK_DOWN), intermediate);
            team_wait(&barrier, &goal, (uint32_t)threads, spins, &ahead);
            silu_and_mul_row(gate_up, act, 0, intermediate, 1);
            const int last_layer = l + 1 == sizes[STACK_LAYERS];
            prefetch_row(last_layer ? final_norm : (const void *)(intptr_t)layer[STACK_LAYER_FIELDS + STACK_INPUT_NORM],
                         0, hidden, 1);
            failed |= !team_linear(TEAM_LINEAR(STACK_DOWN), act, TEAM_PTR(STACK_DOWN_BIAS), x, intermediate, me, threads,
                                   last_layer ? lm_head : (const int64_t *)(intptr_t)layer[STACK_LAYER_FIELDS + STACK_QKV],
                                   hidden);
            team_wait(&barrier, &goal, (uint32_t)threads, spins, &ahead);
#undef TEAM_LINEAR
#undef TEAM_PTR
        }
        rms_norm_row(x, residual, final_norm, normed, 0, hidden, eps, 1);
        failed |= !team_linear(lm_head, normed, NULL, rounded, hidden, me, threads, NULL, 0);
        team_wait(&barrier, &goal, (uint32_t)threads, spins, NULL);
        const int64_t from = vocab * me / threads, to = vocab * (me + 1) / threads;
        for (int64_t i = from; i < to; i++) { /* bf16 -> float32: exact */
            const uint32_t bits = (uint32_t)rounded[i] << 16;
            memcpy(logits + i, &bits, sizeof(bits));
        }
        if (to > from) picks[me] = from + argmax_row(logits + from, to - from);
    }
    free(copies);
    int64_t best = -1; /* a NaN stays; else a later slice's only where greater */
    for (int t = 0; t < slots; t++) {
        const int64_t pick = picks[t];
        if (pick >= 0 && (best < 0 || (!isnan(logits[best]) && (isnan(logits[pick]) || logits[pick] > logits[best]))))
            best = pick;
    }
    argmax[0] = best;
    return !failed;
}

/* Returns 1 (0: out of memory in a linear's kernel, nothing to retry here); writes float32 logits
 * [num_logits, vocab] for tokens `logits_rows`, and into `argmax` [num_logits] each row's argmax_row where the
 * one-region step found it on the way (-1 where not: the caller finds it if it needs it). `tokens` new tokens
 * (`token`, `position`, `slot` each [tokens]) in `num_rows` rows as paged_attention takes them (`tables`
 * [num_rows, table_width], `lens`, and `starts`/`qlens` or NULL for one token a row); `cos_table`/`sin_table`:
 * bf16 RoPE rows [positions, head_dim / 2]; `lm_head`: the lm_head's descriptor. */
int decode_stack_bf16(const int64_t *layers, const int64_t *sizes, void *const *buffers, const void *embedding,
                      const void *final_norm, const int64_t *lm_head, const void *cos_table, const void *sin_table,
                      int64_t tokens, const int64_t *token, const int64_t *position, const int64_t *slot,
                      int64_t num_rows, const int64_t *tables, int64_t table_width, const int64_t *lens,
                      const int64_t *starts, const int64_t *qlens, int64_t num_logits, const int64_t *logits_rows,
                      float eps, float scale, float *logits, int64_t *argmax, int num_threads) {
    const int64_t hidden = sizes[STACK_HIDDEN], heads = sizes[STACK_HEADS], kv_heads = sizes[STACK_KV_HEADS];
    const int64_t head_dim = sizes[STACK_HEAD_DIM], intermediate = sizes[STACK_INTERMEDIATE], half = head_dim / 2;
    const int64_t num_blocks = sizes[STACK_NUM_BLOCKS], block_size = sizes[STACK_BLOCK_SIZE];
    const int64_t q_size = heads * head_dim, kv_size = kv_heads * head_dim, qkv_size = q_size + 2 * kv_size;
    uint16_t *x = buffers[STACK_HIDDEN_BUF], *residual = buffers[STACK_RESIDUAL_BUF], *normed = buffers[STACK_NORMED_BUF];
    uint16_t *qkv = buffers[STACK_QKV_BUF], *attended = buffers[STACK_ATTENDED_BUF];
    uint16_t *gate_up = buffers[STACK_GATE_UP_BUF], *act = buffers[STACK_ACT_BUF];
    uint16_t *cos = buffers[STACK_COS_BUF], *sin = buffers[STACK_SIN_BUF];
    const size_t row_bytes = (size_t)hidden * sizeof(uint16_t), half_bytes = (size_t)half * sizeof(uint16_t);
    int team = tokens == 1 && num_rows == 1 && num_logits == 1 && logits_rows[0] == 0 && team_can_run(lm_head);
    for (int64_t l = 0; team && l < sizes[STACK_LAYERS]; l++)
        for (int field = STACK_QKV; team && field <= STACK_DOWN; field++)
            if (field == STACK_QKV || field == STACK_O || field == STACK_GATE_UP || field == STACK_DOWN)
                team = team_can_run((const int64_t *)(intptr_t)layers[l * STACK_LAYER_FIELDS + field]);
    if (team)
        return decode_team(layers, sizes, buffers, embedding, final_norm, lm_head, cos_table, sin_table, token[0],
                           position[0], slot[0], tables, lens, starts, qlens, eps, scale, logits, argmax,
                           num_threads);
    for (int64_t r = 0; r < num_logits; r++) argmax[r] = -1;
    for (int64_t t = 0; t < tokens; t++) {
        /* the first layer's residual stream is the embedding itself; each token's RoPE rows */
        memcpy(residual + t * hidden, (const uint16_t *)embedding + token[t] * hidden, row_bytes);
        memcpy(cos + t * half, (const uint16_t *)cos_table + position[t] * half, half_bytes);
        memcpy(sin + t * half, (const uint16_t *)sin_table + position[t] * half, half_bytes);
    }
    for (int64_t l = 0; l < sizes[STACK_LAYERS]; l++) {
        const int64_t *layer = layers + l * STACK_LAYER_FIELDS;
#define STACK_PTR(field) ((const void *)(intptr_t)layer[field])
#define STACK_LINEAR(field) ((const int64_t *)(intptr_t)layer[field])
        if (l == 0)
            rms_norm(residual, NULL, STACK_PTR(STACK_INPUT_NORM), normed, tokens, hidden, eps, num_threads, 1);
        else
            rms_norm(x, residual, STACK_PTR(STACK_INPUT_NORM), normed, tokens, hidden, eps, num_threads, 1);
        void *k_pool = (void *)(intptr_t)layer[STACK_K_POOL], *v_pool = (void *)(intptr_t)layer[STACK_V_POOL];
        /* The small reads that follow a GEMV (the pool rows write_kv fills, the next norm's weight) are prefetched
         * before it, to come back while its stream runs: a SmolLM-135M int4-g32 step's norms, RoPE, K/V writes and
         * SiLU took 175 us cold, 90 us so (Zen 5, two threads, timers around each part of the step). */
        for (int64_t t = 0; t < tokens; t++)
            for (int64_t h = 0; h < kv_heads; h++) {
                prefetch_row(k_pool, (h * num_blocks * block_size + slot[t]) * head_dim, head_dim, 1);
                prefetch_row(v_pool, (h * num_blocks * block_size + slot[t]) * head_dim, head_dim, 1);
            }
        stack_prefetch_keys(k_pool, v_pool, tables, table_width, lens, num_rows, kv_heads, head_dim, num_blocks,
                            block_size, sizes[STACK_WINDOW]);
        if (!stack_linear(STACK_LINEAR(STACK_QKV), normed, STACK_PTR(STACK_QKV_BIAS), qkv, tokens, qkv_size, hidden,
                          num_threads, STACK_LINEAR(STACK_O), q_size))
            return 0;
        rotary(qkv, tokens, qkv_size, heads + kv_heads, head_dim, cos, sin, num_threads, 1);
        write_kv(qkv + q_size, qkv_size, qkv + q_size + kv_size, qkv_size, k_pool, v_pool, slot, tokens, kv_heads,
                 head_dim, num_blocks * block_size, num_threads, 1);
        paged_attention(qkv, qkv_size, k_pool, v_pool, tables, table_width, lens, starts, qlens, attended, num_rows,
                        heads, kv_heads, head_dim, num_blocks, block_size, scale, sizes[STACK_WINDOW], num_threads, 1);
        prefetch_row(STACK_PTR(STACK_POST_NORM), 0, hidden, 1);
        if (!stack_linear(STACK_LINEAR(STACK_O), attended, STACK_PTR(STACK_O_BIAS), x, tokens, hidden, q_size,
                          num_threads, STACK_LINEAR(STACK_GATE_UP), hidden))
            return 0;
        rms_norm(x, residual, STACK_PTR(STACK_POST_NORM), normed, tokens, hidden, eps, num_threads, 1);
        if (!stack_linear(STACK_LINEAR(STACK_GATE_UP), normed, STACK_PTR(STACK_GATE_UP_BIAS), gate_up, tokens,
                          2 * intermediate, hidden, num_threads, STACK_LINEAR(STACK_DOWN), intermediate))
            return 0;
        silu_and_mul(gate_up, act, tokens, intermediate, num_threads, 1);
        prefetch_row(l + 1 < sizes[STACK_LAYERS] ? (const void *)(intptr_t)layer[STACK_LAYER_FIELDS + STACK_INPUT_NORM]
                                                 : final_norm, 0, hidden, 1);
        const int last_layer = l + 1 == sizes[STACK_LAYERS];
        const int64_t *next = last_layer ? lm_head : (const int64_t *)(intptr_t)layer[STACK_LAYER_FIELDS + STACK_QKV];
        if (!stack_linear(STACK_LINEAR(STACK_DOWN), act, STACK_PTR(STACK_DOWN_BIAS), x, tokens, hidden, intermediate,
                          num_threads, next, hidden))
            return 0;
#undef STACK_LINEAR
#undef STACK_PTR
    }
    /* the logits rows only, as the forward takes hidden[logits_indices] and residual[logits_indices] */
    uint16_t *last_x = buffers[STACK_LAST_X_BUF], *last_residual = buffers[STACK_LAST_RESIDUAL_BUF];
    for (int64_t i = 0; i < num_logits; i++) {
        memcpy(last_x + i * hidden, x + logits_rows[i] * hidden, row_bytes);
        memcpy(last_residual + i * hidden, residual + logits_rows[i] * hidden, row_bytes);
    }
    rms_norm(last_x, last_residual, final_norm, normed, num_logits, hidden, eps, num_threads, 1);
    uint16_t *rounded = buffers[STACK_LOGITS_BUF];
    const int64_t vocab = sizes[STACK_VOCAB];
    if (!stack_linear(lm_head, normed, NULL, rounded, num_logits, vocab, hidden, num_threads, NULL, 0))
        return 0;
    for (int64_t i = 0; i < num_logits * vocab; i++) { /* bf16 -> float32 is exact: the bits move up 16 */
        const uint32_t bits = (uint32_t)rounded[i] << 16;
        memcpy(logits + i, &bits, sizeof(bits));
    }
    return 1;
}
#else
int decode_stack_bf16(const int64_t *layers, const int64_t *sizes, void *const *buffers, const void *embedding,
                      const void *final_norm, const int64_t *lm_head, const void *cos_table, const void *sin_table,
                      int64_t tokens, const int64_t *token, const int64_t *position, const int64_t *slot,
                      int64_t num_rows, const int64_t *tables, int64_t table_width, const int64_t *lens,
                      const int64_t *starts, const int64_t *qlens, int64_t num_logits, const int64_t *logits_rows,
                      float eps, float scale, float *logits, int64_t *argmax, int num_threads) {
    (void)layers, (void)sizes, (void)buffers, (void)embedding, (void)final_norm, (void)lm_head, (void)cos_table;
    (void)sin_table, (void)tokens, (void)token, (void)position, (void)slot, (void)num_rows, (void)tables;
    (void)table_width, (void)lens, (void)starts, (void)qlens, (void)num_logits, (void)logits_rows, (void)eps;
    (void)scale, (void)logits, (void)argmax, (void)num_threads;
    return 0; /* no AVX512-BF16: the model's Python forward runs */
}
#endif

#else
int kernel_vector_bits(void) { return 0; }
#endif
