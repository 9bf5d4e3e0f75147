"""The selector cost estimate and the runtime cost limit (gpudra_operator.cel.cost, .selector).

The estimate is checked against the real API server at the limit in
tests/integration/test_cel_cost_apiserver.py; here: cel-go's own expected costs for expressions
that need no declared variables, hand-counted DRA cases, the per-device bound, and what an
evaluation over the limit answers."""

from __future__ import annotations

import pytest

from gpudra_operator.cel import compile_selector, device_input
from gpudra_operator.cel.cost import (
    SELECTOR_MAX_COST,
    Range,
    checked_expression,
    declared_sizes,
    device_sizes,
    describe,
    estimate,
)
from gpudra_operator.cel.environment import selector_environment
from gpudra_operator.explain.allocator import SelectorMemo
from gpudra_operator.explain.inventory import Device

DRIVER = "gpu.gpudra.io"
DEVICE = device_input(DRIVER, {
    "attributes": {"productName": {"string": "NVIDIA H100"}, "index": {"int": 0},
                   "example.com/zone": {"string": "a"}},
    "capacity": {"memory": {"value": "80Gi"}}})


def cost_of(expression: str) -> Range:
    return estimate(checked_expression(selector_environment().compile(expression).serialize()))


# cel-go v0.26.0 checker/cost_test.go TestCost: the cases without declared variables.
@pytest.mark.parametrize(("expression", "low", "high"), [
    ('"Hello World!"', 0, 0),
    ("[1, 2, 3]", 10, 10),
    ('{"a": 1, "b": 2, "c": 3}', 30, 30),
    ("[1, 2, 3].all(x, true)", 20, 20),
    ("'123'.matches('[0-9]')", 2, 2),
    ("true || false", 0, 0),
    ("true && false", 0, 0),
    ("1 < 2", 1, 1),
    ("1 == 2", 1, 1),
    ("2 in [1, 2, 3]", 13, 13),
    ("1 + 1", 1, 1),
    ("1 % 1", 1, 1),
    ("true ? 1 : 2", 0, 0),
    ('size("123")', 1, 1),
    ('size(b"123")', 1, 1),
    ("string(1)", 1, 1),
])
def test_cel_gos_own_expected_costs(expression: str, low: int, high: int) -> None:
    assert cost_of(expression) == Range(low, high)


@pytest.mark.parametrize(("expression", "high"), [
    # device 1, .driver on the device (a struct upstream) 1, == 63 vs 1 characters: ceil(0.1) 1.
    ('device.driver == "x"', 3),
    # device, .attributes, ["example.com"], .zone (a select on a map): 4; == 1.
    ('device.attributes["example.com"].zone == "a"', 5),
    # Quantities compare at 1 (library/cost.go), quantity("1Gi"): ceil(3 * 0.1).
    ('device.capacity["example.com"].memory == quantity("1Gi")', 6),
    # "in" on a map costs 1 (cel-cpp also offers in_list for its dyn; cel-go knows it is a map).
    ('"zone" in device.attributes["example.com"]', 4),
    # has() of a field costs its operand only (the base environment's PresenceTestHasCost(false)).
    ('has(device.attributes["example.com"].zone)', 3),
])
def test_hand_counted_dra_costs(expression: str, high: int) -> None:
    assert cost_of(expression).high == high


def test_a_string_from_a_split_has_no_known_size_so_its_join_is_unbounded() -> None:
    # The API server refuses this for the same reason (the integration test checks it).
    assert describe(cost_of(f'device.attributes["{DRIVER}"].productName.split(" ").join("-") == "x"').high) == "unbounded"


def test_the_device_bound_uses_the_devices_own_sizes() -> None:
    expression = "device.attributes.all(d, device.attributes[d].all(k, device.attributes[d][k] == 'x'))"
    checked = checked_expression(selector_environment().compile(expression).serialize())
    attributes, capacity = DEVICE.maps
    declared = estimate(checked, declared_sizes).high
    bounded = estimate(checked, device_sizes(DRIVER, attributes, capacity)).high
    assert bounded < declared
    # Two domains of at most 2 attributes: a few dozen units, not 32 x 32 attribute maps' worth.
    assert bounded < 100 < declared


def loops(n: int, body: str) -> str:
    return f"lists.range({n}).all(i, {body})"


def test_within_the_estimate_limit_a_selector_is_evaluated_as_it_is() -> None:
    selector = compile_selector(loops(3000, f'device.attributes["{DRIVER}"].index == 0'))
    assert selector.within_cost_limit and selector.max_cost > 10_000
    assert selector.evaluate(DEVICE).matched


def test_over_the_limit_the_device_bound_decides_and_the_answer_is_exact_when_it_is_within() -> None:
    # 1000 loops over every attribute map: within the limit for this small device, past it for
    # the largest one the API allows.
    selector = compile_selector(loops(1000, "device.attributes.all(d, device.attributes[d].all(k, true))"))
    assert not selector.within_cost_limit
    result = selector.evaluate(DEVICE)
    assert result.matched and not result.undetermined


def test_a_run_that_may_exceed_the_limit_is_undetermined_not_false() -> None:
    selector = compile_selector(loops(400_000, "true"))
    result = selector.evaluate(DEVICE)
    assert (result.matched, result.undetermined) == (False, True)
    assert f"{SELECTOR_MAX_COST:,}" in (result.error or "")
    # The libraries' tests evaluate regardless, as compile.go's Options.CostLimit allows.
    assert selector.evaluate(DEVICE, cost_limit=None).undetermined  # cel-cpp's loop budget, below


def test_cel_cpps_loop_budget_is_undetermined_not_an_error() -> None:
    result = compile_selector(loops(20_000, "true")).evaluate(DEVICE)
    assert result.undetermined and "10,000" in (result.error or "")


def test_explain_says_it_cannot_tell() -> None:
    device, memo, expression = Device(driver=DRIVER, pool="pool", spec={"name": "gpu-0"}), SelectorMemo(), loops(400_000, "true")
    matched, error = memo.outcome(expression, device)
    assert not matched and (error or "").startswith("cannot tell:") and memo.undetermined(expression, device)
