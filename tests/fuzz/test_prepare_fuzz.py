"""The node's prepare path against garbage claims: one claim with generated opaque configs and
allocation results (huge quantities, deep nesting, long strings, wrong types, names beyond the
API's bounds) next to a good claim, in one NodePrepareResources batch through the real
:class:`DeviceState` (CDI specs, checkpoint, node lock), as the unit tests drive it.

Whatever the bad claim holds: it gets its own error (or is prepared, when it is valid after all),
the good claim beside it is always prepared, the whole call answers within a second, and
unpreparing both leaves the node as it was."""

from __future__ import annotations

import asyncio
import sys
import time
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))  # the plugin tests' builders
from fuzzcorpus import load  # noqa: E402
from plugin_fixtures import DRIVER, NODE, claim, devices, driver_files, result  # noqa: E402

from gpudra_driver.gpuconfig import API_VERSION, KIND  # noqa: E402
from gpudra_driver.plugin.cdi import CdiDir  # noqa: E402
from gpudra_driver.plugin.model import ClaimRef  # noqa: E402
from gpudra_driver.plugin.state import DeviceState  # noqa: E402

GOOD = ClaimRef("ns", "good", "0c1d2e3f-0000-4000-8000-00000000000a")
BAD = ClaimRef("ns", "bad", "0c1d2e3f-0000-4000-8000-00000000000b")
CALL_BOUND = 1.0  # seconds for the whole call, the good claim's prepare included
# Each example prepares and unprepares on disk (the good claim's CDI spec checked against the CDI
# schema): half the profile's examples keep make test's run of this file near 6 s; make fuzz's
# "long" profile raises them with the rest.
EXAMPLES = max(20, settings().max_examples // 2)


def nested(depth: int, leaf: Any = None) -> Any:
    value = leaf
    for level in range(depth):  # without recursion: deeper than a recursive walk survives
        value = [value] if level % 2 else {"sharing": value}
    return value


@dataclass(frozen=True)
class Long:
    """A string of ``length`` characters, made in the test: Hypothesis prints every example's
    arguments, and a 50,000-character string or a 20,000-deep nesting is no argument to print."""

    length: int

    def make(self) -> str:
        return "x" * self.length


@dataclass(frozen=True)
class Deep:
    depth: int

    def make(self) -> Any:
        return nested(self.depth)


def made(value: Any) -> Any:
    """``value`` with its :class:`Long` and :class:`Deep` stand-ins made (the generated structure
    around them is shallow)."""
    if isinstance(value, (Long, Deep)):
        return value.make()
    if isinstance(value, dict):
        return {made(k) if isinstance(k, Long) else k: made(v) for k, v in value.items()}
    if isinstance(value, list):
        return [made(v) for v in value]
    return value


QUANTITIES = st.sampled_from(["1e300000", "-1e300000", "1e-300000", "9" * 5000, "10Gi", "1Mi", "0", "-1", "1.5Ti",
                              "0x10", "1E18", "123456789012345678901234567890Ei", "1e9223372036854775807", "Infinity",
                              "NaN", ".5Gi", "1e", " 10Gi"]) | st.from_regex(
    r"[+-]?[0-9]{0,25}(\.[0-9]{0,10})?([eE][+-]?[0-9]{1,7}|[KMGTPE]i?|[mnu])?", fullmatch=True)
LONG_STRINGS = st.builds(Long, st.integers(0, 50_000))
NUMBERS = st.integers() | st.integers(-(10**4000), 10**4000) | st.floats(allow_nan=True) | st.booleans()
LEAVES = st.none() | NUMBERS | st.text(max_size=30) | QUANTITIES | LONG_STRINGS
FIELDS = st.sampled_from(["apiVersion", "kind", "sharing", "strategy", "timeSlicing", "interval", "mps",
                          "activeThreadPercentage", "pinnedMemoryLimit", "perDevice", "gpu-5", "gpu-0",
                          "GPU-4d4f1d4e-0000-0000-0000-000000000005", "x" * 100]) | st.text(max_size=20)
JSONISH = st.recursive(LEAVES, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(FIELDS, inner, max_size=4),
                       max_leaves=30) | st.builds(Deep, st.integers(1, 3_000))
SETTINGS = st.fixed_dictionaries({}, optional={"activeThreadPercentage": NUMBERS | QUANTITIES | JSONISH,
                                               "pinnedMemoryLimit": QUANTITIES | NUMBERS | JSONISH})
SHARING = st.fixed_dictionaries({}, optional={
    "strategy": st.sampled_from(["Exclusive", "TimeSlicing", "MPS", "mps", ""]) | JSONISH,
    "timeSlicing": st.fixed_dictionaries({}, optional={"interval": st.sampled_from(["Long", "Short", "x"]) | JSONISH}),
    "mps": SETTINGS.flatmap(lambda base: st.fixed_dictionaries(
        {}, optional={"perDevice": st.dictionaries(FIELDS, SETTINGS | JSONISH, max_size=40)}).map(
        lambda more: {**base, **more})) | JSONISH})
GPU_CONFIGS = st.fixed_dictionaries(
    {"apiVersion": st.just(API_VERSION) | st.sampled_from(["v1", ""]), "kind": st.just(KIND) | JSONISH},
    optional={"sharing": SHARING | JSONISH, "extra": JSONISH})
PARAMETERS = GPU_CONFIGS | JSONISH
REQUEST_NAMES = st.just("gpu") | st.sampled_from(["gpu/sub", "a/b/c", "", "GPU", "r" * 64, "r" * 63 + "/" + "s" * 63]) \
    | LONG_STRINGS | JSONISH
CONFIGS = st.lists(st.fixed_dictionaries(
    {"source": st.sampled_from(["FromClaim", "FromClass"]) | JSONISH,
     "opaque": st.fixed_dictionaries({"driver": st.just(DRIVER) | st.text(max_size=10) | LONG_STRINGS,
                                      "parameters": PARAMETERS}) | JSONISH},
    optional={"requests": st.lists(REQUEST_NAMES, max_size=40) | JSONISH}), max_size=70) | JSONISH
RESULTS = st.fixed_dictionaries(
    {"request": REQUEST_NAMES, "driver": st.just(DRIVER), "pool": st.just(NODE) | LONG_STRINGS | JSONISH,
     "device": st.just("gpu-5") | st.sampled_from(["gpu-99", "GPU_5", ""]) | LONG_STRINGS | JSONISH},
    optional={"adminAccess": st.booleans() | JSONISH, "shareID": st.just(GOOD.uid) | LONG_STRINGS | JSONISH,
              "consumedCapacity": st.dictionaries(FIELDS, QUANTITIES | JSONISH, max_size=40) | JSONISH})
BAD_CLAIMS = st.fixed_dictionaries({"config": CONFIGS, "results": st.lists(RESULTS | JSONISH, min_size=1, max_size=40)})


@cache
def node_devices() -> dict[str, Any]:
    return devices()


def fresh_state(root: Path) -> DeviceState:
    (root / "plugin").mkdir(exist_ok=True)
    state = DeviceState(root / "plugin", CdiDir(root / "cdi", DRIVER, driver_files()), driver=DRIVER, node=NODE,
                        boot_id="boot-1")
    state.set_devices(node_devices())
    return state


def bad_claim(generated: dict[str, Any]) -> dict[str, Any]:
    obj = claim(BAD.uid, name=BAD.name, results=[result("gpu-5")])
    obj["status"]["allocation"]["devices"].update(generated)
    return obj


def good_claim() -> dict[str, Any]:
    obj = claim(GOOD.uid, name=GOOD.name, results=[result("gpu-0")])
    obj["status"]["allocation"]["devices"]["config"] = [{"source": "FromClaim", "opaque": {
        "driver": DRIVER, "parameters": {"apiVersion": API_VERSION, "kind": KIND, "sharing": {"strategy": "Exclusive"}}}}]
    return obj


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("prepare-fuzz")


@settings(max_examples=EXAMPLES)
@given(generated=BAD_CLAIMS, bad_first=st.booleans())
@example(generated={"config": [], "results": [{**result("gpu-5"), "shareID": GOOD.uid,
                                              "consumedCapacity": {"memory": "1e300000"}}]}, bad_first=True)
@example(generated={"config": [{"source": "FromClaim", "opaque": {"driver": DRIVER, "parameters": Deep(5000)}}],
                    "results": [result("gpu-5")]}, bad_first=False)
def test_a_garbage_claim_gets_its_own_error_and_never_its_neighbours(node: Path, generated: dict[str, Any],
                                                                     bad_first: bool) -> None:
    _check(node, generated, bad_first)


@pytest.mark.parametrize("generated", load("prepare"))
def test_the_corpus(node: Path, generated: dict[str, Any]) -> None:
    _check(node, generated, True)
    _check(node, generated, False)


def _check(node: Path, generated: dict[str, Any], bad_first: bool) -> None:
    state = fresh_state(node)
    pairs = [(BAD, bad_claim(made(generated))), (GOOD, good_claim())]
    started = time.perf_counter()
    out = asyncio.run(state.prepare(pairs if bad_first else pairs[::-1]))
    elapsed = time.perf_counter() - started
    assert out[GOOD.uid].error is None, out[GOOD.uid].error
    bad = out[BAD.uid]
    assert (bad.error is None) == (bad.claim is not None)
    if bad.error is not None:
        assert BAD.name in bad.error and len(bad.error) < 1000  # names the claim; a line, whatever it holds
    assert elapsed < CALL_BOUND, f"the call took {elapsed:.2f}s"
    assert asyncio.run(state.unprepare([GOOD, BAD])) == {GOOD.uid: None, BAD.uid: None}
    assert state.cdi.claim_uids() == set() and state.prepared_count == 0
