# cython: language_level=3, boundscheck=False, wraparound=False
"""BFC memory pool handing out numpy arrays (wrapped by dspark.kernels.pool)."""
cimport cython
import numpy as np
cimport numpy as cnp
from cpython.object cimport PyObject, PyTypeObject
from cpython.ref cimport Py_INCREF
from cpython.pyport cimport PY_SSIZE_T_MAX

cnp.import_array()


cdef extern from "numpy/arrayobject.h":
    # Declared with raw pointers: it steals the descr reference and obj may be NULL.
    object new_from_descr "PyArray_NewFromDescr"(
        PyTypeObject *subtype, void *descr, int nd, cnp.npy_intp *dims,
        cnp.npy_intp *strides, void *data, int flags, PyObject *obj)


cdef extern from "bfc_pool.h" nogil:
    ctypedef struct dspark_pool:
        pass
    ctypedef struct dspark_pool_stats:
        size_t bytes_in_use, peak_bytes_in_use, bytes_reserved, num_allocs, num_frees
        size_t num_arenas, num_free_chunks, largest_free_block_bytes, total_free_bytes
    int DSPARK_POOL_BEST_FIT, DSPARK_POOL_FIRST_FIT
    int DSPARK_POOL_MLOCK, DSPARK_POOL_HUGEPAGE, DSPARK_POOL_PREFAULT
    dspark_pool *dspark_pool_create(int policy, size_t arena_bytes, size_t max_bytes,
                                    size_t initial_bytes, int flags, int *err)
    void dspark_pool_destroy(dspark_pool *p)
    void *dspark_pool_alloc(dspark_pool *p, size_t nbytes, void **handle, int *err)
    void dspark_pool_free(dspark_pool *p, void *handle)
    void dspark_pool_get_stats(dspark_pool *p, dspark_pool_stats *s)


cdef dict _DTYPES = {}  # dtype argument -> descr: np.dtype() is a third of an empty() call


class PoolError(MemoryError):
    """The pool could not reserve or lock memory; the message says why and what to change."""


def _explain(int err, str what, size_t nbytes, bint locking):
    import errno
    import os
    import resource
    if locking and err in (errno.EPERM, errno.ENOMEM, errno.EAGAIN):
        soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
        lim = "unlimited" if soft == resource.RLIM_INFINITY else f"{soft} bytes"
        return PoolError(
            f"{what}: mlock of {nbytes} bytes refused ({os.strerror(err)}); RLIMIT_MEMLOCK is {lim}. "
            "Raise it (ulimit -l, or LimitMEMLOCK= / --ulimit memlock=) or create the pool "
            "with lock_pages=False")
    return PoolError(f"{what}: {os.strerror(err)} while reserving {nbytes} bytes")


@cython.freelist(256)
cdef class _Block:
    """Owns one pool block; the ndarray built on it keeps it alive as its base."""
    cdef RawPool pool
    cdef void *handle

    def __dealloc__(self):
        if self.handle != NULL:
            dspark_pool_free(self.pool.p, self.handle)
            self.handle = NULL


cdef class RawPool:
    cdef dspark_pool *p
    cdef readonly str policy
    cdef readonly bint lock_pages
    cdef readonly size_t max_bytes

    def __cinit__(self, str policy="best_fit", size_t arena_bytes=64 << 20, size_t max_bytes=0,
                  size_t initial_bytes=0, bint lock_pages=False, bint huge_pages=False,
                  bint prefault=False):
        cdef int err = 0
        cdef int flags = ((DSPARK_POOL_MLOCK if lock_pages else 0)
                          | (DSPARK_POOL_HUGEPAGE if huge_pages else 0)
                          | (DSPARK_POOL_PREFAULT if prefault else 0))
        if policy not in ("best_fit", "first_fit"):
            raise ValueError(f"policy={policy!r}: expected 'best_fit' or 'first_fit'")
        for name, value in (("arena_bytes", arena_bytes), ("max_bytes", max_bytes), ("initial_bytes", initial_bytes)):
            if value > <size_t>PY_SSIZE_T_MAX:
                raise ValueError(f"{name}={value}: larger than any address space")
        self.policy = policy
        self.lock_pages = lock_pages
        self.max_bytes = max_bytes
        self.p = dspark_pool_create(DSPARK_POOL_BEST_FIT if policy == "best_fit" else DSPARK_POOL_FIRST_FIT,
                                    arena_bytes, max_bytes, initial_bytes, flags, &err)
        if self.p == NULL:
            raise _explain(err, "MemoryPool", initial_bytes, lock_pages)

    def __dealloc__(self):
        dspark_pool_destroy(self.p)

    cdef void *_alloc(self, size_t nbytes, void **handle) except NULL:
        cdef int err = 0
        cdef void *ptr = dspark_pool_alloc(self.p, nbytes, handle, &err)
        if ptr == NULL:
            if self.max_bytes and err == 12:  # ENOMEM from the pool's own limit
                raise PoolError(f"MemoryPool: {nbytes} bytes do not fit under max_bytes={self.max_bytes}")
            raise _explain(err, "MemoryPool", nbytes, self.lock_pages)
        return ptr

    def empty(self, shape, dtype=np.float32):
        """An uninitialised C-contiguous array whose memory returns to the pool when collected."""
        cdef cnp.dtype descr = _DTYPES.get(dtype)
        if descr is None:
            descr = np.dtype(dtype)
            if descr.hasobject:
                raise TypeError(f"dtype={descr}: holds Python objects, which pool memory cannot "
                                "(uninitialised object pointers); use a numeric dtype")
            if len(_DTYPES) < 64:
                _DTYPES[dtype] = descr
        cdef tuple shp = shape if type(shape) is tuple else ((shape,) if isinstance(shape, int) else tuple(shape))
        cdef int nd = len(shp)
        cdef cnp.npy_intp dims[32]
        cdef size_t nbytes = descr.itemsize
        cdef int i
        if nd > 32:
            raise ValueError("at most 32 dimensions")
        for i in range(nd):
            if shp[i] < 0:
                raise ValueError(f"negative dimension in shape {shp}")
            if shp[i] and nbytes > (<size_t>PY_SSIZE_T_MAX) // <size_t>shp[i]:
                raise ValueError(f"shape {shp} of {descr} is too large")
            dims[i] = shp[i]
            nbytes *= <size_t>shp[i]
        cdef _Block block = _Block.__new__(_Block)
        block.pool = self
        cdef void *handle = NULL
        cdef void *ptr = self._alloc(nbytes, &handle)
        block.handle = handle
        Py_INCREF(descr)  # PyArray_NewFromDescr steals it
        arr = new_from_descr(<PyTypeObject *>np.ndarray, <void *>descr, nd, dims, NULL, ptr,
                             cnp.NPY_ARRAY_CARRAY, NULL)
        cnp.set_array_base(arr, block)
        return arr

    def stats(self):
        cdef dspark_pool_stats s
        dspark_pool_get_stats(self.p, &s)
        return {
            "bytes_in_use": s.bytes_in_use,
            "peak_bytes_in_use": s.peak_bytes_in_use,
            "bytes_reserved": s.bytes_reserved,
            "num_allocs": s.num_allocs,
            "num_frees": s.num_frees,
            "num_arenas": s.num_arenas,
            "num_free_chunks": s.num_free_chunks,
            "largest_free_block_bytes": s.largest_free_block_bytes,
            "total_free_bytes": s.total_free_bytes,
            "fragmentation": (1.0 - s.largest_free_block_bytes / s.total_free_bytes)
                             if s.total_free_bytes else 0.0,
        }
