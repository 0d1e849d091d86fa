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
                const float e = expf(sg[t] - m);                                                                  \
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
