/* Declarations shared by the CPU library's files (attention.c, elementwise.c, linear_bf16.c, decode_step.c): the
 * vector helpers several of them inline, paged attention's call, and the library-internal entry points the decode
 * step calls. Everything here needs AVX-512 (kernel_vector_bits() is 0 and the library otherwise empty). */
#ifndef LLMCTL_KERNELS_CPU_INTERNAL_H
#define LLMCTL_KERNELS_CPU_INTERNAL_H
#include "common.h"

#if HAVE_AVX512
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

#define PREFETCH_ROWS 16 /* the next block of key rows, while this one is scored */
#define MAX_GROUP 16
#define TILE_QUERIES 48 /* query heads (tokens x group) per paged-attention work item */

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

/* attention.c */
HIDDEN void attend_queries_bf16(const PagedCall *call, int64_t item, int64_t from, int64_t to);
HIDDEN int attention_tiles_available(void); /* bf16 attention runs on AMX tiles in this process */
HIDDEN void attention_tiles_load(void);     /* this thread's tile configuration for it */
void paged_attention_bf16(const void *q, int64_t q_stride, const void *k_pool, const void *v_pool,
                          const int64_t *tables, int64_t table_stride, const int64_t *lens, const int64_t *starts,
                          const int64_t *qlens, void *out, int64_t num_rows, int64_t num_heads, int64_t num_kv_heads,
                          int64_t head_dim, int64_t num_blocks, int64_t block_size, float scale, int64_t window,
                          int num_threads);

/* elementwise.c: the bf16 ops on one row (the decode step's threads run them on their own rows) and on many */
HIDDEN void rms_norm_row_bf16(const void *x, void *residual, const void *weight, void *out, int64_t base, int64_t dim,
                              float eps);
HIDDEN void silu_and_mul_row_bf16(const void *gate_up, void *out, int64_t r, int64_t size);
HIDDEN void rotary_heads_bf16(void *x, int64_t r, int64_t row_stride, int64_t first_head, int64_t last_head,
                              int64_t head_dim, const void *cos, const void *sin);
HIDDEN int64_t argmax_row(const float *row, int64_t width);
void rms_norm_bf16(const void *x, void *residual, const void *weight, void *out, int64_t rows, int64_t dim, float eps,
                   int num_threads);
void silu_and_mul_bf16(const void *gate_up, void *out, int64_t rows, int64_t size, int num_threads);
void rotary_bf16(void *x, int64_t rows, int64_t row_stride, int64_t heads, int64_t head_dim, const void *cos,
                 const void *sin, int num_threads);
void write_kv_bf16(const void *k, int64_t k_stride, const void *v, int64_t v_stride, void *k_pool, void *v_pool,
                   const int64_t *slots, int64_t rows, int64_t kv_heads, int64_t head_dim, int64_t pool_slots,
                   int num_threads);

/* linear_bf16.c */
HIDDEN void gemv_bf16_share(const uint16_t *weight, const uint16_t *vector, const void *bias, void *y, int64_t n,
                            int64_t k, int64_t me, int64_t threads);
int gemv_bf16(const void *w, const void *x, const void *bias, void *y, int64_t n, int64_t k, int num_threads);
int gemm_amx_bf16(const void *packed, const void *x, const void *bias, void *y, int64_t m, int64_t n, int64_t k,
                  int num_threads);
#endif
#endif
