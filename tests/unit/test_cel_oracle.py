"""gpudra's CEL evaluator against Kubernetes' own (tests/celoracle.py: the k8s.io/dynamic-resource-
allocation/cel library kube-apiserver and kube-scheduler run), case by case:

* the corpus: every selector the CEL unit tests use, the cost families, and the random selectors
  of the explain differential test (tests/explaincases.py), on the devices of the GPU profiles;
* compiling: where Kubernetes refuses a selector, gpudra refuses it too;
* the estimated cost: equal to the unit;
* evaluating: the same match and the same error-or-not on every device; where the scheduler stops
  a run at the cost limit, gpudra answers "undetermined", and its per-device bound is never below
  the cost the scheduler's run actually counted."""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from typing import Any

from celcases import FAMILIES
from celoracle import ask
from explaincases import generate

from gpudra_operator.cel import SelectorCompileError, compile_selector, device_input
from gpudra_operator.cel.cost import device_sizes, runtime_bound

CORPUS_MODULES = ("test_cel_selector", "test_cel_cost", "test_cel_netlibs")
SOME_FAMILIES = ("attribute maps, keys", "regex on an attribute", "quantity equality", "lists extension", "sets",
            "exists_one, map, filter", "conditional", "semver", "string ordering", "optional")


def parametrized_expressions() -> Iterator[str]:
    """The first string argument of every parametrized case in the CEL unit tests."""
    for name in CORPUS_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError:
            continue
        for attribute in vars(module).values():
            for mark in getattr(attribute, "pytestmark", []):
                if mark.name != "parametrize":
                    continue
                for case in mark.args[1]:
                    value = case[0] if isinstance(case, tuple) else getattr(case, "values", (case,))[0]
                    if isinstance(value, str) and value:
                        yield value


LONG = {"driver": "long.example.com", "name": "gpu-long",
        "attributes": {"s": {"string": "x" * 64}, "index": {"int": 0}}}
# startsWith is estimated at its prefix and run at its receiver: with 64-character values the run
# costs about twice the estimate. 9,000 loops: admitted (estimate 945,012), stopped at run time;
# 4,000: admitted and run to the end (900,012), where the bound must still hold.
_PREFIXES = " || ".join(['device.attributes["long.example.com"].s.startsWith("a")'] * 20)
RUN_TIME_CASES = [(f"lists.range({n}).exists(i, {_PREFIXES})", LONG) for n in (9000, 4000)]


# Upstream's domain maps find every key (an absent domain is an empty map) but hold only the
# device's own domains: lookups, presence, size, keys and "in" over them.
DOMAIN_CASES = [
    'device.attributes.exists(d, d == "b.io") || device.attributes["b.io"].size() > 5',
    'size(device.attributes) == 1 && device.attributes["b.io"].size() == 0',
    '"b.io" in device.attributes || device.attributes["b.io"].size() > 0',
    "has(device.attributes.foo) && has(device.capacity.foo)",
    "device.attributes.foo.size() == 0",
    'device.attributes["x.io"].y == 1',
    'has(device.attributes["long.example.com"].s) && !has(device.attributes["x.io"].s)',
    'device.attributes.all(d, device.attributes[d].size() > 0) && device.capacity["x.io"].size() == 0',
    'cel.bind(a, device.attributes["x.io"], a.size() == 0 && !("s" in a))',
    'device.attributes[device.driver].size() > 0 && device.attributes[device.driver + "x"].size() == 0',
]


# Library edges: the BinarySI cap is on the magnitude, both signs; replace's result sizes.
EDGE_CASES = [
    *(f'device.attributes["long.example.com"].s.replace({old}, {new}).matches("x+")'
      for old, new in (('"a"', '"bbb"'), ('"abc"', '"b"'), ('""', '"b"'), ('"ab"', '"cd"'))),
    'quantity("-16Ei").compareTo(quantity("-9223372036854775807")) == 0',
    # Literals of one type only (cel.ValidateHomogeneousAggregateLiterals), "format"'s exempt.
    '[1, "a"].size() == 2', '[1, dyn("a")].size() == 2', '{"a": 1, "b": "x"}.size() == 2',
    '[[1], [dyn("a")]].size() == 2', '[[], [1]].size() == 2', '[optional.of(1), optional.none()].size() == 2',
    '"%s %d".format(["a", 1]) == ""', '[{"a": 1}, {}].size() == 2', '[device.attributes["x.io"].s, "x"].size() == 2',
    "format.uri() == format.uri()",
    'quantity("16Ei").compareTo(quantity("9223372036854775807")) == 0',
]


def corpus() -> tuple[list[str], list[dict[str, Any]], list[tuple[str, dict[str, Any]]]]:
    """(expressions for every device, devices, extra (expression, device) pairs)."""
    expressions = sorted(set(parametrized_expressions())) + DOMAIN_CASES + EDGE_CASES
    expressions += [FAMILIES[name](n) for name in SOME_FAMILIES for n in (1, 7)]
    cases = generate(seed=7, count=40, run_id="oracle")
    devices: list[dict[str, Any]] = []
    pairs: list[tuple[str, dict[str, Any]]] = []
    for case in cases:
        case_devices = [{"driver": s["spec"]["driver"], **d} for s in case.slices for d in s["spec"]["devices"]]
        devices += case_devices[:1]
        selectors = [s["cel"]["expression"] for s in case.device_class["spec"].get("selectors", [])]
        for request in case.claim_spec["devices"]["requests"]:
            for alternative in request.get("firstAvailable") or [request.get("exactly") or {}]:
                selectors += [s["cel"]["expression"] for s in alternative.get("selectors", [])]
        pairs += [(e, d) for e in selectors for d in case_devices]
    return expressions, devices + [LONG], pairs + RUN_TIME_CASES


def ours(expression: str, device: dict[str, Any]) -> tuple[str | None, int | None, Any]:
    try:
        selector = compile_selector(expression)
    except SelectorCompileError as error:
        return ("unsupported" if error.unsupported else "error"), None, None
    return None, selector.max_cost, selector.evaluate(device_input(device["driver"], device))


def test_gpudra_answers_as_kubernetes_on_every_case() -> None:
    expressions, devices, pairs = corpus()
    queries = [(e, d) for e in expressions for d in devices] + pairs
    answers = ask(queries)
    disagreements: list[str] = []
    counted = {"cases": len(queries), "compiled": 0, "unsupported": 0, "undetermined": 0, "cost-stopped": 0}
    for (expression, device), theirs in zip(queries, answers):
        failure, max_cost, result = ours(expression, device)
        where = f"{expression!r} on {device['driver']}/{device['name']}"
        if failure == "unsupported":
            counted["unsupported"] += 1
            continue
        if theirs.compile_error is not None:
            if failure is None:
                disagreements.append(f"{where}: Kubernetes refuses it ({theirs.compile_error[:160]}), gpudra compiles it")
            continue
        if failure is not None:
            disagreements.append(f"{where}: gpudra refuses what Kubernetes compiles")
            continue
        counted["compiled"] += 1
        if max_cost != theirs.max_cost:
            disagreements.append(f"{where}: estimated cost {max_cost}, Kubernetes {theirs.max_cost}")
        stopped = theirs.error is not None and "cost limit" in theirs.error
        counted["cost-stopped"] += stopped
        if result.undetermined:
            counted["undetermined"] += 1
            continue
        if stopped:
            disagreements.append(f"{where}: Kubernetes stops at the cost limit, gpudra answers {result}")
        elif (result.matched, result.error is not None) != (theirs.matches, theirs.error is not None):
            disagreements.append(f"{where}: gpudra {result}, Kubernetes matches={theirs.matches} error={theirs.error}")
        if theirs.actual_cost is not None and not stopped:
            attributes, capacity = device_input(device["driver"], device).maps
            bound = runtime_bound(compile_selector(expression).checked, device_sizes(device["driver"], attributes, capacity))
            if bound < theirs.actual_cost:
                disagreements.append(f"{where}: per-device bound {bound} below the actual cost {theirs.actual_cost}")
    print(f"\n[cel-oracle] {counted}")
    # One line per expression (the first device it disagrees on): a rule that differs shows once.
    distinct = list({line.split("' on ")[0]: line for line in reversed(disagreements)}.values())[::-1]
    assert not disagreements, f"{len(disagreements)} disagreements, {len(distinct)} expressions:\n" + "\n".join(distinct[:60])
    # The corpus must reach the interesting paths, or agreeing proves little.
    assert counted["compiled"] > 1000 and counted["cost-stopped"] > 0 and counted["undetermined"] > 0
