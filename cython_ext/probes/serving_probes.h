/* At most 6 arguments a probe: bpftrace reads arg0..arg5 on x86-64.
 * The serving probes (dspark._ext.probes): each a semaphore and a function that fires it,
 * for probes.pyx, which checks `*_on()` before it builds any argument. */
#ifndef DSPARK_SERVING_PROBES_H
#define DSPARK_SERVING_PROBES_H
#include <stdint.h>
#include "dspark_probes.h"

#define SERVING_PROBE(name, params, ...) \
    DSPARK_PROBE_SEMAPHORE(name); \
    static inline int name##_on(void) { return DSPARK_PROBE_ENABLED(name); } \
    static inline void name##_fire params { DSPARK_PROBE(name, __VA_ARGS__); }

SERVING_PROBE(request_start, (const char *model, const char *method, int64_t prompt), model, method, prompt)
SERVING_PROBE(request_end, (const char *model, const char *method, int64_t output, int64_t rounds, int64_t draft_us,
                            int64_t verify_us),
              model, method, output, rounds, draft_us, verify_us)
SERVING_PROBE(queue_wait, (const char *model, int64_t wait_us), model, wait_us)
SERVING_PROBE(verify_batch, (int64_t requests, int64_t rows, int64_t us), requests, rows, us)
SERVING_PROBE(accept_begin, (int64_t rows), rows)
SERVING_PROBE(spec_round, (int64_t proposed, int64_t accepted, int64_t rows), proposed, accepted, rows)
SERVING_PROBE(stream_begin, (int64_t bytes), bytes)
SERVING_PROBE(stream_end, (int64_t bytes), bytes)
SERVING_PROBE(route, (const char *router, const char *tier, const char *lane, int64_t version, int64_t wait_us),
              router, tier, lane, version, wait_us)
SERVING_PROBE(rollout_step, (const char *model, int64_t step, const char *kind, int64_t percent_x100),
              model, step, kind, percent_x100)

static inline int probes_built(void) { return DSPARK_PROBES_BUILT; }
#endif
