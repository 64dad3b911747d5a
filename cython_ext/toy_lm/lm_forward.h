#ifndef DSPARK_LM_FORWARD_H
#define DSPARK_LM_FORWARD_H
#include <stddef.h>
#include <stdint.h>

/* One forward pass of the speculative LM (the graph of dspark/decoding/onnx_lm.py: pre-LN,
 * ALiBi, tanh GELU, tied embeddings) over a preallocated KV cache, in C over OpenBLAS.
 * It exists for the draft model: a 0.5 M-parameter step is a few hundred kFLOP, and ORT's
 * per-node overhead made up most of a draft call. */
typedef struct {
    const float *ln1_w, *ln1_b;
    const float *qkv_w, *qkv_b;     /* [d, 2d + H (Dh + 1)]: q, k, then per head Dh values + a 1 */
    const float *proj_w, *proj_b;   /* [d, d] */
    const float *ln2_w, *ln2_b;
    const float *fc_w, *fc_b;       /* [d, ff] */
    const float *fc_proj_w, *fc_proj_b;  /* [ff, d] */
} dspark_lm_layer;

typedef struct {
    size_t n_layer, d_model, n_head, head_dim, ff, vocab;
    const float *tok_emb;    /* [vocab, d] */
    const float *tok_emb_t;  /* [d, vocab] */
    const float *lnf_w, *lnf_b;
    const float *neg_slopes; /* [H] */
} dspark_lm_model;

/* Runs t new tokens after `length` cached rows: writes their keys/values into cache slots
 * length..length+t-1 (keys[i]: layer i's [slots, H, Dh], values[i]: [slots, H, Dh + 1]), lets
 * row r see key s where mask[r * (length + t) + s] != 0, and writes logits[t, vocab]. key_positions holds length + t positions (the new ones last).
 * Returns 0, or -1 when scratch memory could not be had. */
int dspark_lm_forward(const dspark_lm_model *m, const dspark_lm_layer *layers,
                      float *const *keys, float *const *values, const int64_t *tokens,
                      const int64_t *positions, size_t t, const uint8_t *mask, size_t length,
                      const int64_t *key_positions, float *logits);
#endif
