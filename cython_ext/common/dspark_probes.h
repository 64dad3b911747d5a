/* USDT probes (provider "dspark"), the stable interface docs/trace.md lists (the table:
 * dspark/trace/probes.py). Each probe has a semaphore that a tracer raises while it is attached,
 * so a detached probe costs one predictable branch on a global. Without <sys/sdt.h> (or with
 * DSPARK_NO_PROBES defined) the probes compile to nothing and DSPARK_PROBES_BUILT is 0.
 *
 *   DSPARK_PROBE_SEMAPHORE(name);        once per shared object, at file scope
 *   DSPARK_PROBE(name, arg, ...);        where the event happens (up to 12 integer/pointer args)
 *   if (DSPARK_PROBE_ENABLED(name)) ...  to compute arguments only while traced */
#ifndef DSPARK_PROBES_H
#define DSPARK_PROBES_H

#if !defined(DSPARK_NO_PROBES) && defined(__has_include)
#if __has_include(<sys/sdt.h>)
#define DSPARK_PROBES_BUILT 1
#endif
#endif

#ifdef DSPARK_PROBES_BUILT
#define _SDT_HAS_SEMAPHORES 1
#define SDT_USE_VARIADIC 1
#include <sys/sdt.h>
#define DSPARK_PROBE_SEMAPHORE(name) \
    __extension__ unsigned short dspark_##name##_semaphore \
    __attribute__((unused, section(".probes"), visibility("hidden")))
#define DSPARK_PROBE_ENABLED(name) \
    __builtin_expect(*(volatile unsigned short *)&dspark_##name##_semaphore != 0, 0)
#define DSPARK_PROBE(name, ...) \
    do { if (DSPARK_PROBE_ENABLED(name)) STAP_PROBEV(dspark, name, __VA_ARGS__); } while (0)
#else
#define DSPARK_PROBES_BUILT 0
#define DSPARK_PROBE_SEMAPHORE(name) typedef int dspark_##name##_semaphore_unused
#define DSPARK_PROBE_ENABLED(name) 0
#define DSPARK_PROBE(name, ...) do { } while (0)
#endif

#endif
