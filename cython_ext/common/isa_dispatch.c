/* The kernel families' common dispatcher (isa_dispatch.h). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "isa_dispatch.h"

static int hidden(const char *name) {
    const char *p = getenv("DSPARK_SIMD_HIDE");
    const size_t len = strlen(name);
    while (p && *p) {
        const char *end = strchr(p, ',');
        const size_t n = end ? (size_t)(end - p) : strlen(p);
        if (n == len && strncmp(p, name, len) == 0) return 1;
        p = end ? end + 1 : NULL;
    }
    return 0;
}

const char *const dspark_isa_names[DSPARK_ISA_COUNT] = {"scalar", "avx2", "avx512"};

int dspark_isa_compiled(int isa) { return isa == DSPARK_ISA_SCALAR || DSPARK_HAVE_X86_TUS; }

const char *dspark_path_name(const dspark_isa_family *family, int path) {
    return (path >= 0 && path < family->count) ? family->names[path] : "unknown";
}

int dspark_path_runnable(const dspark_isa_family *family, int path) {
    if (path == 0) return 1;
    if (path < 0 || path >= family->count) return 0;
    return family->compiled(path) && family->runs(path) && !hidden(family->names[path]);
}

int dspark_path_best(const dspark_isa_family *family) {
    for (int path = family->count - 1; path > 0; path--)
        if (dspark_path_runnable(family, path)) return path;
    return 0;
}

int dspark_path_by_name(const dspark_isa_family *family, const char *name, char *err, size_t err_len) {
    if (!name || !*name || strcmp(name, "auto") == 0) return dspark_path_best(family);
    for (int path = 0; path < family->count; path++) {
        if (strcmp(name, family->names[path]) != 0) continue;
        if (!family->compiled(path)) {
            snprintf(err, err_len, "%s: this build has no %s %s kernels", name, name, family->kernels);
            return -1;
        }
        if (!dspark_path_runnable(family, path)) {
            snprintf(err, err_len, "%s: this CPU or OS cannot run the %s %s kernels (best here: %s)", name, name,
                     family->kernels, family->names[dspark_path_best(family)]);
            return -1;
        }
        return path;
    }
    char known[128] = "auto";
    for (int path = 0; path < family->count; path++) {
        strncat(known, ", ", sizeof known - strlen(known) - 1);
        strncat(known, family->names[path], sizeof known - strlen(known) - 1);
    }
    snprintf(err, err_len, "%s: expected one of %s", name, known);
    return -1;
}

int dspark_path_select(const dspark_isa_family *family, char *err, size_t err_len) {
    char inner[224] = "";
    const char *want = getenv(family->env);
    int path = dspark_path_by_name(family, want, inner, sizeof inner);
    if (path < 0) snprintf(err, err_len, "%s=%s", family->env, inner);
    return path;
}

const char *dspark_path_list(const dspark_isa_family *family, int runnable_only, char *out, size_t out_len) {
    if (out_len == 0) return out;
    out[0] = '\0';
    for (int path = 0; path < family->count; path++) {
        if (!(runnable_only ? dspark_path_runnable(family, path) : family->compiled(path))) continue;
        if (out[0]) strncat(out, ",", out_len - strlen(out) - 1);
        strncat(out, family->names[path], out_len - strlen(out) - 1);
    }
    return out;
}
