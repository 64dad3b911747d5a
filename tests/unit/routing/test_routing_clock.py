"""The router's clock: a ManualClock's waits end by notify or by advance, never by the wall
clock; the router core's unit tests sleep on no wall clock."""
from __future__ import annotations

import ast
import threading
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path

import pytest

from dspark.routing.clock import Clock, ManualClock
from tests.unit.routing.test_routing_runtime import eventually


def test_a_wait_times_out_only_when_advanced_past_its_timeout():
    clock, condition, results = ManualClock(), threading.Condition(), []

    def wait():
        with condition:
            results.append(clock.wait(condition, 0.1))
    waiter = threading.Thread(target=wait)
    waiter.start()
    assert eventually(lambda: clock.waiters() == 1)
    clock.advance(0.05)
    assert eventually(lambda: not waiter.is_alive())
    assert results == [True], "woken to look at the time, before its timeout"
    waiter = threading.Thread(target=wait)
    waiter.start()
    assert eventually(lambda: clock.waiters() == 1)
    clock.advance(0.1)
    waiter.join(5)
    assert results == [True, False]


def test_sleep_and_result_follow_the_clock():
    clock, done = ManualClock(), []
    sleeper = threading.Thread(target=lambda: (clock.sleep(0.3), done.append(clock())))
    sleeper.start()
    start = clock()
    for _ in range(5):
        assert eventually(lambda: clock.waiters() == 1 or not sleeper.is_alive())
        if not sleeper.is_alive():
            break
        clock.advance(0.1)
    sleeper.join(5)
    assert done and 0.3 <= done[0] - start < 0.4
    future: Future = Future()
    future.set_result(7)
    assert clock.result(future, 0.1) == 7 and Clock().result(future, 0.1) == 7
    with pytest.raises(FutureTimeout):
        Clock().result(Future(), 0.001)


def test_the_router_core_unit_tests_do_not_sleep():
    source = Path(__file__).with_name("test_routing_runtime.py").read_text()
    calls = [node for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Call)
             and isinstance(node.func, ast.Attribute) and node.func.attr == "sleep"
             and isinstance(node.func.value, ast.Name) and node.func.value.id == "time"]
    assert not calls, [node.lineno for node in calls]
