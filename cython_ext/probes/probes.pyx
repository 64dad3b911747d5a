"""USDT probes of the decode loop and serving (provider "dspark"; the table: dspark/trace/probes.py).
Each call is one branch on the probe's semaphore while no tracer is attached; its arguments are
converted only while one is."""
from libc.stdint cimport int64_t

cdef extern from "serving_probes.h" nogil:
    int probes_built()
    int request_start_on()
    void request_start_fire(const char *model, const char *method, int64_t prompt)
    int request_end_on()
    void request_end_fire(const char *model, const char *method, int64_t output, int64_t rounds, int64_t draft_us,
                          int64_t verify_us)
    int queue_wait_on()
    void queue_wait_fire(const char *model, int64_t wait_us)
    int verify_batch_on()
    void verify_batch_fire(int64_t requests, int64_t rows, int64_t us)
    int accept_begin_on()
    void accept_begin_fire(int64_t rows)
    int spec_round_on()
    void spec_round_fire(int64_t proposed, int64_t accepted, int64_t rows)
    int stream_begin_on()
    void stream_begin_fire(int64_t bytes)
    int stream_end_on()
    void stream_end_fire(int64_t bytes)
    int route_on()
    void route_fire(const char *router, const char *tier, const char *lane, int64_t version, int64_t wait_us)
    int rollout_step_on()
    void rollout_step_fire(const char *model, int64_t step, const char *kind, int64_t percent_x100)

BUILT = bool(probes_built())


cdef inline bytes _text(object value):
    return str(value).encode("utf-8", "replace")


cdef inline int64_t _us(double seconds):
    return <int64_t>(seconds * 1e6)


def request_start(model, method, int64_t prompt_tokens):
    if request_start_on():
        request_start_fire(_text(model), _text(method), prompt_tokens)


def request_end(model, method, int64_t output_tokens, int64_t rounds, double draft_s, double verify_s):
    if request_end_on():
        request_end_fire(_text(model), _text(method), output_tokens, rounds, _us(draft_s), _us(verify_s))


def queue_wait(model, double wait_s):
    if queue_wait_on():
        queue_wait_fire(_text(model), _us(wait_s))


def verify_batch(int64_t requests, int64_t rows, double seconds):
    if verify_batch_on():
        verify_batch_fire(requests, rows, _us(seconds))


def accept_begin(int64_t rows):
    if accept_begin_on():
        accept_begin_fire(rows)


def spec_round(int64_t proposed, int64_t accepted, int64_t rows):
    if spec_round_on():
        spec_round_fire(proposed, accepted, rows)


def stream_begin(int64_t nbytes):
    if stream_begin_on():
        stream_begin_fire(nbytes)


def stream_end(int64_t nbytes):
    if stream_end_on():
        stream_end_fire(nbytes)


def route(router, tier, lane, int64_t version, double wait_s):
    if route_on():
        route_fire(_text(router), _text(tier), _text(lane), version, _us(wait_s))


def rollout_step(model, int64_t step, kind, double percent):
    if rollout_step_on():
        rollout_step_fire(_text(model), step, _text(kind), <int64_t>(percent * 100))
