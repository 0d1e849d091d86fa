/* Native CPU kernels, compiled on the machine that runs them (kernels/cpu_native.py builds this file with the
 * system's C compiler, -O3 -march=native -fopenmp, and loads it with ctypes after torch, so that its OpenMP
 * regions run on torch's own libgomp and thread pool).
 *
 * Why C: on CPU the decode attention of a small model is bound by memory latency and by the per-call overhead of
 * tiny matrix products, not by arithmetic. torch's SDPA flash kernel runs each (sequence, kv head) as two small
 * GEMMs of G query rows, and needs the keys contiguous, which the engine bought with a per-layer copy of every
 * decode row's K/V (DecodeKVMirror). Here each (sequence, kv head) is one loop over its own blocks, read in place
 * from the paged cache, with the G query heads of the kv head sharing every key and value load.
 *
 * Layouts (float32 throughout):
 *   q      [B, H, D]      row stride q_row (floats), heads contiguous, H = KVH * G (the G query heads of kv head
 *                         h are h*G .. h*G+G-1, as transformers' repeat_kv orders them);
 *   caches [KVH, NB, BS, D] contiguous: the heads-major storage of kernels/cpu.py's allocate_kv_cache;
 *   tables [B, W] int32   row-major block tables (column c holds keys c*BS .. c*BS+BS-1);
 *   lens   [B] int32      keys per sequence (>= 1); the query sits at position lens[b] - 1;
 *   out    [B, H, D]      contiguous.
 * window > 0: only the last `window` keys are seen (sliding-window attention); softcap > 0: scores become
 * softcap * tanh(score / softcap) before the softmax (Gemma 2).
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#define MAX_GROUP 16  /* query heads per kv head (cpu_native.py checks it) */
#define MAX_HEAD_DIM 256

/* exp(x) in float32 within 2 ulp (tests/test_cpu_native.py checks it against torch.exp), written so that the
 * compiler vectorizes the loops that call it: libm's expf is a scalar call (no vector variant without
 * -ffast-math, which would also drop NaN and infinity semantics). Cephes' method: x = n ln2 + r with n rounded
 * to nearest and |r| <= ln2/2, exp(r) by a degree-6 polynomial, times 2^n built from its exponent bits. Inputs
 * are clamped to [-87.3, 88], where 2^n stays a normal float (so below it the result is ~1e-38 rather than a
 * denormal or 0, and above it 1.65e38 rather than up to 3.4e38 or infinity: what softmax and silu read is the
 * same); NaN stays NaN (the comparisons are false for it). */
static inline float exp_f32(float x)
{
    x = x < -87.3f ? -87.3f : x;
    x = x > 88.0f ? 88.0f : x;
    const float shifter = 12582912.0f;  /* 1.5 * 2^23: adding it rounds to an integer (no floorf call) */
    const float n = (x * 1.44269504088896341f + shifter) - shifter;
    const float r = (x - n * 0.693359375f) - n * -2.12194440e-4f;  /* ln 2 in two parts: exact n * hi */
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    union { int32_t i; float f; } scale = { .i = ((int32_t)n + 127) << 23 };
    return p * scale.f;
}

/* One (sequence, kv head): scores over keys [first, last) into `scores` [G, last - first], softmax, then the
 * weighted sum of values into o [G, D]. DD and GG fix the head size and group at compile time (0: read the run
 * time values), which lets the compiler keep the G x D accumulators in registers for the common shapes. */
#define DEFINE_ITEM(NAME, DD, GG)                                                                                \
    static void NAME(const float *qb, const float *kc, const float *vc, const int32_t *table, int64_t first,      \
                     int64_t last, int64_t head_base, int BS, float scale, float softcap, float *scores,          \
                     float *o, int g_rt, int d_rt)                                                                \
    {                                                                                                             \
        const int D = DD ? DD : d_rt, G = GG ? GG : g_rt;                                                         \
        const int64_t n = last - first;                                                                           \
        float mx[MAX_GROUP], inv[MAX_GROUP];                                                                      \
        for (int g = 0; g < G; g++) mx[g] = -FLT_MAX;                                                             \
        for (int64_t t = first; t < last; t++) {                                                                  \
            const float *k = kc + ((head_base + table[t / BS]) * BS + t % BS) * D;                                \
            for (int g = 0; g < G; g++) {                                                                         \
                const float *qg = qb + g * D;                                                                     \
                float s = 0.f;                                                                                    \
                _Pragma("omp simd reduction(+:s)") for (int d = 0; d < D; d++) s += qg[d] * k[d];                \
                s *= scale;                                                                                       \
                if (softcap > 0.f) s = softcap * tanhf(s / softcap);                                              \
                scores[g * n + (t - first)] = s;                                                                  \
                mx[g] = s > mx[g] ? s : mx[g];                                                                    \
            }                                                                                                     \
        }                                                                                                         \
        for (int g = 0; g < G; g++) {                                                                             \
            float *sg = scores + g * n, sum = 0.f;                                                                \
            const float m = mx[g];                                                                                \
            _Pragma("omp simd reduction(+:sum)") for (int64_t t = 0; t < n; t++) {                               \
                const float e = exp_f32(sg[t] - m);                                                                  \
                sg[t] = e;                                                                                        \
                sum += e;                                                                                         \
            }                                                                                                     \
            inv[g] = 1.f / sum;                                                                                   \
        }                                                                                                         \
        float acc[(GG ? GG : MAX_GROUP) * (DD ? DD : MAX_HEAD_DIM)];                                              \
        for (int i = 0; i < G * D; i++) acc[i] = 0.f;                                                             \
        for (int64_t t = first; t < last; t++) {                                                                  \
            const float *v = vc + ((head_base + table[t / BS]) * BS + t % BS) * D;                                \
            for (int g = 0; g < G; g++) {                                                                         \
                const float p = scores[g * n + (t - first)];                                                      \
                _Pragma("omp simd") for (int d = 0; d < D; d++) acc[g * D + d] += p * v[d];                      \
            }                                                                                                     \
        }                                                                                                         \
        for (int g = 0; g < G; g++)                                                                               \
            for (int d = 0; d < D; d++) o[g * D + d] = acc[g * D + d] * inv[g];                                   \
    }

DEFINE_ITEM(item_d64_g2, 64, 2)
DEFINE_ITEM(item_d64_g4, 64, 4)
DEFINE_ITEM(item_d128_g4, 128, 4)
DEFINE_ITEM(item_d128_g8, 128, 8)
DEFINE_ITEM(item_any, 0, 0)

/* Decode attention, one query row per sequence (see the layouts above). Returns 0; -1 when the shapes are outside
 * what this file supports (the caller checks first; this is the last line of defence); -2 when a scratch buffer
 * could not be allocated (the output is then incomplete). */
int ae_decode_attention_f32(const float *q, int64_t q_row, const float *k_cache, const float *v_cache,
                            const int32_t *tables, int64_t table_width, const int32_t *lens, float *out,
                            int B, int H, int KVH, int D, int BS, int64_t NB, float scale, int window,
                            float softcap, int num_threads)
{
    if (KVH <= 0 || H % KVH != 0 || H / KVH > MAX_GROUP || D > MAX_HEAD_DIM || BS <= 0) return -1;
    const int G = H / KVH;
    int out_of_memory = 0;
#pragma omp parallel num_threads(num_threads)
    {
        float *scores = NULL;  /* this thread's [G, keys] scratch, grown as needed */
        int64_t capacity = 0;
#pragma omp for schedule(static)
        for (int64_t item = 0; item < (int64_t)B * KVH; item++) {
            const int b = (int)(item / KVH), h = (int)(item % KVH);
            const int64_t last = lens[b];
            const int64_t first = (window > 0 && last > window) ? last - window : 0;
            if ((last - first) * G > capacity) {
                free(scores);
                capacity = 2 * (last - first) * G;
                scores = malloc(capacity * sizeof(float));
                if (scores == NULL) {
                    capacity = 0;
                    out_of_memory = 1;  /* (a benign race: every writer stores 1) */
                    continue;
                }
            }
            const float *qb = q + b * q_row + (int64_t)h * G * D;
            const int32_t *table = tables + b * table_width;
            float *o = out + ((int64_t)b * H + (int64_t)h * G) * D;
            const int64_t head_base = (int64_t)h * NB;
#define RUN(FN) FN(qb, k_cache, v_cache, table, first, last, head_base, BS, scale, softcap, scores, o, G, D)
            if (D == 64 && G == 2) RUN(item_d64_g2);
            else if (D == 64 && G == 4) RUN(item_d64_g4);
            else if (D == 128 && G == 4) RUN(item_d128_g4);
            else if (D == 128 && G == 8) RUN(item_d128_g8);
            else RUN(item_any);
#undef RUN
        }
        free(scores);
    }
    return out_of_memory ? -2 : 0;
}

/* -- element-wise work of a decoder layer, one pass over each row instead of torch's five to seven ops --------- */

/* RMSNorm of each row of x [T, H] (row stride x_row), times weight [H], into out [T, H] contiguous; with
 * residual [T, H] contiguous (non-NULL), first residual += x and the norm is taken of the new residual. The sum of
 * squares is float32, as torch's float32 rms_norm. */
void ae_rms_norm_f32(const float *x, int64_t x_row, float *residual, const float *weight, float *out, int64_t T,
                     int H, float eps, int num_threads)
{
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t t = 0; t < T; t++) {
        const float *xr = x + t * x_row;
        const float *src = xr;
        if (residual != NULL) {
            float *r = residual + t * H;
#pragma omp simd
            for (int i = 0; i < H; i++) r[i] += xr[i];
            src = r;
        }
        float sum = 0.f;
#pragma omp simd reduction(+:sum)
        for (int i = 0; i < H; i++) sum += src[i] * src[i];
        const float inv = 1.f / sqrtf(sum / (float)H + eps);
        float *o = out + t * H;
#pragma omp simd
        for (int i = 0; i < H; i++) o[i] = src[i] * inv * weight[i];
    }
}

/* x [T, 2I] = [gate | up] (row stride x_row) -> out [T, I] contiguous = silu(gate) * up. */
void ae_silu_and_mul_f32(const float *x, int64_t x_row, float *out, int64_t T, int I, int num_threads)
{
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t t = 0; t < T; t++) {
        const float *gate = x + t * x_row, *up = gate + I;
        float *o = out + t * I;
#pragma omp simd
        for (int i = 0; i < I; i++) o[i] = gate[i] / (1.f + exp_f32(-gate[i])) * up[i];
    }
}

/* This step's keys and values into a heads-major cache: key, value [T, KVH, D] (row strides key_row, value_row;
 * heads contiguous) -> k_cache, v_cache [KVH, num_slots, D] at slots [T] (int64). Returns -1, having written
 * nothing, when a slot is outside [0, num_slots); else 0. One pass instead of two index_copy_ calls (torch's took ~44 us each at 64 rows of 2 x 64 floats). */
int ae_write_kv_f32(const float *key, int64_t key_row, const float *value, int64_t value_row, float *k_cache,
                    float *v_cache, const int64_t *slots, int64_t T, int KVH, int D, int64_t num_slots)
{
    for (int64_t t = 0; t < T; t++)
        if (slots[t] < 0 || slots[t] >= num_slots) return -1;  /* nothing written */
    for (int64_t t = 0; t < T; t++) {
        for (int h = 0; h < KVH; h++) {
            float *k = k_cache + ((int64_t)h * num_slots + slots[t]) * D;
            float *v = v_cache + ((int64_t)h * num_slots + slots[t]) * D;
            const float *ks = key + t * key_row + (int64_t)h * D, *vs = value + t * value_row + (int64_t)h * D;
#pragma omp simd
            for (int d = 0; d < D; d++) {
                k[d] = ks[d];
                v[d] = vs[d];
            }
        }
    }
    return 0;
}

/* The first index of each row's largest value, NaN counting as largest (torch.argmax's rule): x [S, V] with row
 * stride x_row, contiguous rows -> out [S] int64. Two passes over the row (it stays in L1/L2): its maximum and
 * whether it holds a NaN (vectorized), then the first index of that value (or of the first NaN). */
void ae_argmax_rows_f32(const float *x, int64_t x_row, int64_t S, int64_t V, int64_t *out, int num_threads)
{
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t s = 0; s < S; s++) {
        const float *row = x + s * x_row;
        float best = -INFINITY;
        int has_nan = 0;
#pragma omp simd reduction(max:best) reduction(|:has_nan)
        for (int64_t v = 0; v < V; v++) {
            best = row[v] > best ? row[v] : best;
            has_nan |= row[v] != row[v];
        }
        int64_t at = 0;
        if (has_nan) {
            while (row[at] == row[at]) at++;
        } else {
            while (row[at] != best) at++;
        }
        out[s] = at;
    }
}

/* Rotary embedding, neox style, in place: x [T, heads, D] (row stride x_row, heads contiguous); cos_sin [P, D] =
 * [cos | sin] of each position (D/2 each, contiguous); positions [T] int64. Per head, with x1 the first half and
 * x2 the second: x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin. Returns -1, having changed nothing, when a position
 * is outside [0, P); else 0. */
int ae_rotary_neox_f32(float *x, int64_t x_row, int64_t T, int heads, int D, const int64_t *positions,
                       const float *cos_sin, int64_t P)
{
    for (int64_t t = 0; t < T; t++)
        if (positions[t] < 0 || positions[t] >= P) return -1;
    const int half = D / 2;
    for (int64_t t = 0; t < T; t++) {
        const float *cos = cos_sin + positions[t] * D, *sin = cos + half;
        for (int h = 0; h < heads; h++) {
            float *x1 = x + t * x_row + (int64_t)h * D, *x2 = x1 + half;
#pragma omp simd
            for (int i = 0; i < half; i++) {
                const float a = x1[i], b = x2[i];
                x1[i] = a * cos[i] - b * sin[i];
                x2[i] = b * cos[i] + a * sin[i];
            }
        }
    }
    return 0;
}
