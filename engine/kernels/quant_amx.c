/* The quantised weights' AMX kernels: the dequantising bf16 GEMM (quant_gemm_amx_bf16, quant_dequantize_amx_bf16)
 * and the AMX-INT8 GEMM on the codes themselves (quant_gemm_amx_int8). */
#include "quant_simd.h"

/* ---- AMX: dequantised once per call into B tiles, each tile reused by every row of the call -----------------
 * y = x W^T (+ bias) for many rows (batched decode, prefill) on AMX tiles, the weight staying in the layout
 * above. Per 32-output pair (two 16-row blocks) and 32 inputs the codes become one bf16 B tile per block (16
 * input pairs x 16 outputs, VNNI order): the layout's 16-bit words already hold, in lane 2i + e, row i's codes
 * of two neighbouring inputs, i.e. a B tile row once widened to float, (q - zero) * scale and rounded to bf16.
 * That is quant_dequantize_bf16's value (float32 subtract and multiply, or one fused multiply-add where that
 * is exactly the same rounding, see amx_group; one round to nearest even), so each weight is bitwise the one it
 * returns, and each output element is gemm_amx_bf16's (linear_bf16.c) on that dequantised weight: its C tile
 * element fed K in 32-wide steps in order from zero, then the bias added in float32 and one rounding. It
 * depends on its own row of x only: an M-row call is bitwise M one-row calls.
 * dequantize_tile makes one B tile (4 bits: the shift, mask and conversion of the codes in one ternary-logic op).
 * Threads take runs of AMX_RUN_PAIRS pairs from a shared counter, each run 32 rows (A tiles 4-5) x one pair
 * (B tiles 6-7) -> C tiles 0-3 per item (amx_pairs), the dequantisation paid once per call whatever M is, on
 * one of two schedules:
 * - interleaved: a ring of two pairs' tiles, the next tiles dequantised between the dot products of the current
 *   ones (8-bit codes; 4-bit up to 32 rows);
 * - panels: AMX_PANEL_BYTES of tiles dequantised (a block's codes in order), then all the rows against them.
 * The out-of-order core does not overlap the vector dequantisation with the TMUL (a call costs the two apart
 * added); the ring wins by locality (tiles read back from L1 instead of a 512 KB panel in L2), except for 4-bit
 * codes and more rows, where panels do. */
#if ISA == 512 && HAVE_AMX_BF16

int quant_amx_enable(void) { return amx_request_tiles(); }

#define AMX_RUN_PAIRS 8 /* pairs a thread takes at a time */
#define AMX_STEP_WORDS 1024 /* bf16 values of one pair's two B tiles per 32 inputs */
#define AMX_PANEL_BYTES (512 * 1024) /* a panel's dequantised tiles (L2), for all the rows */
/* With one row item per pair (up to 32 rows) the B tiles are dequantised this many K steps ahead of the
 * dot products that read them, so they are read back from L1 */
#define AMX_LEAD_STEPS 2

/* The B tile rows of one chunk's codes: its 64 bytes' 16-bit words (word 2i + e: row i, input e of each of its
 * input pairs) widened once per chunk, words 0-15 (rows 0-7) in `lo`, 16-31 in `hi`, so each input pair's codes
 * are a shift and a mask away. Its group's zeros and scales spread to those lanes (zero_lo, scale_lo: rows 0-7).
 * (q - zero) * scale is quant_dequantize_bf16's float32 subtract and multiply, or where the group allows it
 * (`fused`: every scale positive and finite, every zero an integer) one fused q * scale + (-zero * scale):
 * zero * scale is exact (two float16 values: 22 significant bits at most), q - zero is exact (integers), so
 * both are the one rounding of the same (q - zero) * scale, +0 where q = zero, bitwise the same weight. */
typedef struct {
    __m512 zero_lo, zero_hi, scale_lo, scale_hi, offset_lo, offset_hi; /* offset: -zero * scale */
    __m512 base_lo[4], base_hi[4]; /* 4 bits, `embedded`: -(AMX_NIBBLE_BASE[t] + zero) * scale */
    int fused, embedded;
} amx_group;

/* 4 bits, `embedded`: nibble t of a widened word masked in place (shifted left 11 first for t < 3: the bits
 * AMX_NIBBLE_AT[t]) under the exponent of AMX_NIBBLE_BASE[t] = 2^(23 - AMX_NIBBLE_AT[t]) is the float32
 * AMX_NIBBLE_BASE[t] + q (one ternary-logic op instead of a shift, a mask and a conversion), and
 * (base + q) * scale + (-(base + zero) * scale) is one fused multiply-add of exact terms wherever `fused` holds:
 * base + zero, for any integer a float16 holds, spans 13 significant bits at most, times the scale's 11 still
 * fits float32's 24, so it is the same one rounding of (q - zero) * scale again. */
static const int AMX_NIBBLE_AT[4] = {11, 15, 19, 12};
static const float AMX_NIBBLE_BASE[4] = {4096.0f, 256.0f, 16.0f, 2048.0f};

INLINE void amx_group_load(const int BITS, const uint16_t *scales, const uint16_t *zeros, int64_t at, amx_group *g) {
    const __m512i pairs_lo = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    const __m512i pairs_hi = _mm512_add_epi32(pairs_lo, _mm512_set1_epi32(8));
    const __m512 scale = fload_f16(scales + at);
    const __m512 zero = zeros != NULL ? fload_f16(zeros + at) : fset1(BITS == 8 ? 128.0f : 8.0f);
    const __mmask16 positive = _mm512_cmp_ps_mask(scale, _mm512_setzero_ps(), _CMP_GT_OQ) &
                               _mm512_cmp_ps_mask(scale, _mm512_set1_ps(INFINITY), _CMP_LT_OQ);
    const __mmask16 integral = _mm512_cmp_ps_mask(_mm512_roundscale_ps(zero, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC),
                                                  zero, _CMP_EQ_OQ);
    g->fused = (__mmask16)(positive & integral) == (__mmask16)0xffff;
    g->embedded = BITS == 4 && g->fused;
    const __m512 offset = _mm512_sub_ps(_mm512_setzero_ps(), _mm512_mul_ps(zero, scale));
    g->scale_lo = _mm512_permutexvar_ps(pairs_lo, scale), g->scale_hi = _mm512_permutexvar_ps(pairs_hi, scale);
    g->zero_lo = _mm512_permutexvar_ps(pairs_lo, zero), g->zero_hi = _mm512_permutexvar_ps(pairs_hi, zero);
    g->offset_lo = _mm512_permutexvar_ps(pairs_lo, offset), g->offset_hi = _mm512_permutexvar_ps(pairs_hi, offset);
    if (g->embedded)
        for (int t = 0; t < 4; t++) { /* exact: -base * scale (a power of two times it) + offset is representable */
            const __m512 base = _mm512_set1_ps(AMX_NIBBLE_BASE[t]);
            g->base_lo[t] = _mm512_fnmadd_ps(base, g->scale_lo, g->offset_lo);
            g->base_hi[t] = _mm512_fnmadd_ps(base, g->scale_hi, g->offset_hi);
        }
}

/* `embedded` (above): input pair t's B tile row from a chunk's widened words (lo: words 0-15, hi: 16-31) and
 * the same shifted left 11. */
INLINE void dequantize_row_embedded(__m512i lo, __m512i hi, __m512i lo11, __m512i hi11, const amx_group *g, int t,
                                    uint16_t *dst) {
    const __m512i mask = _mm512_set1_epi32(0xf << AMX_NIBBLE_AT[t]);
    const __m512i exponent = _mm512_castps_si512(_mm512_set1_ps(AMX_NIBBLE_BASE[t]));
    const __m512 x_lo = _mm512_castsi512_ps(_mm512_ternarylogic_epi32(t < 3 ? lo11 : lo, mask, exponent, 0xea));
    const __m512 x_hi = _mm512_castsi512_ps(_mm512_ternarylogic_epi32(t < 3 ? hi11 : hi, mask, exponent, 0xea));
    const __m512 w_lo = _mm512_fmadd_ps(x_lo, g->scale_lo, g->base_lo[t]);
    const __m512 w_hi = _mm512_fmadd_ps(x_hi, g->scale_hi, g->base_hi[t]);
    _mm512_store_si512((void *)dst, (__m512i)_mm512_cvtne2ps_pbh(w_hi, w_lo));
}

/* Input pair t of the chunk (8 bits: the low then the high bytes; 4 bits: nibbles 0-3) from its widened words. */
INLINE __m512i amx_codes(const int BITS, __m512i words32, int t) {
    if (BITS == 8) return t == 0 ? _mm512_and_si512(words32, _mm512_set1_epi32(0xff)) : _mm512_srli_epi32(words32, 8);
    if (t == 3) return _mm512_srli_epi32(words32, 12);
    const __m512i shifted = t == 0 ? words32 : _mm512_srli_epi32(words32, 4 * t);
    return _mm512_and_si512(shifted, _mm512_set1_epi32(0xf));
}

/* One B tile row (an input pair for 16 outputs) from the pair's codes (lo: words 0-15, hi: 16-31). */
INLINE void dequantize_row(__m512i q_lo, __m512i q_hi, const amx_group *g, uint16_t *dst) {
    const __m512 lo = _mm512_cvtepi32_ps(q_lo), hi = _mm512_cvtepi32_ps(q_hi);
    __m512 w_lo, w_hi;
    if (g->fused) {
        w_lo = _mm512_fmadd_ps(lo, g->scale_lo, g->offset_lo);
        w_hi = _mm512_fmadd_ps(hi, g->scale_hi, g->offset_hi);
    } else {
        w_lo = _mm512_mul_ps(_mm512_sub_ps(lo, g->zero_lo), g->scale_lo);
        w_hi = _mm512_mul_ps(_mm512_sub_ps(hi, g->zero_hi), g->scale_hi);
    }
    _mm512_store_si512((void *)dst, (__m512i)_mm512_cvtne2ps_pbh(w_hi, w_lo));
}

/* One B tile: block `block`'s 16 outputs x inputs [32 s, 32 s + 32) as 16 input pairs (rows of 32 values) at
 * dst; the pairs past k are zero. The codes stream from DRAM in batched decode: prefetched PREFETCH_CHUNKS
 * ahead in the block (a block's K in order: panels, the whole weight), or with `next_pair` the same chunk and
 * group of block + 2, the next pair's (the interleaved ring's order; panels ran slower with it). Prefetching never
 * faults. */
INLINE void dequantize_tile(const int BITS, const uint8_t *codes, const uint16_t *scales, const uint16_t *zeros,
                            int64_t block, int64_t k, int64_t group, int64_t s, int next_pair, uint16_t *dst) {
    const int64_t step = BITS == 8 ? 4 : 8, chunks = k / step, groups = k / group;
    const int64_t chunks_per_group = group / step; /* whole chunks (covered() checks it) */
    const int64_t first = s * (32 / step), last = first + 32 / step < chunks ? first + 32 / step : chunks;
    const uint8_t *base = codes + block * chunks * CHUNK;
    int64_t index = first / chunks_per_group, next = (index + 1) * chunks_per_group; /* next: group index + 1's */
    amx_group g;
    amx_group_load(BITS, scales, zeros, (block * groups + index) * BLOCK, &g);
    for (int64_t c = first; c < last; c++) {
        if (c == next) { /* no division per chunk */
            index++, next += chunks_per_group;
            amx_group_load(BITS, scales, zeros, (block * groups + index) * BLOCK, &g);
        }
        if (next_pair) {
            _mm_prefetch((const char *)(base + (2 * chunks + c) * CHUNK), _MM_HINT_T0);
            if (c == first) _mm_prefetch((const char *)(scales + ((block + 2) * groups + index) * BLOCK), _MM_HINT_T0);
        } else {
            _mm_prefetch((const char *)(base + (c + PREFETCH_CHUNKS) * CHUNK), _MM_HINT_T0);
        }
        const __m512i words = _mm512_loadu_si512((const void *)(base + c * CHUNK));
        const __m512i lo = _mm512_cvtepu16_epi32(_mm512_castsi512_si256(words));
        const __m512i hi = _mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(words, 1));
        if (BITS == 4 && g.embedded) {
            const __m512i lo11 = _mm512_slli_epi32(lo, 11), hi11 = _mm512_slli_epi32(hi, 11);
            for (int t = 0; t < 4; t++) dequantize_row_embedded(lo, hi, lo11, hi11, &g, t, dst + ((c - first) * 4 + t) * 32);
            continue;
        }
        for (int t = 0; t < step / 2; t++)
            dequantize_row(amx_codes(BITS, lo, t), amx_codes(BITS, hi, t), &g,
                           dst + ((c - first) * (step / 2) + t) * 32);
    }
    for (int64_t pair = (last - first) * (step / 2); pair < 16; pair++) /* inputs past k (k is even) */
        memset(dst + pair * 32, 0, 64);
}

/* Tile `half` (0, 1) of pair p's K step s; a block past the last (n's last pair may have one, pack_amx pads n
 * to 64) is zero weights, never stored. */
INLINE void dequantize_unit(const int BITS, const uint8_t *codes, const uint16_t *scales, const uint16_t *zeros,
                            int64_t p, int64_t half, int64_t s, int64_t blocks, int64_t k, int64_t group, int next_pair,
                            uint16_t *dst) {
    const int64_t block = 2 * p + half;
    if (block < blocks) dequantize_tile(BITS, codes, scales, zeros, block, k, group, s, next_pair, dst);
    else memset(dst, 0, 1024);
}

/* Pair p's two B tiles per step (kp / 32 * 1024 values at `tiles`). */
static void dequantize_pair(int bits, const uint8_t *codes, const uint16_t *scales, const uint16_t *zeros, int64_t p,
                            int64_t blocks, int64_t k, int64_t kp, int64_t group, uint16_t *tiles) {
    for (int64_t half = 0; half < 2; half++) /* a block's codes in order: one stream */
        for (int64_t s = 0; s < kp / 32; s++) {
            uint16_t *dst = tiles + s * AMX_STEP_WORDS + half * 512;
            if (bits == 8) dequantize_unit(8, codes, scales, zeros, p, half, s, blocks, k, group, 0, dst);
            else dequantize_unit(4, codes, scales, zeros, p, half, s, blocks, k, group, 0, dst);
        }
}

/* The whole weight dequantised into linear_bf16.c's gemm_amx_bf16 layout (kernels/cpu.py's pack_amx: n
 * padded to 64, k to 32, [n / 32][k / 32][2][16 pairs][16][2]): for row counts where that kernel's blocking
 * beats the pipelined one below; each output is bitwise the same. Returns 0 for shapes not covered. */
int quant_dequantize_amx_bf16(const void *weight, const void *scales, const void *zeros, int bits, void *out, int64_t n,
                              int64_t k, int64_t group, int num_threads) {
    if (!amx_bits(bits) || !covered(bits, n, k, group)) return 0;
    const int64_t kp = (k + 31) / 32 * 32, pairs = (n + 63) / 64 * 2, blocks = (n + BLOCK - 1) / BLOCK;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t p = 0; p < pairs; p++)
        dequantize_pair(bits, (const uint8_t *)weight, (const uint16_t *)scales, (const uint16_t *)zeros, p, blocks, k,
                        kp, group, (uint16_t *)out + p * (kp / 32) * AMX_STEP_WORDS);
    return 1;
}

/* gemm_amx_bf16's rounding (common.h round_bf16): nearest even on the bits, NaN kept */
INLINE __m512i amx_round_bf16(__m512 x) {
    const __m512i bits = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
    return _mm512_srli_epi32(_mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), bits), 16);
}

/* C tile `tile` (16 rows of 16 floats) + bias into y's rows [row0, row0 + rows), columns [col0, col0 + 16). */
INLINE void amx_store(int tile, float *scratch, const uint16_t *bias, uint16_t *y, int64_t row0, int64_t rows,
                      int64_t col0, int64_t n) {
    if (col0 >= n) return;
    switch (tile) { /* tile numbers must be immediates */
    case 0: _tile_stored(0, scratch, 64); break;
    case 1: _tile_stored(1, scratch, 64); break;
    case 2: _tile_stored(2, scratch, 64); break;
    default: _tile_stored(3, scratch, 64); break;
    }
    const __mmask16 live = n - col0 >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - col0)) - 1u);
    const __m512 b = bias != NULL ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
                                        _mm256_maskz_loadu_epi16(live, bias + col0)), 16))
                                  : _mm512_setzero_ps();
    for (int64_t r = 0; r < rows; r++) {
        __m512 value = _mm512_load_ps(scratch + 16 * r);
        if (bias != NULL) value = _mm512_add_ps(value, b);
        _mm256_mask_storeu_epi16(y + (row0 + r) * n + col0, live, _mm512_cvtepi32_epi16(amx_round_bf16(value)));
    }
}

/* The dequantisation of a thread's pairs as a stream of units (one B tile: a pair's K step, one half), written
 * into a ring of two pairs' tiles while the dot products read the other. */
typedef struct {
    const uint8_t *codes;
    const uint16_t *scales, *zeros;
    int64_t blocks, k, group, steps;
    uint16_t *ring;  /* [2][steps][1024] */
    int64_t pair, s, half; /* the next unit */
    int64_t made, total;   /* units dequantised, units of the thread's pairs */
} amx_producer;

INLINE void amx_produce(const int BITS, amx_producer *p) {
    if (p->made == p->total) return;
    uint16_t *dst = p->ring + (p->made / (2 * p->steps) % 2) * p->steps * AMX_STEP_WORDS + p->s * AMX_STEP_WORDS +
                    p->half * 512;
    dequantize_unit(BITS, p->codes, p->scales, p->zeros, p->pair, p->half, p->s, p->blocks, p->k, p->group, 1, dst);
    p->made++;
    if (++p->half == 2) {
        p->half = 0;
        if (++p->s == p->steps) p->s = 0, p->pair++;
    }
}

/* A thread's pairs [first, last) against rows [0, mp) of the (padded) x, in items of 32 rows (A tiles 4-5) x
 * one pair (B tiles 6-7) -> C tiles 0-3 (a lone last 16-row tile: C 0-1); pair p's tiles lie in slot
 * (p - first) % slots of the ring. Two schedules of the dequantisation:
 * - interleaved (a ring of 2 slots): the units dequantised `lead` ahead of the first dot product that reads them,
 *   then evenly over the pair's K steps x row items, between the dot products: one row item (up to 32 rows, each
 *   tile read once) leads by AMX_LEAD_STEPS steps (its tiles read back from L1), more items by a whole pair (its
 *   tiles re-read by every item);
 * - panels (`slots` pairs, AMX_PANEL_BYTES): every `slots` pairs dequantised first (a block's K in order), then
 *   run against all the rows. */
INLINE void amx_pairs(const int BITS, const uint16_t *a, amx_producer *producer, int interleaved, int64_t slots,
                      const uint16_t *bias, uint16_t *y, int64_t m, int64_t mp, int64_t n, int64_t kp, int64_t first,
                      int64_t last, float *scratch) {
    const int64_t steps = kp / 32, items = (mp + 31) / 32, per_pair = 2 * steps, iterations = items * steps;
    const int64_t lead = items == 1 && 2 * AMX_LEAD_STEPS < per_pair ? 2 * AMX_LEAD_STEPS : per_pair;
    while (interleaved && producer->made < lead && producer->made < producer->total) amx_produce(BITS, producer);
    int64_t owed = 0; /* Bresenham: per_pair units every `iterations` dot-product steps */
    for (int64_t p = first; p < last; p++) {
        const uint16_t *tiles = producer->ring + (p - first) % slots * steps * AMX_STEP_WORDS;
        if (!interleaved && (p - first) % slots == 0)
            for (int64_t q = p; q < last && q < p + slots; q++)
                dequantize_pair(BITS, producer->codes, producer->scales, producer->zeros, q, producer->blocks,
                                producer->k, kp, producer->group, producer->ring + (q - p) * steps * AMX_STEP_WORDS);
        for (int64_t r = 0; r < mp; r += 32) {
            const int both = r + 32 <= mp;
            const uint16_t *a0 = a + r * kp, *a1 = a0 + 16 * kp;
            _tile_zero(0);
            _tile_zero(1);
            if (both) {
                _tile_zero(2);
                _tile_zero(3);
            }
            for (int64_t s = 0; s < steps; s++) {
                const uint16_t *b = tiles + s * AMX_STEP_WORDS;
                tile_step_32x32(a0 + s * 32, a1 + s * 32, b, kp * 2, both);
                if (interleaved)
                    for (owed += per_pair; owed >= iterations; owed -= iterations) amx_produce(BITS, producer);
            }
            const int64_t rows0 = m - r < 16 ? m - r : 16, rows1 = m - r - 16 < 16 ? m - r - 16 : 16;
            amx_store(0, scratch, bias, y, r, rows0, p * 32, n);
            amx_store(1, scratch, bias, y, r, rows0, p * 32 + 16, n);
            if (both && rows1 > 0) {
                amx_store(2, scratch, bias, y, r + 16, rows1, p * 32, n);
                amx_store(3, scratch, bias, y, r + 16, rows1, p * 32 + 16, n);
            }
        }
    }
}

/* Returns 0 (nothing computed) for shapes the layout does not cover or without memory for the tiles. */
int quant_gemm_amx_bf16(const void *weight, const void *scales_, const void *zeros_, int bits, const void *x,
                        const void *bias_, void *y_, int64_t m, int64_t n, int64_t k, int64_t group, int num_threads) {
    if (m < 1 || !amx_bits(bits) || !covered(bits, n, k, group)) return 0;
    const uint16_t *bias = (const uint16_t *)bias_;
    uint16_t *y = (uint16_t *)y_;
    const int64_t kp = (k + 31) / 32 * 32, mp = (m + 15) / 16 * 16, steps = kp / 32;
    const int64_t blocks = (n + BLOCK - 1) / BLOCK, pairs = (blocks + 1) / 2;
    /* A tiles read x in place when its rows are whole 32-wide steps and whole 16-row tiles, else a
     * zero-padded copy */
    const uint16_t *a = (const uint16_t *)x;
    uint16_t *padded = NULL;
    if (kp != k || mp != m) {
        padded = (uint16_t *)calloc((size_t)(mp * kp), sizeof(uint16_t));
        if (padded == NULL) return 0;
        for (int64_t r = 0; r < m; r++) memcpy(padded + r * kp, a + r * k, (size_t)k * sizeof(uint16_t));
        a = padded;
    }
    const int64_t threads = num_threads < 1 ? 1 : (num_threads > pairs ? pairs : num_threads);
    /* interleaved for 8-bit codes and up to 32 rows, panels for 4-bit codes and more (the comment block above) */
    const int interleaved = bits == 8 || mp <= 32;
    int64_t panel = AMX_PANEL_BYTES / (steps * AMX_STEP_WORDS * (int64_t)sizeof(uint16_t));
    if (panel < 2) panel = 2;
    TileConfig config = {0};
    tile_shape(&config, 0, 8, 16, 64);
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        /* threads take runs of AMX_RUN_PAIRS pairs from a shared counter (as bf16's kernel takes its items), so
         * a thread descheduled on a shared host does not leave the other waiting with half the weight */
        const int64_t slots = interleaved ? 2 : (AMX_RUN_PAIRS < panel ? AMX_RUN_PAIRS : panel);
        uint16_t *ring = (uint16_t *)aligned_alloc(64, (size_t)(slots * steps * AMX_STEP_WORDS) * sizeof(uint16_t));
        float scratch[16 * 16] __attribute__((aligned(64)));
        failed |= ring == NULL;
        if (ring != NULL) _tile_loadconfig(&config);
        const int64_t runs = (pairs + AMX_RUN_PAIRS - 1) / AMX_RUN_PAIRS;
#pragma omp for schedule(dynamic, 1)
        for (int64_t run = 0; run < runs; run++) {
            if (ring == NULL) continue; /* this thread found no memory: the call fails */
            const int64_t first = run * AMX_RUN_PAIRS, last = pairs - first < AMX_RUN_PAIRS ? pairs : first + AMX_RUN_PAIRS;
            amx_producer producer = {(const uint8_t *)weight, (const uint16_t *)scales_, (const uint16_t *)zeros_,
                                     blocks, k, group, steps, ring, first, 0, 0, 0, (last - first) * 2 * steps};
            if (bits == 8)
                amx_pairs(8, a, &producer, interleaved, slots, bias, y, m, mp, n, kp, first, last, scratch);
            else
                amx_pairs(4, a, &producer, interleaved, slots, bias, y, m, mp, n, kp, first, last, scratch);
        }
        if (ring != NULL) _tile_release();
        free(ring);
    }
    free(padded);
    return !failed;
}
#else
int quant_amx_enable(void) { return 0; }
int quant_dequantize_amx_bf16(const void *weight, const void *scales, const void *zeros, int bits, void *out, int64_t n,
                              int64_t k, int64_t group, int num_threads) {
    (void)weight, (void)scales, (void)zeros, (void)bits, (void)out, (void)n, (void)k, (void)group, (void)num_threads;
    return 0;
}
int quant_gemm_amx_bf16(const void *weight, const void *scales, const void *zeros, int bits, const void *x,
                        const void *bias, void *y, int64_t m, int64_t n, int64_t k, int64_t group, int num_threads) {
    (void)weight, (void)scales, (void)zeros, (void)bits, (void)x, (void)bias, (void)y, (void)m, (void)n, (void)k,
        (void)group, (void)num_threads;
    return 0; /* no AMX in this build: the caller keeps its other paths */
}
#endif

/* ---- AMX-INT8: the codes themselves as B tiles, the GEMV's integer arithmetic on tiles ------------------
 * y = x W^T (+ bias) for many rows with the GEMV's own arithmetic: x as int16 per x block (prepare_block),
 * D = sum xq * q an exact int32 per x block, then scale * xscale * (D - zero * xsum) accumulated in float over
 * the x blocks in order, the bias added and one rounding. So every output is bitwise quant_gemv_bf16's, an
 * M-row call is bitwise M one-row calls, and a row's result does not depend on how many rows the batch has.
 * AMX-INT8 multiplies bytes: xq = 256 * hi + lo (hi signed, lo unsigned), D = 256 * (hi . q) + (lo . q),
 * two TDPB*D per tile pair, each exact in int32 (|hi . q| <= 128 * 255 * 256 per x block).
 * The 8-bit layout's 64-byte chunk (16 outputs x 4 inputs) is already an AMX-INT8 B tile row, its 4 bytes of
 * output i being inputs 4c + {0, 2, 1, 3}: 16 chunks of a block are a B tile loaded from the weight in place,
 * and x's bytes are permuted the same way. A 4-bit chunk (16 outputs x 8 inputs) gives two tile rows, its low
 * nibbles (inputs 8c + {0, 4, 1, 5}) and high nibbles (8c + {2, 6, 3, 7}), expanded once per call and pair.
 * Against the dequantising kernel above this reads half the bytes (8 bits) and does no per-weight float work:
 * what it adds is the per-row, per-x-block epilogue, so it wins where x blocks are long (per-channel int8,
 * groups of 128) and the rows few enough (see layers/quantization.py's policy). x blocks of 64 inputs and up
 * run 64-input tiles, 32 (groups of 32) half-depth ones. */
#if ISA == 512 && HAVE_AMX_INT8

/* 32 int16 codes of x as the two byte planes A tiles read (hi: signed, lo: unsigned, xq = 256 hi + lo), the
 * inputs permuted within each 8 as the B tile rows hold them (8 bits: {0, 2, 1, 3, 4, 6, 5, 7}; 4 bits:
 * {0, 4, 1, 5, 2, 6, 3, 7}). */
INLINE void split_words(__m512i words, int8_t *hi, uint8_t *lo, int bits) {
    const __m512i order = bits == 8 ? _mm512_set_epi16(31, 29, 30, 28, 27, 25, 26, 24, 23, 21, 22, 20, 19, 17, 18, 16,
                                                       15, 13, 14, 12, 11, 9, 10, 8, 7, 5, 6, 4, 3, 1, 2, 0)
                                    : _mm512_set_epi16(31, 27, 30, 26, 29, 25, 28, 24, 23, 19, 22, 18, 21, 17, 20, 16,
                                                       15, 11, 14, 10, 13, 9, 12, 8, 7, 3, 6, 2, 5, 1, 4, 0);
    words = _mm512_permutexvar_epi16(order, words);
    _mm256_storeu_si256((__m256i *)hi, _mm512_cvtepi16_epi8(_mm512_srai_epi16(words, 8)));
    _mm256_storeu_si256((__m256i *)lo, _mm512_cvtepi16_epi8(_mm512_and_si512(words, _mm512_set1_epi16(0xff))));
}

/* One x block (size a multiple of 32) quantised as prepare_block_512 does, bitwise its codes, scale and sum,
 * written straight as the byte planes (no int16 copy of x: per call a 64-row, 1536-input int16 buffer was
 * an mmap and 48 page faults). A block with a NaN or a magnitude above 3e38 goes to prepare_block. */
static void prepare_split_block(const uint16_t *src, int8_t *hi, uint8_t *lo, int64_t size, int bits, float *xscale,
                                float *xsum) {
    float largest;
    if (!block_largest(src, size, &largest)) {
        int16_t codes[X_BLOCK_MAX];
        prepare_block(src, codes, size, xscale, xsum);
        for (int64_t i = 0; i < size; i += 32)
            split_words(_mm512_loadu_si512((const void *)(codes + i)), hi + i, lo + i, bits);
        return;
    }
    const float inverse = largest > 0.0f ? 32767.0f / largest : 0.0f;
    const __m512 scale = _mm512_set1_ps(inverse);
    __m512i sum = _mm512_setzero_si512();
    for (int64_t i = 0; i < size; i += 32) {
        const __m512i raw = _mm512_loadu_si512((const void *)(src + i));
        const __m512 v0 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(raw)), 16));
        const __m512 v1 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(raw, 1)), 16));
        const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, scale)), q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, scale));
        sum = _mm512_add_epi32(sum, _mm512_add_epi32(q0, q1));
        split_words(_mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi32_epi16(q0)), _mm512_cvtepi32_epi16(q1), 1),
                    hi + i, lo + i, bits);
    }
    *xscale = inverse > 0.0f ? largest / 32767.0f : 0.0f;
    *xsum = (float)_mm512_reduce_add_epi32(sum);
}

/* A 4-bit block's codes as AMX-INT8 B tile rows: chunk c -> rows 2c (low nibbles), 2c + 1 (high nibbles). */
static void expand_nibbles(const uint8_t *codes, int64_t chunks, uint8_t *rows) {
    const __m512i low = _mm512_set1_epi8(0x0f);
    for (int64_t c = 0; c < chunks; c++) {
        const __m512i chunk = _mm512_loadu_si512((const void *)(codes + c * CHUNK));
        _mm512_store_si512((void *)(rows + 2 * c * CHUNK), _mm512_and_si512(chunk, low));
        _mm512_store_si512((void *)(rows + (2 * c + 1) * CHUNK), _mm512_and_si512(_mm512_srli_epi16(chunk, 4), low));
    }
}

/* One x block of 16 rows against a pair's B tiles (tiles 6, 7; `both`: the pair's second block exists) into C
 * tiles 0-3 = hi.B0, lo.B0, hi.B1, lo.B1. */
INLINE void int_x_block(const int8_t *hi, const uint8_t *lo, int64_t k, const uint8_t *b0, const uint8_t *b1,
                        int64_t tile_rows, int64_t depth, int64_t steps, int both) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t s = 0; s < steps; s++) {
        _tile_loadd(4, hi + s * depth, k);
        _tile_loadd(5, lo + s * depth, k);
        _tile_loadd(6, b0 + s * tile_rows * CHUNK, CHUNK);
        _tile_dpbsud(0, 4, 6);
        _tile_dpbuud(1, 5, 6);
        if (both) {
            _tile_loadd(7, b1 + s * tile_rows * CHUNK, CHUNK);
            _tile_dpbsud(2, 4, 7);
            _tile_dpbuud(3, 5, 7);
        }
    }
}

/* C tiles 0-3 to out [4][16][16] int32 */
INLINE void int_store(int both, int32_t *out) {
    _tile_stored(0, out, 64);
    _tile_stored(1, out + 256, 64);
    if (both) {
        _tile_stored(2, out + 512, 64);
        _tile_stored(3, out + 768, 64);
    }
}

/* The GEMV's per-x-block update of 16 rows x 16 outputs: acc += (D - zero * xsum) * (scale * xscale). */
INLINE void int_accumulate(const int32_t *d_hi, const int32_t *d_lo, __m512 scale, __m512 zero, const float *xsum,
                           const float *xscale, int64_t x_blocks, int64_t rows, float *acc) {
    for (int64_t r = 0; r < rows; r++) {
        const __m512i d = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512((const void *)(d_hi + 16 * r)), 8),
                                           _mm512_load_si512((const void *)(d_lo + 16 * r)));
        const __m512 exact = _mm512_fnmadd_ps(zero, _mm512_set1_ps(xsum[r * x_blocks]), _mm512_cvtepi32_ps(d));
        const __m512 factor = _mm512_mul_ps(scale, _mm512_set1_ps(xscale[r * x_blocks]));
        _mm512_store_ps(acc + 16 * r, _mm512_fmadd_ps(exact, factor, _mm512_load_ps(acc + 16 * r)));
    }
}

/* One call's operands. */
typedef struct {
    const Prepared *prep;
    const int8_t *a_hi;
    const uint8_t *a_lo, *codes;
    const uint16_t *scales, *zeros, *bias;
    uint16_t *y;
    int64_t m, n, k, group, blocks, chunks, block_bytes, depth;
    int bits;
} IntCall;

/* One work item: 16 rows (from r0) x pair p x x block xb; its B tiles at b, its accumulators at acc, its
 * products stored to out. */
typedef struct {
    int64_t p, r0, xb;
    const uint8_t *b;
    float *acc;
    int32_t *out;
    int both;
} IntItem;

INLINE void int_issue(const IntCall *c, const IntItem *it) {
    const int64_t x_block = c->prep->x_block;
    const uint8_t *b0 = it->b + it->xb * (x_block / 4) * CHUNK;
    int_x_block(c->a_hi + it->r0 * c->k + it->xb * x_block, c->a_lo + it->r0 * c->k + it->xb * x_block, c->k, b0,
                b0 + c->block_bytes, c->depth / 4, c->depth, x_block / c->depth, it->both);
}

/* The item's stored products into its accumulators. */
static void int_epilogue(const IntCall *c, const IntItem *it) {
    const int64_t x_blocks = c->prep->x_blocks, g = it->xb * c->prep->x_block / c->group, groups = c->k / c->group;
    const int64_t rows = c->m - it->r0 < 16 ? c->m - it->r0 : 16;
    const __m512 midpoint = _mm512_set1_ps(c->bits == 8 ? 128.0f : 8.0f);
    for (int64_t half = 0; half < 1 + it->both; half++) {
        const int64_t at = ((2 * it->p + half) * groups + g) * BLOCK;
        const __m512 scale = fload_f16(c->scales + at), zero = c->zeros != NULL ? fload_f16(c->zeros + at) : midpoint;
        int_accumulate(it->out + half * 512, it->out + half * 512 + 256, scale, zero,
                       c->prep->xsum + it->r0 * x_blocks + it->xb, c->prep->xscale + it->r0 * x_blocks + it->xb,
                       x_blocks, rows, it->acc + half * 256);
    }
}

/* The item's accumulators + bias, rounded once, into y. */
static void int_finish(const IntCall *c, const IntItem *it) {
    const int64_t rows = c->m - it->r0 < 16 ? c->m - it->r0 : 16;
    for (int64_t half = 0; half < 1 + it->both; half++) {
        const int64_t col0 = (2 * it->p + half) * BLOCK, n = c->n;
        const __mmask16 live = n - col0 >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - col0)) - 1u);
        const __m512 add = c->bias != NULL ? _mm512_castsi512_ps(_mm512_slli_epi32(
                                                 _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(live, c->bias + col0)), 16))
                                           : _mm512_setzero_ps(); /* the GEMV adds 0.0f without a bias too */
        for (int64_t r = 0; r < rows; r++)
            _mm256_mask_storeu_epi16(c->y + (it->r0 + r) * n + col0, live,
                                     round_bf16_exact(_mm512_add_ps(_mm512_load_ps(it->acc + half * 256 + 16 * r), add)));
    }
}

#define INT_GROUP_PAIRS 4 /* pairs (128 outputs) whose accumulators a thread keeps while the x blocks go by */
#define INT_PANEL_ROWS 64 /* rows per pass over the weight */

/* Rows [r_start, r_start + 16 * tiles) against pairs [g0, g1) (their B tiles at b[p - g0]): x blocks outermost,
 * so an x block's slice of x (64 rows x 256 inputs x 2 planes: 32 KB) stays in L1 while every pair of the group
 * uses it, and each pair's tiles of that x block stay in L1 for every row tile. The epilogue of an item runs
 * after the next item's tile products are issued and before they are stored, so the vector work overlaps
 * the TMUL's and never reads a tile store still in flight (right after the store it cost as much as the tiles). */
static void int_group(const IntCall *c, const uint8_t *const *b, int64_t g0, int64_t g1, int64_t r_start,
                      int64_t tiles, float *acc, int32_t *scratch) {
    memset(acc, 0, sizeof(float) * 512 * (size_t)((g1 - g0) * tiles));
    IntItem pending = {0};
    int64_t count = 0;
    for (int64_t xb = 0; xb < c->prep->x_blocks; xb++)
        for (int64_t p = g0; p < g1; p++)
            for (int64_t t = 0; t < tiles; t++, count++) {
                const IntItem item = {p, r_start + 16 * t, xb, b[p - g0], acc + ((p - g0) * tiles + t) * 512,
                                      scratch + (count & 1) * 1024, 2 * p + 1 < c->blocks};
                int_issue(c, &item);
                if (count > 0) int_epilogue(c, &pending);
                int_store(item.both, item.out);
                pending = item;
            }
    int_epilogue(c, &pending);
    for (int64_t p = g0; p < g1; p++)
        for (int64_t t = 0; t < tiles; t++) {
            const IntItem item = {p, r_start + 16 * t, 0, NULL, acc + ((p - g0) * tiles + t) * 512, NULL,
                                  2 * p + 1 < c->blocks};
            int_finish(c, &item);
        }
}

/* Row r of x as its int16 blocks split into the high and low byte planes a_hi, a_lo (rows past m: zero, never
 * stored). */
INLINE void int_split_row(const uint16_t *x, const Prepared *prep, int8_t *a_hi, uint8_t *a_lo, int64_t r, int64_t m,
                          int64_t k, int bits) {
    const int64_t x_block = prep->x_block;
    if (r < m) {
        for (int64_t xb = 0; xb < prep->x_blocks; xb++)
            prepare_split_block(x + r * k + xb * x_block, a_hi + r * k + xb * x_block, a_lo + r * k + xb * x_block,
                                x_block, bits, prep->xscale + r * prep->x_blocks + xb, prep->xsum + r * prep->x_blocks + xb);
        return;
    }
    memset(a_hi + r * k, 0, (size_t)k), memset(a_lo + r * k, 0, (size_t)k);
    for (int64_t xb = 0; xb < prep->x_blocks; xb++)
        prep->xscale[r * prep->x_blocks + xb] = 0.0f, prep->xsum[r * prep->x_blocks + xb] = 0.0f;
}

/* Returns 0 (nothing computed) for shapes it does not cover (x blocks not a multiple of 32 inputs) or without
 * memory; the caller keeps its other paths. */
int quant_gemm_amx_int8(const void *weight, const void *scales_, const void *zeros_, int bits, const void *x,
                        const void *bias_, void *y_, int64_t m, int64_t n, int64_t k, int64_t group, int num_threads) {
    if (m < 1 || !amx_bits(bits) || !covered(bits, n, k, group)) return 0;
    const int64_t x_block = x_block_of(group, bits);
    if (x_block % 32) return 0;
    const int64_t depth = x_block % 64 == 0 ? 64 : 32, mp = (m + 15) / 16 * 16;
    const int64_t blocks = (n + BLOCK - 1) / BLOCK, pairs = (blocks + 1) / 2, chunks = k / step_of(bits);
    Prepared prep = {0};
    prep.x_block = x_block, prep.x_blocks = k / x_block;
    prep.xscale = (float *)malloc(sizeof(float) * (size_t)(mp * prep.x_blocks));
    prep.xsum = (float *)malloc(sizeof(float) * (size_t)(mp * prep.x_blocks));
    int8_t *a_hi = (int8_t *)aligned_alloc(64, (size_t)(mp * k));
    uint8_t *a_lo = (uint8_t *)aligned_alloc(64, (size_t)(mp * k));
    if (prep.xscale == NULL || prep.xsum == NULL || a_hi == NULL || a_lo == NULL) {
        free(prep.xscale), free(prep.xsum), free(a_hi), free(a_lo);
        return 0;
    }
    /* 4 bits: a pair's expanded tile rows (2 blocks x 2 rows a chunk); 8 bits: read in place */
    const IntCall call = {&prep, a_hi, a_lo, (const uint8_t *)weight, (const uint16_t *)scales_,
                          (const uint16_t *)zeros_, (const uint16_t *)bias_, (uint16_t *)y_, m, n, k, group, blocks,
                          chunks, bits == 8 ? chunks * CHUNK : 2 * chunks * CHUNK, depth, bits};
    const int64_t threads = num_threads < 1 ? 1 : (num_threads > pairs ? pairs : num_threads);
    TileConfig config = {0};
    tile_shape(&config, 0, 4, 16, 64);                /* C: 16 x 16 int32 */
    tile_shape(&config, 4, 2, 16, (int)depth);        /* A: 16 x depth */
    tile_shape(&config, 6, 2, (int)(depth / 4), 64);  /* B: depth/4 x 64 */
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < mp; r++) int_split_row((const uint16_t *)x, &prep, a_hi, a_lo, r, m, k, bits);
        int32_t *scratch = (int32_t *)aligned_alloc(64, sizeof(int32_t) * 2048);
        float *acc = (float *)aligned_alloc(64, sizeof(float) * 512 * INT_GROUP_PAIRS * (INT_PANEL_ROWS / 16));
        uint8_t *expanded = bits == 4 ? (uint8_t *)aligned_alloc(64, (size_t)(INT_GROUP_PAIRS * 2 * call.block_bytes))
                                      : NULL;
        const int ok = scratch != NULL && acc != NULL && (bits == 8 || expanded != NULL);
        failed |= !ok;
        if (ok) _tile_loadconfig(&config);
        /* threads take groups of pairs from a shared counter (as bf16's kernel takes its items), so a thread
         * descheduled on a shared host does not leave the other waiting at the end with half the weight */
        const int64_t pair_groups = (pairs + INT_GROUP_PAIRS - 1) / INT_GROUP_PAIRS;
        for (int64_t r_start = 0; r_start < m; r_start += INT_PANEL_ROWS) {
            const int64_t rows = m - r_start < INT_PANEL_ROWS ? m - r_start : INT_PANEL_ROWS;
#pragma omp for schedule(dynamic, 1) nowait
            for (int64_t group_index = 0; group_index < pair_groups; group_index++) {
                if (!ok) continue; /* this thread found no memory: the call fails */
                const int64_t g0 = group_index * INT_GROUP_PAIRS;
                const int64_t g1 = pairs - g0 < INT_GROUP_PAIRS ? pairs : g0 + INT_GROUP_PAIRS;
                const uint8_t *b[INT_GROUP_PAIRS];
                for (int64_t p = g0; p < g1; p++) {
                    const uint8_t *codes = call.codes + 2 * p * chunks * CHUNK;
                    if (bits == 8) {
                        b[p - g0] = codes;
                        continue;
                    }
                    uint8_t *rows_of = expanded + (p - g0) * 2 * call.block_bytes;
                    expand_nibbles(codes, chunks, rows_of);
                    if (2 * p + 1 < blocks) expand_nibbles(codes + chunks * CHUNK, chunks, rows_of + call.block_bytes);
                    b[p - g0] = rows_of;
                }
                int_group(&call, b, g0, g1, r_start, (rows + 15) / 16, acc, scratch);
            }
        }
        if (ok) _tile_release();
        free(scratch), free(acc), free(expanded);
    }
    free(prep.xscale), free(prep.xsum), free(a_hi), free(a_lo);
    return !failed;
}
#else
int quant_gemm_amx_int8(const void *weight, const void *scales, const void *zeros, int bits, const void *x,
                        const void *bias, void *y, int64_t m, int64_t n, int64_t k, int64_t group, int num_threads) {
    (void)weight, (void)scales, (void)zeros, (void)bits, (void)x, (void)bias, (void)y, (void)m, (void)n, (void)k,
        (void)group, (void)num_threads;
    return 0; /* no AMX-INT8 in this build: the caller keeps its other paths */
}
#endif
