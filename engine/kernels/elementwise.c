/* Fused elementwise ops (RMSNorm, SiLU*mul, RoPE, the K/V scatter, argmax): one pass over memory instead of
 * torch's 3-8 ops, rounding where torch's bf16 path rounds. */
#include "cpu_internal.h"

#if HAVE_AVX512

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

/* Rotate-half RoPE in place, heads [first_head, last_head) of row r (row stride `row_stride` elements); cos/sin
 * [rows, head_dim / 2] in x's dtype, one row per token. Heads [first_head, last_head) of row r (each element's rotation is its own: any split of the heads gives
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
/* The argmax of a float32 row of `width` >= 1: torch.argmax's answer, the first maximum, or the first NaN of a row
 * that holds one; two vector passes instead of torch's scalar loop. */
INLINE int64_t argmax_of(const float *row, int64_t width) {
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

/* Row-wise argmax_of of float32 rows [rows, width] (width >= 1). */
void argmax_f32(const float *x, int64_t rows, int64_t width, int64_t *out) {
    for (int64_t r = 0; r < rows; r++) out[r] = argmax_of(x + r * width, width);
}

HIDDEN int64_t argmax_row(const float *row, int64_t width) { return argmax_of(row, width); }

HIDDEN void rms_norm_row_bf16(const void *x, void *residual, const void *weight, void *out, int64_t base, int64_t dim,
                              float eps) {
    rms_norm_row(x, residual, weight, out, base, dim, eps, 1);
}
HIDDEN void silu_and_mul_row_bf16(const void *gate_up, void *out, int64_t r, int64_t size) {
    silu_and_mul_row(gate_up, out, r, size, 1);
}
HIDDEN void rotary_heads_bf16(void *x, int64_t r, int64_t row_stride, int64_t first_head, int64_t last_head,
                              int64_t head_dim, const void *cos, const void *sin) {
    rotary_heads(x, r, row_stride, first_head, last_head, head_dim, cos, sin, 1);
}
#endif
