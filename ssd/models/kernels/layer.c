/* One decoder layer of a model on the GGUF kernels in one C call: the lean forward's per-layer
 * Python (module calls, views, the SiLU and residual adds between the C products: ~150 us a layer,
 * ~4 ms of a 23 ms two-thread token of the 1.5B target) removed from decode and verification.
 *
 * The same operations as ssd.models.fast's layer on these models, in the same order:
 *   h = prepare(x, input norm) -> q, k, v = products (+ bias) -> RoPE(q, k) -> each segment's k, v
 *   into its cache, its rows attended (attention.c) -> x += o_proj(prepare(attention))
 *   -> g, u = products(prepare(x, post-attention norm)) -> x += down(prepare(silu(g) * u)),
 * with silu(g) = g / (1 + exp(-g)) (attention.c's ssd_silu_mul, its exponential a polynomial, so not
 * torch's SiLU to the last bit: the Python layer calls the same function, so both paths agree). Unmasked segments of at most
 * ROW_LIMIT rows only; the caller keeps the Python layer for the rest (prefill, tree masks).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define QK 256

int ssd_prepare_rows(const float *x, int64_t rows, int64_t cols, int64_t padded, const float *weight, float eps,
                     int8_t *q, float *scale, float *bsum);
void ssd_matmul(const uint8_t *weights, int fmt, int64_t channels, int64_t cols, const int8_t *q, const float *scale,
                const float *bsum, int64_t rows, float *out, int64_t out_stride, int threads);
int ssd_attend_rows(const float *q, int64_t q_row, int64_t q_head, const float *keys, const float *values,
                    int64_t capacity, int heads, int kv_heads, int dim, int64_t start, int64_t m, float scale,
                    float *out, int64_t out_row, int threads);
void ssd_rope(float *x, int64_t rows, int heads, int dim, int64_t row, const float *cos, const float *sin);
void ssd_silu_mul(const float *gu, int64_t n, int64_t inter, float *act);

/* A layer's weights: what ssd.models.kernels.layer.LayerWeights fills once per model. */
typedef struct {
    const uint8_t *qkv[3];     /* q, k, v blocks */
    int qkv_fmt[3];
    const float *qkv_bias;     /* [(heads + 2 kv_heads) dim] or NULL */
    const float *input_norm;   /* [hidden] */
    const uint8_t *o;
    int o_fmt;
    const uint8_t *gate_up[2];
    int gate_up_fmt[2];
    const float *post_norm;    /* [hidden] */
    const uint8_t *down;
    int down_fmt;
    float eps, scale;          /* RMSNorm's epsilon; attention's scale */
    int64_t hidden, hidden_padded, inter, inter_padded, attn_padded;
    int heads, kv_heads, dim;
} LayerWeights;

/* A forward's segments: segment s writes its `length[s]` rows at `start[s]` of its cache, whose
   keys and values for this layer are keys[s], values[s] ([kv_heads, capacity[s], dim]). */
typedef struct {
    int count;
    const int64_t *start, *length, *capacity;
    float *const *keys, *const *values;
} Segments;

/* Quantized rows: n * padded int8, then scales and group sums (in the caller's workspace). */
typedef struct {
    int8_t *q;
    float *scale, *bsum;
} Prepared;

static int64_t widest(const LayerWeights *w) {
    int64_t most = w->hidden_padded > w->inter_padded ? w->hidden_padded : w->inter_padded;
    return most > w->attn_padded ? most : w->attn_padded;
}

static int64_t float_count(const LayerWeights *w, int64_t n) {
    const int64_t qd = (int64_t)w->heads * w->dim, kvd = (int64_t)w->kv_heads * w->dim;
    const int64_t most = widest(w);
    return n * ((qd + 2 * kvd) + qd + w->hidden + 3 * w->inter + most / QK + most / 16);
}

/* Bytes of workspace ssd_decoder_layer needs for n rows (the caller keeps one, so no call
   allocates: fresh pages cost ~3 ms a token at 8 rows). */
int64_t ssd_decoder_layer_workspace(const LayerWeights *w, int64_t n) {
    return 4 * float_count(w, n) + n * widest(w) + 64 * 10; /* each of 9 parts starts on a cache line */
}

/* `at` rounded up to a cache line: the products' activation loads are 64 bytes, and a load across two
   lines costs two (an unaligned activation buffer made 8 rows ~20% slower). */
static void *line(void *at) { return (void *)(((uintptr_t)at + 63) & ~(uintptr_t)63); }

/* out[n, channels] (row stride out_stride) = the products of the prepared rows with one weight part */
static void product(const Prepared *p, const uint8_t *weights, int fmt, int64_t channels, int64_t padded, int64_t n,
                    float *out, int64_t out_stride, int threads) {
    ssd_matmul(weights, fmt, channels, padded, p->q, p->scale, p->bsum, n, out, out_stride, threads);
}

/* x [n, hidden] in place through one layer; cos, sin [n, dim]; workspace: at least
   ssd_decoder_layer_workspace(w, n) bytes, 4-byte aligned. Returns 0, or -1 out of memory. */
int ssd_decoder_layer(const LayerWeights *w, float *x, int64_t n, const float *cos, const float *sin,
                      const Segments *seg, void *workspace, int threads) {
    const int64_t qd = (int64_t)w->heads * w->dim, kvd = (int64_t)w->kv_heads * w->dim, width = qd + 2 * kvd;
    const int64_t most = widest(w);
    float *qkv = line(workspace), *attn = line(qkv + n * width), *tmp = line(attn + n * qd);
    float *gu = line(tmp + n * w->hidden), *act = line(gu + 2 * n * w->inter);
    Prepared p = {.scale = line(act + n * w->inter)};
    p.bsum = line(p.scale + n * (most / QK));
    p.q = line(p.bsum + n * (most / 16));

    /* attention block */
    if (ssd_prepare_rows(x, n, w->hidden, w->hidden_padded, w->input_norm, w->eps, p.q, p.scale, p.bsum)) goto oom;
    const int64_t sizes[3] = {qd, kvd, kvd}, offsets[3] = {0, qd, qd + kvd};
    for (int part = 0; part < 3; ++part)
        product(&p, w->qkv[part], w->qkv_fmt[part], sizes[part], w->hidden_padded, n, qkv + offsets[part], width,
                threads);
    if (w->qkv_bias)
        for (int64_t i = 0; i < n; ++i)
            for (int64_t c = 0; c < width; ++c) qkv[i * width + c] = qkv[i * width + c] + w->qkv_bias[c];
    ssd_rope(qkv, n, w->heads, w->dim, width, cos, sin);
    ssd_rope(qkv + qd, n, w->kv_heads, w->dim, width, cos, sin);
    int64_t row0 = 0;
    for (int s = 0; s < seg->count; ++s) {
        const int64_t start = seg->start[s], m = seg->length[s], cap = seg->capacity[s];
        for (int64_t i = 0; i < m; ++i)
            for (int h = 0; h < w->kv_heads; ++h) {
                const float *k = qkv + (row0 + i) * width + qd + (int64_t)h * w->dim;
                memcpy(seg->keys[s] + ((int64_t)h * cap + start + i) * w->dim, k, sizeof(float) * (size_t)w->dim);
                memcpy(seg->values[s] + ((int64_t)h * cap + start + i) * w->dim, k + kvd, sizeof(float) * (size_t)w->dim);
            }
        if (ssd_attend_rows(qkv + row0 * width, width, w->dim, seg->keys[s], seg->values[s], cap, w->heads,
                            w->kv_heads, w->dim, start, m, w->scale, attn + row0 * qd, qd, threads))
            goto oom;
        row0 += m;
    }
    if (ssd_prepare_rows(attn, n, qd, w->attn_padded, NULL, 0.0f, p.q, p.scale, p.bsum)) goto oom;
    product(&p, w->o, w->o_fmt, w->hidden, w->attn_padded, n, tmp, w->hidden, threads);
    for (int64_t i = 0; i < n * w->hidden; ++i) x[i] = x[i] + tmp[i];

    /* MLP block */
    if (ssd_prepare_rows(x, n, w->hidden, w->hidden_padded, w->post_norm, w->eps, p.q, p.scale, p.bsum)) goto oom;
    for (int part = 0; part < 2; ++part)
        product(&p, w->gate_up[part], w->gate_up_fmt[part], w->inter, w->hidden_padded, n, gu + part * w->inter,
                2 * w->inter, threads);
    ssd_silu_mul(gu, n, w->inter, act);
    if (ssd_prepare_rows(act, n, w->inter, w->inter_padded, NULL, 0.0f, p.q, p.scale, p.bsum)) goto oom;
    product(&p, w->down, w->down_fmt, w->hidden, w->inter_padded, n, tmp, w->hidden, threads);
    for (int64_t i = 0; i < n * w->hidden; ++i) x[i] = x[i] + tmp[i];
    return 0;
oom:
    return -1;
}
