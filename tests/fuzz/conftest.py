"""The fuzz suite's Hypothesis profiles. ``make test`` runs the "ci" profile: a bounded number of
examples, derandomized, so the suite is reproducible and stays within its minute. ``make fuzz``
runs the "long" profile (GPUDRA_FUZZ_PROFILE=long, GPUDRA_FUZZ_EXAMPLES examples), random each run.

Inputs that once found a bug live in ``corpus/`` and are replayed by every profile as explicit
examples (``fuzzcorpus.py``), so a regression fails ``make test`` whatever Hypothesis draws."""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci", max_examples=200, derandomize=True, deadline=None, database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
settings.register_profile(
    "long", max_examples=int(os.environ.get("GPUDRA_FUZZ_EXAMPLES", "5000")), deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
settings.load_profile(os.environ.get("GPUDRA_FUZZ_PROFILE", "ci"))
