# The common kernel dispatcher (isa_dispatch.h), included by each extension that has a family.

cdef extern from "isa_dispatch.h" nogil:
    ctypedef struct dspark_isa_family:
        int count
    int dspark_path_runnable(const dspark_isa_family *family, int path)
    int dspark_path_best(const dspark_isa_family *family)
    int dspark_path_by_name(const dspark_isa_family *family, const char *name, char *err, size_t err_len)
    int dspark_path_select(const dspark_isa_family *family, char *err, size_t err_len)
    const char *dspark_path_name(const dspark_isa_family *family, int path)
    const char *dspark_path_list(const dspark_isa_family *family, int runnable_only, char *out, size_t out_len)


cdef dict _paths_info(const dspark_isa_family *family):
    """What the family's binary holds, what this CPU runs, the best path and the chosen one (the
    family's variable applied; "error: ..." when it names a path that cannot run)."""
    cdef char text[128]
    cdef char err[256]
    cdef int chosen = dspark_path_select(family, err, sizeof(err))
    compiled = dspark_path_list(family, 0, text, sizeof(text)).decode()
    supported = dspark_path_list(family, 1, text, sizeof(text)).decode()
    return {"compiled": compiled.split(","), "supported": supported.split(","),
            "best": dspark_path_name(family, dspark_path_best(family)).decode(),
            "chosen": dspark_path_name(family, chosen).decode() if chosen >= 0 else "error: " + err.decode()}


cdef int _path_index(const dspark_isa_family *family, object name, char *err, size_t err_len):
    """The path ``name`` names (None: the family's variable, else the best), or -1 and err."""
    cdef bytes raw
    if name is None:
        return dspark_path_select(family, err, err_len)
    raw = str(name).encode()
    return dspark_path_by_name(family, raw, err, err_len)
