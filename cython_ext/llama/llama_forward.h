/* The decoder step of the llama family (llama, gemma3, qwen2, qwen3: one pass parameterised by
 * the model's description below) over T new rows of one or more sequences, each with its own
 * fp16 KV cache: RMSNorm, RoPE ("norm" pairing (2i, 2i+1) or NEOX pairing (i, i + d/2), optional
 * per-dimension frequency factors), optional q/k biases and per-head q/k RMSNorm, grouped-query
 * attention under an arbitrary mask (and a sliding window on some layers), optional norms of the
 * attention and FFN outputs before each residual add, a SiLU- or GELU(tanh)-gated FFN, a
 * quantized head. Weights are packed GGUF blocks (llama_kernels.h). Arguments are validated by
 * the caller (cython_ext/llama/llama.pyx). */
#ifndef DSPARK_LLAMA_FORWARD_H
#define DSPARK_LLAMA_FORWARD_H

#include <stddef.h>
#include <stdint.h>
#include "llama_kernels.h"

typedef struct {
    const float *attn_norm, *ffn_norm;  /* [hidden] */
    const float *post_attn_norm, *post_ffn_norm;  /* [hidden] or NULL: norm of the block's output */
    const float *q_norm, *k_norm;       /* [head_dim] or NULL: RMSNorm of each q / k head */
    const float *qkv_bias;              /* [(n_head + 2 n_kv) head_dim] or NULL */
    llama_matrix qkv[3];                /* q, k, v projections of the normed input */
    llama_matrix wo;
    llama_matrix gate_up[2];            /* gate, up */
    llama_matrix down;
    size_t window;                      /* > 0: a row sees only slots less than `window` positions back */
    int local_rope;                     /* RoPE with rope_base_local instead of rope_base */
} llama_layer;

typedef struct {
    size_t n_layer, hidden, ffn, n_head, n_kv, head_dim, vocab;
    float rms_eps;
    double rope_base, rope_base_local;
    int rope_neox;              /* 1: RoPE rotates pairs (i, i + head_dim / 2); 0: (2i, 2i + 1) */
    int ffn_gelu;               /* 1: gelu_tanh(gate) * up; 0: silu(gate) * up */
    float embed_scale;          /* the embedding rows are multiplied by this (1: unchanged) */
    const float *rope_factors;  /* [head_dim / 2] or NULL: divisors of each RoPE frequency */
    llama_matrix embed;     /* token embeddings as vocab columns x hidden inputs */
    llama_matrix head;      /* output projection (the embeddings when tied) */
    const float *out_norm;  /* [hidden] */
    const llama_layer *layers;
} llama_model;

/* One sequence's new rows. Cache: k [n_layer][n_kv][cap / 16][head_dim][16] (keys of 16 slots
 * transposed per block), v [n_layer][n_kv][cap][head_dim], both fp16; slots past `length`
 * receive the t new rows. Row i sees slot j < length + t where mask[i * (length + t) + j]. */
typedef struct {
    uint16_t *k, *v;
    size_t cap, length, t;
    const int32_t *tokens;
    const int64_t *positions;
    const int64_t *past_positions;  /* [length] positions of the cached slots (sliding windows), or NULL: slot j is position j */
    const uint8_t *mask;
} llama_segment;

typedef struct {
    const llama_segment *segs;
    size_t n_segs;
    const float *inputs;        /* [rows][hidden] the rows' inputs, or NULL: their tokens' embeddings */
    const llama_matrix *head;   /* NULL: the model's head */
    const int32_t *logit_rows;  /* rows (over all segments, in order) that get logits */
    size_t n_logit_rows;
    float *logits;              /* [n_logit_rows][head->n] */
    const int32_t *tap_layers;  /* layers whose output rows are copied to taps */
    size_t n_taps;
    float *taps;                /* [rows][n_taps * hidden], or NULL */
} llama_request;

typedef struct llama_pool llama_pool;

/* A pool of `threads` threads including the caller; runs one forward at a time. */
llama_pool *llama_pool_new(int threads);
void llama_pool_free(llama_pool *pool);
int llama_pool_threads(const llama_pool *pool);

/* Returns 0, or -1 when scratch memory could not be had. */
int llama_forward(const llama_model *m, const llama_kernels *kern, llama_pool *pool,
                  const llama_request *req);

/* logits[rows][head->n] = head(RMSNorm(hidden)) for hidden [rows][model hidden]; with norm == 0
 * head(hidden) for hidden [rows][head->k]. 0 or -1 (memory). */
int llama_project(const llama_model *m, const llama_kernels *kern, llama_pool *pool,
                  const float *hidden, size_t rows, const llama_matrix *head, int norm,
                  float *logits);

/* x[:hidden] = embedding of token (dequantized from the packed embedding matrix). */
void llama_embed_row(const llama_model *m, int32_t token, float *x);
#endif
