/* Attention of a few query rows over one sequence's KV cache, each row on its own prefix, for CPUs.
 *
 * Why: the lean forward (ssd.models.fast) attends row by row, so that a verified position is the very
 * computation the same position makes when decoded alone; through torch that is one SDPA call per row
 * and layer (~50-90 us each on one core, most of it the call), which cost a 1.5B model's token ~2.5 ms
 * and 8 rows ~20 ms. Here every row and head of a forward is one task of one C call.
 *
 * Exactness: a task's numbers depend on its own row, head and prefix alone, whatever else the call
 * holds, and every sum has one fixed order. Sums over the head dimension and over keys run in 16
 * lanes (element l of every 16th) and end in the same fixed tree as qmatmul.c's; the exponential is
 * one polynomial written out in fused multiply-adds. The AVX512 path and the portable one perform the
 * same operations in the same order, so they give the same bits (tested).
 *
 * Also RoPE in place on a layer's queries and keys (ssd_rope), as transformers computes it.
 *
 * Per task (row i, query head h, kv head h / (heads / kv_heads), keys 0 .. start + i):
 *   s_j = tree(q . k_j) * scale,  p_j = exp(s_j - max_j s_j),  out = (sum_j p_j v_j) / tree(sum_j p_j)
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define LANES 16

int ssd_current_isa(void); /* qmatmul.c: 2 = AVX512-VNNI, whose hosts have AVX512F */

static inline float tree16(float *v) { /* lanes i + 8, then i + 4, i + 2, i + 1 */
    for (int width = LANES / 2; width >= 1; width /= 2)
        for (int i = 0; i < width; ++i) v[i] = v[i] + v[i + width];
    return v[0];
}

/* exp(x) for x <= 0 (Cephes' expf polynomial), one operation at a time. Below -87.3 it is exp(-87.3)
   (~1e-38): no softmax weight that small changes a sum. */
static const float LOG2E = 1.44269504088896341f, LN2_HI = 0.693359375f, LN2_LO = -2.12194440e-4f;
static const float C0 = 1.9875691500e-4f, C1 = 1.3981999507e-3f, C2 = 8.3334519073e-3f, C3 = 4.1665795894e-2f,
                   C4 = 1.6666665459e-1f, C5 = 5.0000001201e-1f, FLOOR = -87.3f, CEILING = 88.0f;

static inline float exp_portable(float x) {
    x = fmaxf(x, FLOOR);
    float n = nearbyintf(x * LOG2E);
    float r = fmaf(n, -LN2_HI, x);
    r = fmaf(n, -LN2_LO, r);
    float poly = fmaf(fmaf(fmaf(fmaf(fmaf(C0, r, C1), r, C2), r, C3), r, C4), r, C5);
    float y = fmaf(poly, r * r, r) + 1.0f;
    uint32_t bits = (uint32_t)((int)n + 127) << 23;
    float two_n;
    memcpy(&two_n, &bits, 4);
    return y * two_n;
}

static void task_portable(const float *q, const float *keys, const float *values, int dim, int64_t n, float scale,
                          float *p, float *out) {
    float lanes[LANES], top = -INFINITY;
    for (int64_t j = 0; j < n; ++j) {
        const float *k = keys + j * dim;
        memset(lanes, 0, sizeof lanes);
        for (int c = 0; c < dim; c += LANES)
            for (int l = 0; l < LANES; ++l) lanes[l] = fmaf(q[c + l], k[c + l], lanes[l]);
        p[j] = tree16(lanes) * scale;
        top = fmaxf(top, p[j]);
    }
    memset(lanes, 0, sizeof lanes);
    for (int64_t j0 = 0; j0 < n; j0 += LANES)
        for (int l = 0; l < LANES; ++l) {
            float e = j0 + l < n ? exp_portable(p[j0 + l] - top) : 0.0f;
            if (j0 + l < n) p[j0 + l] = e;
            lanes[l] = lanes[l] + e;
        }
    float total = tree16(lanes);
    for (int d = 0; d < dim; ++d) out[d] = 0.0f;
    for (int64_t j = 0; j < n; ++j)
        for (int d = 0; d < dim; ++d) out[d] = fmaf(p[j], values[j * dim + d], out[d]);
    for (int d = 0; d < dim; ++d) out[d] = out[d] / total;
}

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define AVX512 __attribute__((target("avx512f,avx512dq,avx512vl,fma")))

AVX512 static inline float tree_avx512(__m512 v) {
    __m256 h = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
    __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    q = _mm_add_ps(q, _mm_movehl_ps(q, q));
    return _mm_cvtss_f32(_mm_add_ss(q, _mm_movehdup_ps(q)));
}

AVX512 static inline __m512 exp_avx512(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(FLOOR));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(LOG2E)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(-LN2_HI), x);
    r = _mm512_fmadd_ps(n, _mm512_set1_ps(-LN2_LO), r);
    __m512 poly = _mm512_set1_ps(C0);
    poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(C1));
    poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(C2));
    poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(C3));
    poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(C4));
    poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(C5));
    __m512 y = _mm512_add_ps(_mm512_fmadd_ps(poly, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.0f));
    __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(y, _mm512_castsi512_ps(bits));
}

/* ssd_silu_mul's whole vectors of 16; returns how many values it did. */
AVX512 static int64_t silu_mul_avx512(const float *g, const float *u, float *a, int64_t inter) {
    int64_t c = 0;
    for (; c + LANES <= inter; c += LANES) {
        __m512 gv = _mm512_loadu_ps(g + c);
        __m512 e = exp_avx512(_mm512_min_ps(_mm512_sub_ps(_mm512_setzero_ps(), gv), _mm512_set1_ps(CEILING)));
        __m512 silu = _mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
        _mm512_storeu_ps(a + c, _mm512_mul_ps(silu, _mm512_loadu_ps(u + c)));
    }
    return c;
}

enum { MAX_CHUNKS = 16 }; /* head dimensions up to 256 */

AVX512 static void task_avx512(const float *q, const float *keys, const float *values, int dim, int64_t n, float scale,
                               float *p, float *out) {
    const int chunks = dim / LANES;
    __m512 qv[MAX_CHUNKS], acc[MAX_CHUNKS];
    for (int c = 0; c < chunks; ++c) qv[c] = _mm512_loadu_ps(q + LANES * c);
    float top = -INFINITY;
    for (int64_t j = 0; j < n; ++j) {
        const float *k = keys + j * dim;
        __m512 lanes = _mm512_setzero_ps();
        for (int c = 0; c < chunks; ++c) lanes = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(k + LANES * c), lanes);
        p[j] = tree_avx512(lanes) * scale;
        top = fmaxf(top, p[j]);
    }
    __m512 sums = _mm512_setzero_ps(), topv = _mm512_set1_ps(top);
    for (int64_t j0 = 0; j0 < n; j0 += LANES) {
        __mmask16 live = n - j0 >= LANES ? 0xFFFF : (__mmask16)((1u << (n - j0)) - 1);
        __m512 e = _mm512_maskz_mov_ps(live, exp_avx512(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, p + j0), topv)));
        _mm512_mask_storeu_ps(p + j0, live, e);
        sums = _mm512_add_ps(sums, e);
    }
    float total = tree_avx512(sums);
    for (int c = 0; c < chunks; ++c) acc[c] = _mm512_setzero_ps();
    for (int64_t j = 0; j < n; ++j) {
        __m512 weight = _mm512_set1_ps(p[j]);
        for (int c = 0; c < chunks; ++c) acc[c] = _mm512_fmadd_ps(weight, _mm512_loadu_ps(values + j * dim + LANES * c), acc[c]);
    }
    for (int c = 0; c < chunks; ++c) _mm512_storeu_ps(out + LANES * c, _mm512_div_ps(acc[c], _mm512_set1_ps(total)));
}
#endif

/* The head dimension must be a multiple of 16 (at most 256 on the AVX512 path); 0 if it is not. */
int ssd_attention_supports(int dim) { return dim > 0 && dim % LANES == 0 && dim <= LANES * 16; }

/* out[i, h, :] for rows i < m, heads h < heads. q (row i, head h) at q + i * q_row + h * q_head;
   keys and values [kv_heads, capacity, dim]; out (row i, head h) at out + i * out_row + h * dim.
   Row i attends keys 0 .. start + i. AVX512 where qmatmul.c's chosen instruction set is AVX512-VNNI,
   else portable C (the same bits). Returns 0, or -1 when out of memory. */
int ssd_attend_rows(const float *q, int64_t q_row, int64_t q_head, const float *keys, const float *values,
                     int64_t capacity, int heads, int kv_heads, int dim, int64_t start, int64_t m, float scale,
                     float *out, int64_t out_row, int threads) {
    const int group = heads / kv_heads;
    const int64_t tasks = m * heads;
    int vector = 0, failed = 0;
#if defined(__x86_64__) || defined(__i386__)
    vector = ssd_current_isa() == 2;
#endif
#pragma omp parallel num_threads(threads > 1 && tasks > 1 ? threads : 1)
    {
        float *p = malloc(sizeof(float) * (size_t)(start + m + LANES)); /* one task's weights */
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tasks; ++t) {
            if (p == NULL) { failed = 1; continue; }
            int64_t i = t / heads;
            int h = (int)(t % heads);
            const float *qi = q + i * q_row + h * q_head;
            const int64_t base = (int64_t)(h / group) * capacity * dim;
            float *o = out + i * out_row + (int64_t)h * dim;
#if defined(__x86_64__) || defined(__i386__)
            if (vector) {
                task_avx512(qi, keys + base, values + base, dim, start + i + 1, scale, p, o);
                continue;
            }
#endif
            task_portable(qi, keys + base, values + base, dim, start + i + 1, scale, p, o);
        }
        free(p);
    }
    return failed ? -1 : 0;
}

/* RoPE in place, as transformers' apply_rotary_pos_emb computes it: x * cos + rotate_half(x) * sin,
   rotate_half(x) = (-x2, x1); each product rounded, then their sum (so the same bits as torch's).
   x: `rows` rows of `heads` heads of `dim` values, (row i, head h) at x + i * row + h * dim;
   cos, sin: [rows, dim]. */
void ssd_rope(float *x, int64_t rows, int heads, int dim, int64_t row, const float *cos, const float *sin) {
    const int half = dim / 2;
    for (int64_t i = 0; i < rows; ++i)
        for (int h = 0; h < heads; ++h) {
            float *p = x + i * row + (int64_t)h * dim;
            const float *c = cos + i * dim, *s = sin + i * dim;
            for (int d = 0; d < half; ++d) {
                float a = p[d], b = p[d + half];
                float first = a * c[d], second = (-b) * s[d];
                float third = b * c[d + half], fourth = a * s[d + half];
                p[d] = first + second;
                p[d + half] = third + fourth;
            }
        }
}

/* SiLU(g) * u for the gated MLP (layer.c): act[i, c] = (g / (1 + exp(-g))) * u, g = gu[i, c],
   u = gu[i, inter + c]; exp as above with its argument at most 88 (finite). The AVX512 and
   portable paths perform the same operations, so the same bits. */
void ssd_silu_mul(const float *gu, int64_t n, int64_t inter, float *act) {
    int vector = 0;
#if defined(__x86_64__) || defined(__i386__)
    vector = ssd_current_isa() == 2;
#endif
    for (int64_t i = 0; i < n; ++i) {
        const float *g = gu + i * 2 * inter, *u = g + inter;
        float *a = act + i * inter;
        int64_t c = 0;
#if defined(__x86_64__) || defined(__i386__)
        if (vector) {
            c = silu_mul_avx512(g, u, a, inter);
        }
#endif
        for (; c < inter; ++c) a[c] = (g[c] / (1.0f + exp_portable(fminf(-g[c], CEILING)))) * u[c];
    }
}

