# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""The speculative LM's forward pass in C (lm_forward.c); wrapped by dspark.runtimes.toy_lm.runtime.KernelLM."""
import numpy as np
cimport numpy as cnp

from libc.stdint cimport int64_t, uint8_t
from libc.stdlib cimport calloc, free, malloc

cnp.import_array()


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


def _expected_shapes(size_t n_layer, size_t d, size_t n_head, size_t ff, size_t vocab) -> dict:
    """Every weight the C forward pass reads, with the shape it assumes (vectors: their size)."""
    qkv_n = 2 * d + n_head * (d // n_head + 1)
    shapes = {"tok_emb": (vocab, d), "tok_emb_t": (d, vocab), "lnf.w": (d,), "lnf.b": (d,),
              "neg_slopes": (n_head,)}
    layer = {"ln1.w": (d,), "ln1.b": (d,), "qkv.w": (d, qkv_n), "qkv.b": (qkv_n,), "proj.w": (d, d),
             "proj.b": (d,), "ln2.w": (d,), "ln2.b": (d,), "fc.w": (d, ff), "fc.b": (ff,),
             "fc_proj.w": (ff, d), "fc_proj.b": (d,)}
    for i in range(n_layer):
        shapes.update({f"h{i}.{name}": shape for name, shape in layer.items()})
    return shapes


cdef int _cache_pointers(str name, list arrays, size_t n_layer, size_t n_head, size_t width, size_t rows,
                        float **out) except -1:
    """keys / values: one writeable C-order float32 [1, slots, n_head, width] array per layer with
    slots >= rows; their data pointers into out[0..n_layer)."""
    cdef cnp.ndarray a
    if len(arrays) != n_layer:
        raise ValueError(f"{name}: expected {n_layer} arrays (one per layer), got {len(arrays)}")
    for i in range(n_layer):
        if not isinstance(arrays[i], cnp.ndarray):
            raise ValueError(f"{name}[{i}]: expected a numpy array, got {type(arrays[i]).__name__}")
        a = <cnp.ndarray>arrays[i]
        if (cnp.PyArray_TYPE(a) != cnp.NPY_FLOAT32 or not cnp.PyArray_IS_C_CONTIGUOUS(a)
                or not cnp.PyArray_ISWRITEABLE(a) or a.ndim != 4 or a.shape[0] != 1
                or <size_t>a.shape[2] != n_head or <size_t>a.shape[3] != width):
            raise ValueError(f"{name}[{i}]: expected a writeable C-order float32 array of shape "
                             f"(1, slots, {n_head}, {width}), got {a.dtype} {(<object>a).shape} "
                             "(a cache made for another model?)")
        if <size_t>a.shape[1] < rows:
            raise ValueError(f"length: {rows} rows (cached + new) do not fit {name}[{i}]'s {a.shape[1]} slots")
        out[i] = <float *>cnp.PyArray_DATA(a)
    return 0


cdef class LMStep:
    """Holds the weights (float32, C order; kept alive here) and runs forward passes.

    Sets the process's scipy-openblas32 (used only by dspark's kernels) to one thread: a draft
    step is too small to split, and more threads would fight the target's session for cores."""
    cdef dspark_lm_model model
    cdef dspark_lm_layer *layers
    cdef dict arrays

    def __cinit__(self, dict weights not None, size_t n_layer, size_t n_head, size_t vocab):
        cdef dspark_lm_layer *L
        cdef size_t i
        self.arrays = {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in weights.items()}
        for name in ("tok_emb", "h0.fc.w"):
            if name not in self.arrays or self.arrays[name].ndim != 2:
                raise ValueError(f"weights: need a 2-D {name!r}")
        cdef size_t d = self.arrays["tok_emb"].shape[1]
        if n_layer < 1:
            raise ValueError(f"n_layer: must be at least 1, got {n_layer}")
        if n_head < 1 or d % n_head:
            raise ValueError(f"n_head: must divide d_model={d} (at least 1), got {n_head}")
        for name, shape in _expected_shapes(n_layer, d, n_head, self.arrays["h0.fc.w"].shape[1], vocab).items():
            if name not in self.arrays:
                raise ValueError(f"weights: missing {name!r} (n_layer={n_layer})")
            got = self.arrays[name].shape if len(shape) == 2 else (self.arrays[name].size,)
            if got != shape:
                raise ValueError(f"weights[{name!r}]: expected shape {shape} for n_head={n_head}, vocab={vocab}, "
                                 f"got {self.arrays[name].shape}")
        scipy_openblas_set_num_threads(1)
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

    def forward(self, list keys not None, list values not None, const int64_t[::1] tokens not None,
                const int64_t[::1] positions not None, const uint8_t[:, ::1] mask not None,
                size_t length, const int64_t[::1] key_positions not None,
                float[:, ::1] logits not None):
        """keys[i] / values[i]: layer i's C-order float32 caches, [1, slots, H, Dh] / [1, slots, H, Dh + 1].
        Every argument is checked (ValueError naming it): the C pass trusts its shapes. The cache
        pointers go per call (not into the shared layer table): requests run concurrently on
        their own threads over one LMStep."""
        cdef size_t i, n = self.model.n_layer, t = tokens.shape[0], s = length + t
        cdef size_t h = self.model.n_head, dh = self.model.head_dim, vocab = self.model.vocab
        cdef int rc
        if t == 0:
            raise ValueError("tokens: at least one token")
        if length >= (<size_t>1 << 40):
            raise ValueError(f"length: {length} cached rows is past any cache")
        for i in range(t):
            if tokens[i] < 0 or <size_t>tokens[i] >= vocab:
                raise ValueError(f"tokens: id {tokens[i]} at {i} is outside 0..{vocab - 1}")
        if <size_t>positions.shape[0] != t:
            raise ValueError(f"positions: expected {t} (one per token), got {positions.shape[0]}")
        if <size_t>key_positions.shape[0] != s:
            raise ValueError(f"key_positions: expected {s} (cached + new), got {key_positions.shape[0]}")
        if <size_t>mask.shape[0] != t or <size_t>mask.shape[1] != s:
            raise ValueError(f"mask: expected shape ({t}, {s}), got ({mask.shape[0]}, {mask.shape[1]})")
        if <size_t>logits.shape[0] != t or <size_t>logits.shape[1] != vocab:
            raise ValueError(f"logits: expected shape ({t}, {vocab}), got ({logits.shape[0]}, {logits.shape[1]})")
        cdef float **ptrs = <float **>malloc(2 * n * sizeof(float *))
        if ptrs == NULL:
            raise MemoryError("LMStep: no memory for the cache table")
        try:
            _cache_pointers("keys", keys, n, h, dh, s, ptrs)
            _cache_pointers("values", values, n, h, dh + 1, s, ptrs + n)
            with nogil:
                rc = dspark_lm_forward(&self.model, self.layers, ptrs, ptrs + n, &tokens[0],
                                       &positions[0], t, &mask[0, 0], length, &key_positions[0],
                                       &logits[0, 0])
        finally:
            free(ptrs)
        if rc != 0:
            raise MemoryError("LMStep: no memory for the forward pass's scratch")
