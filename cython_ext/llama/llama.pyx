# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""dspark's own llama-architecture forward pass over GGUF 4/8-bit blocks (llama_forward.c).

Wrapped by dspark.llm.kernel_runtime.KernelRuntime. Every entry point checks its arguments and
raises dspark.errors.RequestError / ConfigError naming the argument: a bad token id, short
positions or a cache of another shape never reach the C code. One module (~500 lines) because
it is one extension: the packed matrices, the model and its caches share C declarations."""
import math

import numpy as np

from libc.stdint cimport int32_t, int64_t, uint8_t, uint16_t
from libc.stdlib cimport calloc, free

from dspark.errors import ConfigError, RequestError

include "isa_dispatch.pxi"


cdef extern from "llama_kernels.h" nogil:
    ctypedef struct llama_matrix:
        int fmt
        size_t n, k
        const uint8_t *data
    ctypedef struct llama_kernels:
        const char *name
    int LLAMA_Q4_0, LLAMA_Q4_1, LLAMA_Q8_0, LLAMA_Q5_0, LLAMA_Q5_1, LLAMA_Q4_K, LLAMA_Q5_K, LLAMA_Q6_K
    float llama_half_to_float(uint16_t h)
    uint16_t llama_float_to_half(float f)
    size_t llama_block_bytes(int fmt)
    size_t llama_block_inputs(int fmt)
    const dspark_isa_family llama_paths
    const llama_kernels *llama_isa_kernels(int isa)


cdef extern from "llama_forward.h" nogil:
    ctypedef struct llama_layer:
        const float *attn_norm
        const float *ffn_norm
        const float *post_attn_norm
        const float *post_ffn_norm
        const float *q_norm
        const float *k_norm
        const float *qkv_bias
        llama_matrix qkv[3]
        llama_matrix wo
        llama_matrix gate_up[2]
        llama_matrix down
        size_t window
        int local_rope
    ctypedef struct llama_model:
        size_t n_layer, hidden, ffn, n_head, n_kv, head_dim, vocab
        float rms_eps
        double rope_base, rope_base_local
        int rope_neox, ffn_gelu
        float embed_scale
        const float *rope_factors
        llama_matrix embed, head
        const float *out_norm
        const llama_layer *layers
    ctypedef struct llama_segment:
        uint16_t *k
        uint16_t *v
        size_t cap, length, t
        const int32_t *tokens
        const int64_t *positions
        const int64_t *past_positions
        const uint8_t *mask
    ctypedef struct llama_request:
        const llama_segment *segs
        size_t n_segs
        const float *inputs
        const llama_matrix *head
        const int32_t *logit_rows
        size_t n_logit_rows
        float *logits
        const int32_t *tap_layers
        size_t n_taps
        float *taps
    ctypedef struct llama_pool:
        pass
    llama_pool *llama_pool_new(int threads)
    void llama_pool_free(llama_pool *pool)
    int llama_pool_threads(const llama_pool *pool)
    int llama_forward(const llama_model *m, const llama_kernels *kern, llama_pool *pool,
                      const llama_request *req)
    void llama_embed_row(const llama_model *m, int32_t token, float *x)
    int llama_project(const llama_model *m, const llama_kernels *kern, llama_pool *pool,
                      const float *hidden, size_t rows, const llama_matrix *head, int norm,
                      float *logits)


FORMATS = {"Q4_0": LLAMA_Q4_0, "Q4_1": LLAMA_Q4_1, "Q8_0": LLAMA_Q8_0, "Q5_0": LLAMA_Q5_0, "Q5_1": LLAMA_Q5_1,
           "Q4_K": LLAMA_Q4_K, "Q5_K": LLAMA_Q5_K, "Q6_K": LLAMA_Q6_K}
MAX_POSITION = 2 ** 31 - 1
FLOAT32_MAX = float(np.finfo(np.float32).max)


def isa_info():
    """Compiled and supported instruction sets of the llama kernels, the best and the chosen."""
    return _paths_info(&llama_paths)


def half_bits(values):
    """fp16 bits of float32 values, as the KV cache stores them (round to nearest even)."""
    src = np.ascontiguousarray(values, dtype=np.float32).reshape(-1)
    out = np.empty(src.shape[0], np.uint16)
    cdef const float[::1] sv = src
    cdef uint16_t[::1] ov = out
    cdef Py_ssize_t i
    for i in range(sv.shape[0]):
        ov[i] = llama_float_to_half(sv[i])
    return out


def half_values(bits):
    """float32 values of fp16 bits, as the kernels read the cache and the block scales."""
    src = np.ascontiguousarray(bits, dtype=np.uint16).reshape(-1)
    out = np.empty(src.shape[0], np.float32)
    cdef const uint16_t[::1] sv = src
    cdef float[::1] ov = out
    cdef Py_ssize_t i
    for i in range(sv.shape[0]):
        ov[i] = llama_half_to_float(sv[i])
    return out


cdef int _isa_index(object name) except -1:
    cdef char err[256]
    cdef int isa = _path_index(&llama_paths, name, err, sizeof(err))
    if isa < 0:
        raise ConfigError("isa", err.decode())
    return isa


MAX_ROWS = 2**31 - 1


cdef class PackedMatrix:
    """A matrix in the kernels' tile layout (see llama_kernels.h); keeps its bytes alive."""
    cdef llama_matrix mat
    cdef readonly object data
    cdef readonly str fmt

    def __cinit__(self, data, str fmt, n, k):
        if fmt not in FORMATS:
            raise ConfigError("fmt", f"{fmt!r} is not one of {sorted(FORMATS)}")
        n, k = _whole(n, "n"), _whole(k, "k")
        cdef size_t inputs = llama_block_inputs(FORMATS[fmt])
        if n <= 0 or n % 16 or k <= 0 or k % inputs:
            raise ConfigError("shape", f"{n} x {k}: need a positive multiple of 16 x {inputs} for {fmt}")
        if n > MAX_ROWS or k > MAX_ROWS:  # row and column indices are int32 in the kernels
            raise ConfigError("shape", f"{n} x {k}: at most {MAX_ROWS} rows and columns")
        arr = np.ascontiguousarray(data, dtype=np.uint8).reshape(-1)
        # in Python integers: a product of size_t would wrap for huge n and k
        expected = (int(n) // 16) * (int(k) // int(inputs)) * int(llama_block_bytes(FORMATS[fmt]))
        if arr.shape[0] != expected:
            raise ConfigError("data", f"{arr.shape[0]} bytes for a {fmt} {n} x {k} matrix, "
                                      f"expected {expected}")
        cdef const uint8_t[::1] view = arr
        self.data, self.fmt = arr, fmt
        self.mat.fmt, self.mat.n, self.mat.k, self.mat.data = FORMATS[fmt], n, k, &view[0]

    @property
    def n(self):
        return self.mat.n

    @property
    def k(self):
        return self.mat.k


cdef const float *_floats(dict keep, str name, object value, size_t n) except NULL:
    arr = np.ascontiguousarray(value, dtype=np.float32).reshape(-1)
    if arr.shape[0] != n:
        raise ConfigError(name, f"{arr.shape[0]} values, expected {n}")
    keep[name] = arr
    cdef const float[::1] view = arr
    return &view[0]


cdef const float *_optional_floats(dict keep, str name, object value, size_t n) except? NULL:
    return NULL if value is None else _floats(keep, name, value, n)


cdef llama_matrix _matrix(dict keep, str name, object value, size_t n, size_t k) except *:
    if not isinstance(value, PackedMatrix):
        raise ConfigError(name, "expected a PackedMatrix")
    cdef PackedMatrix pm = value
    if pm.mat.n != n or pm.mat.k != k:
        raise ConfigError(name, f"{pm.mat.n} x {pm.mat.k}, expected {n} x {k}")
    keep[name] = pm
    return pm.mat


# The architecture's description (llama_forward.h) and its defaults: plain llama.
ARCH_DEFAULTS = {"rope_neox": False, "ffn_gelu": False, "embed_scale": 1.0, "rope_base_local": 0.0,
                 "windows": None, "local_rope": None}


cdef class LlamaModel:
    """The packed weights, a thread pool and the chosen kernels. ``forward`` runs one step.

    ``config`` holds the sizes, ``rms_eps``, ``rope_base`` and optionally the architecture's
    description (ARCH_DEFAULTS: NEOX RoPE, GELU-gated FFN, embedding scale, a second RoPE base
    and per-layer sliding windows / local-RoPE flags); ``weights`` the packed matrices and norms
    by GGUF name, plus the optional ``blk.N.attn_q_norm`` / ``attn_k_norm`` [head_dim],
    ``post_attention_norm`` / ``post_ffw_norm`` [hidden], ``qkv_bias`` [(n_head + 2 n_kv) head_dim]
    and the model's ``rope_factors`` [head_dim / 2]."""
    cdef llama_model model
    cdef llama_layer *layers
    cdef llama_pool *pool
    cdef const llama_kernels *kern
    cdef dict keep
    cdef readonly dict config

    def __cinit__(self, dict config, dict weights, threads=2, isa=None):
        self.keep = {}
        keys = ("n_layer", "hidden", "ffn", "n_head", "n_kv", "head_dim", "vocab")
        for key in keys + ("rms_eps", "rope_base"):
            if key not in config:
                raise ConfigError(key, "missing from the model config")
        # checked as Python numbers: a C parameter would raise a bare OverflowError naming nothing
        sizes = {key: _whole(config[key], key, 1, MAX_ROWS) for key in keys if key != "vocab"}
        threads = _whole(threads, "threads", 1, 64)
        cdef size_t n_layer = sizes["n_layer"], d = sizes["hidden"], ffn = sizes["ffn"]
        cdef size_t nh = sizes["n_head"], nkv = sizes["n_kv"], hd = sizes["head_dim"]
        if nh == 0 or nkv == 0 or nh % nkv or nh // nkv > 64:
            raise ConfigError("n_kv", f"{nh} heads over {nkv} KV heads: need a divisor, at most 64 heads per KV head")
        if hd == 0 or hd % 64 or hd > 512:
            raise ConfigError("head_dim", f"{hd}: the kernels need a multiple of 64 (at most 512)")
        self.config = dict(config)
        self.model.n_layer, self.model.hidden, self.model.ffn = n_layer, d, ffn
        self.model.n_head, self.model.n_kv, self.model.head_dim = nh, nkv, hd
        self.model.vocab = _whole(config["vocab"], "vocab", 1, MAX_ROWS, " (token ids are int32)")
        # the GGUF reader checks these too; a caller building the config itself gets the same
        self.model.rms_eps = _finite(config["rms_eps"], "rms_eps", FLOAT32_MAX, positive=True)
        self.model.rope_base = _finite(config["rope_base"], "rope_base", positive=True)
        arch = {**ARCH_DEFAULTS, **{k: v for k, v in config.items() if k in ARCH_DEFAULTS}}
        self.model.rope_neox, self.model.ffn_gelu = bool(arch["rope_neox"]), bool(arch["ffn_gelu"])
        self.model.embed_scale = _finite(arch["embed_scale"], "embed_scale", FLOAT32_MAX)
        self.model.rope_base_local = _finite(arch["rope_base_local"], "rope_base_local")
        windows = [_whole(w, "windows", 0, MAX_POSITION) for w in (arch["windows"] or [0] * n_layer)]
        local = list(arch["local_rope"] or [False] * n_layer)
        if len(windows) != n_layer or len(local) != n_layer:
            raise ConfigError("windows", f"expected one sliding window and local-RoPE flag per layer ({n_layer})")
        if any(local) and not self.model.rope_base_local > 0:
            raise ConfigError("rope_base_local", "layers with local RoPE need a positive rope_base_local")
        self.model.rope_factors = _optional_floats(self.keep, "rope_factors", weights.get("rope_factors"), hd // 2)
        for name in ("embed", "head"):
            pm = weights.get(name)
            if not isinstance(pm, PackedMatrix) or pm.n < self.model.vocab:
                raise ConfigError(name, f"expected a PackedMatrix of at least {self.model.vocab} rows")
        self.model.embed = _matrix(self.keep, "embed", weights["embed"], weights["embed"].n, d)
        self.model.head = _matrix(self.keep, "head", weights["head"], weights["head"].n, d)
        self.model.out_norm = _floats(self.keep, "out_norm", weights.get("out_norm"), d)
        self.layers = <llama_layer *>calloc(n_layer, sizeof(llama_layer))
        if self.layers == NULL:
            raise MemoryError("LlamaModel: no memory for the layer table")
        cdef llama_layer *L
        cdef size_t i
        for i in range(n_layer):
            p = f"blk.{i}."
            L = &self.layers[i]
            L.attn_norm = _floats(self.keep, p + "attn_norm", weights.get(p + "attn_norm"), d)
            L.ffn_norm = _floats(self.keep, p + "ffn_norm", weights.get(p + "ffn_norm"), d)
            L.qkv[0] = _matrix(self.keep, p + "attn_q", weights.get(p + "attn_q"), nh * hd, d)
            L.qkv[1] = _matrix(self.keep, p + "attn_k", weights.get(p + "attn_k"), nkv * hd, d)
            L.qkv[2] = _matrix(self.keep, p + "attn_v", weights.get(p + "attn_v"), nkv * hd, d)
            L.wo = _matrix(self.keep, p + "attn_output", weights.get(p + "attn_output"), d, nh * hd)
            L.gate_up[0] = _matrix(self.keep, p + "ffn_gate", weights.get(p + "ffn_gate"), ffn, d)
            L.gate_up[1] = _matrix(self.keep, p + "ffn_up", weights.get(p + "ffn_up"), ffn, d)
            L.down = _matrix(self.keep, p + "ffn_down", weights.get(p + "ffn_down"), d, ffn)
            L.post_attn_norm = _optional_floats(self.keep, p + "post_attention_norm",
                                                weights.get(p + "post_attention_norm"), d)
            L.post_ffn_norm = _optional_floats(self.keep, p + "post_ffw_norm", weights.get(p + "post_ffw_norm"), d)
            L.q_norm = _optional_floats(self.keep, p + "attn_q_norm", weights.get(p + "attn_q_norm"), hd)
            L.k_norm = _optional_floats(self.keep, p + "attn_k_norm", weights.get(p + "attn_k_norm"), hd)
            L.qkv_bias = _optional_floats(self.keep, p + "qkv_bias", weights.get(p + "qkv_bias"), (nh + 2 * nkv) * hd)
            L.window, L.local_rope = windows[i], bool(local[i])
        self.model.layers = self.layers
        self.kern = llama_isa_kernels(_isa_index(isa))
        self.pool = llama_pool_new(threads)
        if self.pool == NULL:
            raise MemoryError("LlamaModel: could not start the thread pool")

    def __dealloc__(self):
        if self.pool != NULL:
            llama_pool_free(self.pool)
        free(self.layers)

    @property
    def isa(self):
        return self.kern.name.decode()

    @isa.setter
    def isa(self, name):
        """Switch the instruction set ("auto", "scalar", "avx2", "avx512"); weights are shared."""
        self.kern = llama_isa_kernels(_isa_index(name or "auto"))

    @property
    def threads(self):
        return llama_pool_threads(self.pool)

    @property
    def head_columns(self):
        return self.model.head.n

    def embed(self, tokens):
        """Dequantized embedding rows of ``tokens`` [n, hidden] float32."""
        ids = self._tokens(tokens, "tokens")
        out = np.empty((ids.shape[0], self.model.hidden), np.float32)
        cdef float[:, ::1] view = out
        cdef const int32_t[::1] idv = ids
        cdef size_t i
        for i in range(ids.shape[0]):
            llama_embed_row(&self.model, idv[i], &view[i, 0])
        return out

    def project(self, hidden, logits, head=None, bint norm=True):
        """logits [n, head columns] = head(RMSNorm(hidden)) for hidden [n, hidden] float32 (the
        final norm skipped when ``norm`` is False: then any PackedMatrix, hidden [n, its inputs]);
        ``head`` a PackedMatrix or the model's."""
        cdef PackedMatrix pm
        cdef const llama_matrix *mat = &self.model.head
        if head is not None:
            if not isinstance(head, PackedMatrix) or (norm and (<PackedMatrix>head).mat.k != self.model.hidden):
                raise RequestError("head", f"expected a PackedMatrix over {self.model.hidden} inputs")
            pm = head
            mat = &pm.mat
        if not isinstance(hidden, np.ndarray) or hidden.dtype != np.float32 or hidden.ndim != 2 \
                or hidden.shape[0] == 0 or hidden.shape[1] != mat.k or not hidden.flags.c_contiguous:
            raise RequestError("hidden", f"expected a C-ordered float32 [n, {mat.k}] array")
        if not isinstance(logits, np.ndarray) or logits.dtype != np.float32 \
                or logits.shape != (hidden.shape[0], mat.n) or not logits.flags.c_contiguous \
                or not logits.flags.writeable:
            raise RequestError("logits", f"expected a writable float32 [{hidden.shape[0]}, {mat.n}] array")
        cdef const float[:, ::1] hv = hidden
        cdef float[:, ::1] lv = logits
        cdef int rc
        with nogil:
            rc = llama_project(&self.model, self.kern, self.pool, &hv[0, 0], hv.shape[0], mat, norm, &lv[0, 0])
        if rc != 0:
            raise MemoryError("LlamaModel.project: no memory for the scratch")

    cdef object _tokens(self, tokens, str field):
        arr = _int64s(tokens, field, "token ids")
        if arr.shape[0] == 0:
            raise RequestError(field, "expected at least one token id")
        bad = _first_outside(arr, 0, <long long>self.model.vocab - 1)
        if bad is not None:
            raise RequestError(field, f"token id {bad} is outside the vocabulary [0, {self.model.vocab})")
        return arr.astype(np.int32)

    def cache_shapes(self, capacity):
        """(keys shape, values shape) of a cache with room for ``capacity`` rows (slots are
        rounded up to a multiple of 16)."""
        slots = (_whole(capacity, "capacity", 0, MAX_POSITION) + 15) // 16 * 16
        m = self.model
        return ((m.n_layer, m.n_kv, slots // 16, m.head_dim, 16), (m.n_layer, m.n_kv, slots, m.head_dim))

    def forward(self, list segments, logit_rows, logits, taps=None, tap_layers=(), head=None,
                inputs=None):
        """One decoder step over the new rows of each segment.

        segments: [(keys, values, length, tokens, positions, mask)] with keys/values a cache from
        ``cache_shapes`` (uint16 holding fp16), ``length`` cached rows, and mask [t, length + t]
        (row i sees slot j where mask[i, j]). logit_rows: rows over all segments (in order) whose
        logits are written to ``logits`` [len(logit_rows), head columns] float32; taps: None or
        [rows, len(tap_layers) * hidden] float32 for the outputs of ``tap_layers``; head: a
        PackedMatrix over the hidden size in place of the model's head (a vocabulary subset);
        inputs: None, or [rows, hidden] float32 fed to the first layer instead of the tokens'
        embeddings (a drafter whose rows are not tokens)."""
        cdef size_t nseg = len(segments), s, rows = 0, t, length, cap
        if nseg == 0:
            raise RequestError("segments", "at least one segment is needed")
        cdef llama_segment *segs = <llama_segment *>calloc(nseg, sizeof(llama_segment))
        if segs == NULL:
            raise MemoryError("LlamaModel.forward: no memory for the segment table")
        cdef llama_request req
        cdef const int32_t[::1] rows_view
        cdef float[:, ::1] logits_view
        cdef float[:, ::1] taps_view
        cdef const int32_t[::1] tap_view
        cdef uint16_t[:, :, :, :, ::1] kview
        cdef uint16_t[:, :, :, ::1] vview
        cdef const int32_t[::1] tok_view
        cdef const int64_t[::1] pos_view
        cdef const int64_t[::1] past_view
        cdef const uint8_t[:, ::1] mask_view
        cdef const float[:, ::1] inputs_view
        cdef PackedMatrix head_pm
        cdef int rc
        held = []
        seen_caches = set()
        try:
            kshape0, vshape0 = self.cache_shapes(0)
            for s in range(nseg):
                where = f"segments[{s}]" if nseg > 1 else ""
                try:
                    keys, values, length_obj, tokens, positions, mask, *past = segments[s]
                except (TypeError, ValueError):
                    raise RequestError(where or "segments", "expected (keys, values, length, tokens, positions, "
                                                            "mask[, past positions])")
                if not isinstance(keys, np.ndarray) or keys.dtype != np.uint16 or keys.ndim != 5 \
                        or keys.shape[:2] + keys.shape[3:] != kshape0[:2] + kshape0[3:] \
                        or not keys.flags.c_contiguous or not keys.flags.writeable:
                    raise RequestError(_field(where, "cache"),
                                       f"keys {getattr(keys, 'shape', None)} {getattr(keys, 'dtype', None)} "
                                       "are not a cache of this model (make one with new_cache)")
                cap = keys.shape[2] * 16
                if not isinstance(values, np.ndarray) or values.dtype != np.uint16 or values.ndim != 4 \
                        or values.shape != (kshape0[0], kshape0[1], cap, kshape0[3]) \
                        or not values.flags.c_contiguous or not values.flags.writeable:
                    raise RequestError(_field(where, "cache"),
                                       f"values {getattr(values, 'shape', None)} do not match the keys "
                                       "(make the cache with new_cache)")
                if keys.ctypes.data in seen_caches:
                    raise RequestError(_field(where, "cache"), "the same cache appears twice in one batch")
                seen_caches.add(keys.ctypes.data)
                tok = self._tokens(tokens, _field(where, "tokens"))
                t = tok.shape[0]
                if not isinstance(length_obj, (int, np.integer)) or length_obj < 0 or length_obj + t > cap:
                    raise RequestError(_field(where, "cache"),
                                       f"{length_obj} cached + {t} new rows do not fit {cap} slots")
                pos = _int64s(positions, _field(where, "positions"), "positions")
                if pos.shape[0] != t:
                    raise RequestError(_field(where, "positions"), f"expected {t} positions (one per token), got {pos.shape[0]}")
                if _first_outside(pos, 0, MAX_POSITION) is not None:
                    raise RequestError(_field(where, "positions"), f"positions must lie in [0, {MAX_POSITION}]")
                msk = np.asarray(mask)
                if msk.shape != (t, length_obj + t) or msk.dtype not in (np.bool_, np.uint8):
                    raise RequestError(_field(where, "mask"),
                                       f"expected a bool [{t}, {length_obj + t}] mask, got {msk.shape} {msk.dtype}")
                msk = np.ascontiguousarray(msk).view(np.uint8)
                length = length_obj
                kview, vview, tok_view, pos_view, mask_view = keys, values, tok, pos, msk
                held.append((tok, pos, msk))
                segs[s].k, segs[s].v, segs[s].cap = &kview[0, 0, 0, 0, 0], &vview[0, 0, 0, 0], cap
                segs[s].length, segs[s].t = length, t
                segs[s].tokens, segs[s].positions, segs[s].mask = &tok_view[0], &pos_view[0], &mask_view[0, 0]
                segs[s].past_positions = NULL
                if past and past[0] is not None and length:
                    past_pos = _int64s(past[0], _field(where, "past positions"), "positions")
                    if past_pos.shape[0] < length:
                        raise RequestError(_field(where, "past positions"),
                                           f"expected {length} positions (one per cached row), got {past_pos.shape[0]}")
                    held.append(past_pos)
                    past_view = past_pos
                    segs[s].past_positions = &past_view[0]
                rows += t

            req.segs, req.n_segs, req.head, req.inputs = segs, nseg, NULL, NULL
            if inputs is not None:
                if not isinstance(inputs, np.ndarray) or inputs.dtype != np.float32 \
                        or inputs.shape != (rows, self.model.hidden) or not inputs.flags.c_contiguous:
                    raise RequestError("inputs", f"expected a C-ordered float32 [{rows}, {self.model.hidden}] array")
                inputs_view = inputs
                req.inputs = &inputs_view[0, 0]
            head_cols = self.model.head.n
            if head is not None:
                if not isinstance(head, PackedMatrix) or (<PackedMatrix>head).mat.k != self.model.hidden:
                    raise RequestError("head", f"expected a PackedMatrix over {self.model.hidden} inputs")
                head_pm = head
                req.head = &head_pm.mat
                head_cols = head_pm.mat.n
            lr = _int64s(logit_rows, "logit_rows", "rows")
            if _first_outside(lr, 0, <long long>rows - 1) is not None:
                raise RequestError("logit_rows", f"rows must lie in [0, {rows})")
            lr = lr.astype(np.int32)
            if not isinstance(logits, np.ndarray) or logits.dtype != np.float32 \
                    or logits.shape != (lr.shape[0], head_cols) or not logits.flags.c_contiguous \
                    or not logits.flags.writeable:
                raise RequestError("logits", f"expected a writable float32 [{lr.shape[0]}, {head_cols}] array")
            req.n_logit_rows = lr.shape[0]
            req.logit_rows, req.logits = NULL, NULL
            if lr.shape[0]:
                rows_view = lr
                logits_view = logits
                req.logit_rows, req.logits = &rows_view[0], &logits_view[0, 0]
            tl = _int64s(tap_layers, "tap_layers", "layers")
            if _first_outside(tl, 0, <long long>self.model.n_layer - 1) is not None:
                raise RequestError("tap_layers", f"layers must lie in [0, {self.model.n_layer})")
            tl = tl.astype(np.int32)
            req.n_taps, req.tap_layers, req.taps = tl.shape[0], NULL, NULL
            if taps is not None and tl.shape[0]:
                if not isinstance(taps, np.ndarray) or taps.dtype != np.float32 \
                        or taps.shape != (rows, tl.shape[0] * self.model.hidden) \
                        or not taps.flags.c_contiguous or not taps.flags.writeable:
                    raise RequestError("taps", f"expected a writable float32 "
                                               f"[{rows}, {tl.shape[0] * self.model.hidden}] array")
                tap_view = tl
                taps_view = taps
                req.tap_layers, req.taps = &tap_view[0], &taps_view[0, 0]
            with nogil:
                rc = llama_forward(&self.model, self.kern, self.pool, &req)
            if rc != 0:
                raise MemoryError("LlamaModel.forward: no memory for the step's scratch")
        finally:
            free(segs)


cdef object _first_outside(const int64_t[::1] values, long long lo, long long hi):
    """The first value outside [lo, hi], or None (a typed loop: numpy's min/max cost more
    than a decoding step's whole Python side)."""
    cdef Py_ssize_t i
    for i in range(values.shape[0]):
        if values[i] < lo or values[i] > hi:
            return values[i]
    return None


cdef object _int64s(object value, str field, str what):
    arr = np.asarray(value)
    if arr.ndim != 1 or (arr.dtype.kind not in "iu" and arr.shape[0]):
        raise RequestError(field, f"expected a 1-D sequence of integer {what}, got shape {arr.shape} {arr.dtype}")
    return np.ascontiguousarray(arr, dtype=np.int64)


def _whole(value, str name, lo=0, hi=2**64 - 1, str why=""):
    """``value`` as a Python int in [lo, hi], or ConfigError naming ``name``."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise ConfigError(name, f"{value!r}: expected a whole number in {lo}..{hi}")
    if not lo <= value <= hi:
        raise ConfigError(name, f"{value}: expected {lo}..{hi}{why}")
    return int(value)


def _finite(value, str name, limit=float("inf"), bint positive=False):
    """``value`` as a float, finite, at most ``limit`` in size (and > 0 when ``positive``), or
    ConfigError naming ``name``: NaN reaches the C code as NaN in every norm and rotation."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise ConfigError(name, f"{value!r}: expected a number")
    number = float(value)
    if not math.isfinite(number) or abs(number) > limit or (positive and not number > 0):
        raise ConfigError(name, f"{value!r}: expected a finite {'positive ' if positive else ''}number"
                                + (f" of at most {limit:g}" if math.isfinite(limit) else ""))
    return number


def _field(where, name):
    return f"{where}.{name}" if where else name
