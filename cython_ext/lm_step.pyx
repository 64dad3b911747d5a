# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""The speculative LM's forward pass in C (lm_forward.c); wrapped by dspark.decoding.lm.KernelLM."""
import numpy as np

from libc.stdint cimport int64_t, uint8_t
from libc.stdlib cimport calloc, free, malloc


cdef extern from "lm_forward.h" nogil:
    ctypedef struct dspark_lm_layer:
        const float *ln1_w, *ln1_b, *qkv_w, *qkv_b, *proj_w, *proj_b
        const float *ln2_w, *ln2_b, *fc_w, *fc_b, *fc_proj_w, *fc_proj_b
    ctypedef struct dspark_lm_model:
        size_t n_layer, d_model, n_head, head_dim, ff, vocab
        const float *tok_emb, *tok_emb_t, *lnf_w, *lnf_b, *neg_slopes
    int dspark_lm_forward(const dspark_lm_model *m, const dspark_lm_layer *layers,
                          float *const *keys, float *const *values, const int64_t *tokens,
                          const int64_t *positions, size_t t, const uint8_t *mask,
                          size_t length, const int64_t *key_positions, float *logits)


cdef extern from "cblas.h" nogil:
    void scipy_openblas_set_num_threads(int threads)


cdef const float *_ptr(dict arrays, str name) except NULL:
    cdef const float[::1] view = arrays[name].reshape(-1)
    return &view[0]


cdef class LMStep:
    """Holds the weights (float32, C order; kept alive here) and runs forward passes.

    Sets the process's scipy-openblas32 (used only by dspark's kernels) to one thread: a draft
    step is too small to split, and more threads would fight the target's session for cores."""
    cdef dspark_lm_model model
    cdef dspark_lm_layer *layers
    cdef dict arrays

    def __cinit__(self, dict weights, size_t n_layer, size_t n_head, size_t vocab):
        cdef dspark_lm_layer *L
        cdef size_t i
        scipy_openblas_set_num_threads(1)
        self.arrays = {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in weights.items()}
        cdef size_t d = self.arrays["tok_emb"].shape[1]
        self.model.n_layer, self.model.d_model, self.model.n_head = n_layer, d, n_head
        self.model.head_dim, self.model.vocab = d // n_head, vocab
        self.model.ff = self.arrays["h0.fc.w"].shape[1]
        self.model.tok_emb = _ptr(self.arrays, "tok_emb")
        self.model.tok_emb_t = _ptr(self.arrays, "tok_emb_t")
        self.model.lnf_w = _ptr(self.arrays, "lnf.w")
        self.model.lnf_b = _ptr(self.arrays, "lnf.b")
        self.model.neg_slopes = _ptr(self.arrays, "neg_slopes")
        self.layers = <dspark_lm_layer *>calloc(n_layer, sizeof(dspark_lm_layer))
        if self.layers == NULL:
            raise MemoryError("LMStep: no memory for the layer table")
        for i in range(n_layer):
            p = f"h{i}."
            L = &self.layers[i]
            L.ln1_w, L.ln1_b = _ptr(self.arrays, p + "ln1.w"), _ptr(self.arrays, p + "ln1.b")
            L.qkv_w, L.qkv_b = _ptr(self.arrays, p + "qkv.w"), _ptr(self.arrays, p + "qkv.b")
            L.proj_w, L.proj_b = _ptr(self.arrays, p + "proj.w"), _ptr(self.arrays, p + "proj.b")
            L.ln2_w, L.ln2_b = _ptr(self.arrays, p + "ln2.w"), _ptr(self.arrays, p + "ln2.b")
            L.fc_w, L.fc_b = _ptr(self.arrays, p + "fc.w"), _ptr(self.arrays, p + "fc.b")
            L.fc_proj_w = _ptr(self.arrays, p + "fc_proj.w")
            L.fc_proj_b = _ptr(self.arrays, p + "fc_proj.b")

    def __dealloc__(self):
        free(self.layers)

    def forward(self, list keys, list values, const int64_t[::1] tokens not None,
                const int64_t[::1] positions not None, const uint8_t[:, ::1] mask not None,
                size_t length, const int64_t[::1] key_positions not None,
                float[:, ::1] logits not None):
        """Shapes are checked by KernelLM; keys[i] / values[i] are C-order float32 caches.
        The cache pointers go per call (not into the shared layer table): requests run
        concurrently on their own threads over one LMStep."""
        cdef size_t i, n = self.model.n_layer, t = tokens.shape[0]
        cdef float[::1] k, v
        cdef int rc
        cdef float **ptrs = <float **>malloc(2 * n * sizeof(float *))
        if ptrs == NULL:
            raise MemoryError("LMStep: no memory for the cache table")
        try:
            for i in range(n):
                k = keys[i].reshape(-1)
                v = values[i].reshape(-1)
                ptrs[i], ptrs[n + i] = &k[0], &v[0]
            with nogil:
                rc = dspark_lm_forward(&self.model, self.layers, ptrs, ptrs + n, &tokens[0],
                                       &positions[0], t, &mask[0, 0], length, &key_positions[0],
                                       &logits[0, 0])
        finally:
            free(ptrs)
        if rc != 0:
            raise MemoryError("LMStep: no memory for the forward pass's scratch")
