"""The GpuConfig decoder (gpudra_driver.gpuconfig) over any parameters a tenant can write: every
decode takes under 10 ms of CPU, raises nothing but GpuConfigError, and gives the same answer
twice. The corpus (corpus/gpuconfig.json) replays the inputs that once broke one of these."""

from __future__ import annotations

import time
from typing import Any

import fuzzcorpus
import pytest
from gpuconfigs import configs
from hypothesis import example, given

from gpudra_driver.gpuconfig import GpuConfig, GpuConfigError, decode

DECODE_BUDGET_S = 0.010
CORPUS = fuzzcorpus.load("gpuconfig")


def timed_decode(value: Any) -> tuple[GpuConfig | GpuConfigError, float]:
    """The decode's result or error, and the CPU time this thread spent on it (other processes
    on a busy machine do not count)."""
    started = time.thread_time()
    try:
        result: GpuConfig | GpuConfigError = decode(value)
    except GpuConfigError as error:
        result = error
    return result, time.thread_time() - started


def outcome(result: GpuConfig | GpuConfigError) -> object:
    return str(result) if isinstance(result, GpuConfigError) else result


def check(value: Any) -> None:
    first, spent = timed_decode(value)  # anything but a GpuConfigError fails the test as it is
    if spent >= DECODE_BUDGET_S:  # a pause of the interpreter's own (a GC) is not the input's cost
        spent = min(spent, *(timed_decode(value)[1] for _ in range(2)))
    assert spent < DECODE_BUDGET_S, f"{spent * 1000:.1f} ms"
    assert outcome(timed_decode(value)[0]) == outcome(first)


def with_corpus(test: Any) -> Any:
    for value in CORPUS:
        test = example(value)(test)
    return test


@given(configs)
@with_corpus
def test_decoding_is_bounded_total_and_deterministic(value: Any) -> None:
    check(value)


@pytest.mark.parametrize("value", CORPUS, ids=[f"corpus-{i}" for i in range(len(CORPUS))])
def test_the_corpus_replays(value: Any) -> None:
    check(value)
