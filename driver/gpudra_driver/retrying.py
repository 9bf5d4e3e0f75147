"""Retrying the agent's API calls until they succeed: exponential backoff (:mod:`tenacity`), each
wait up to a fifth shorter at random, so that the agents of a whole fleet that lost the API server
together come back spread out, not all in the same second. The publisher and device health use it."""

from __future__ import annotations

import random
from collections.abc import Callable

from tenacity import AsyncRetrying, RetryCallState, wait_exponential

RETRY_INITIAL = 0.2  # seconds before the first retry, doubling with each failure in a row
RETRY_MAX = 30.0
RETRY_JITTER = 0.2  # each wait is shortened by up to this fraction, at random
jitter: Callable[[], float] = random.random  # in [0, 1); tests fix it


def retrying(before_sleep: Callable[[RetryCallState], None]) -> AsyncRetrying:
    """Retry on any error until it succeeds (cancellation still ends it), ``before_sleep`` saying
    why and for how long. One object per sequence: tenacity keeps a sequence's state in it."""
    return AsyncRetrying(wait=_jittered, before_sleep=before_sleep)


_exponential = wait_exponential(multiplier=RETRY_INITIAL, max=RETRY_MAX)


def _jittered(state: RetryCallState) -> float:
    return _exponential(state) * (1 - RETRY_JITTER * jitter())
