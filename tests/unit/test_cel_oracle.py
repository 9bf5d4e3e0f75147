"""gpudra's CEL evaluator against Kubernetes' own (tests/celoracle.py: the k8s.io/dynamic-resource-
allocation/cel library kube-apiserver and kube-scheduler run), case by case, for each release
gpudra supports with the evaluator set to that release:

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

import pytest
from celcases import FAMILIES
from celoracle import RELEASES, ask, minor_of
from explaincases import generate

from gpudra_operator.cel import SelectorCompileError, compile_selector, device_input
from gpudra_operator.cel.cost import device_sizes, runtime_bound
from gpudra_operator.cel.releases import CelRelease, release_of

CORPUS_MODULES = ("test_cel_selector", "test_cel_cost", "test_cel_netlibs")
SOME_FAMILIES = ("attribute maps, keys", "regex on an attribute", "quantity equality", "lists extension", "sets",
            "exists_one, map, filter", "conditional", "semver", "string ordering", "optional",
            "two-variable all, key sizes", "transformMap, transformList", "cross-type ordering",
            "function-form matches", "includes")


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
# Until 1.37, startsWith is estimated at its prefix and run at its receiver: with 64-character
# values the run costs about twice the estimate. 9,000 loops: admitted (estimate 945,012), stopped
# at run time before 1.37; 4,000: admitted and run to the end (900,012), where the bound must still
# hold. Every release stops the last, which the API server would refuse (its estimate is past the
# limit too: stored before a release lowered it, or written into etcd).
_PREFIXES = " || ".join(['device.attributes["long.example.com"].s.startsWith("a")'] * 20)
_CONTAINS = " || ".join(['device.attributes["long.example.com"].s.contains("ab")'] * 20)
RUN_TIME_CASES = [(f"lists.range({n}).exists(i, {_PREFIXES})", LONG) for n in (9000, 4000)]
RUN_TIME_CASES.append((f"lists.range(9000).exists(i, {_CONTAINS})", LONG))


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
    # cel-go's paths are Go slices: an append into a slice with room writes over its siblings' last
    # name (cost.go pushIterKey/pushIterValue; an index on a bound map), and sizes read it later.
    'device.capacity["x.io"].all(k, v, k == "memory12345memory12345")',
    'device.attributes["x.io"].exists(k, v, k == "memory12345memory12345memory12345memory12345")',
    'device.attributes.all(d, v, v.all(k, v[k] == "x" || k == "memory12345memory12345memory12345memory12345"))',
    'cel.bind(m, device.capacity["x.io"], m.all(k, m[k].isGreaterThan(quantity("1")) && k == "memory12345memory1"))',
    'cel.bind(m, device.capacity["x.io"], m.all(k, k == "memory12345memory1" && m[k].isGreaterThan(quantity("1"))))',
    'cel.bind(m, device.capacity["x.io"], m.a == m["b"] || m["b"] == m.a)',
    # the two-variable comprehensions; ordering across numeric types
    'device.capacity["x.io"].transformMap(k, v, k == "memory", v.isGreaterThan(quantity("80Gi"))).size() < 2',
    'device.attributes["x.io"].transformMapEntry(k, v, k != "s", {k + "!": v}).size() < 33',
    'device.attributes["x.io"].transformList(k, v, k + string(v)).exists(s, s.size() > 3)',
    'device.attributes["x.io"].existsOne(k, v, k == "s") || device.attributes["x.io"].exists_one(k, v, v == 0)',
    '[1.5, 2.5].all(x, x < 4) && 1 < 1.5 && 2u >= 1 && dyn(1.0) == 1 && -1 < 0u',
    '1 == 1.0',
    # includes: 1.36's errs past 48 values
    'lists.range(49).includes(48) || lists.range(48).includes(47)', 'lists.range(48).includes(48)',
    'device.attributes["long.example.com"].s.includes("x") || device.attributes["x.io"].includes(1)',
    # sortBy, expanded as cel-go's macro is; with equal keys, Go's (unstable) sort's order.
    '[3, 1, 2].sortBy(x, -x) == [3, 2, 1]', '["b", "a", "c"].sortBy(s, s) == ["a", "b", "c"]',
    '[[2, 1], [1]].sortBy(l, l.sortBy(x, x)[0]) == [[1], [2, 1]]', '"abc".sortBy(x, x) == []',
    '[1, 2, 3].sortBy(x, [x]) == [1, 2, 3]', '[].sortBy(x, x) == []',
    # (the orders gpudra computes: Kubernetes must find the same)
    'lists.range(40).sortBy(i, i % 3) == [15, 39, 36, 3, 33, 30, 6, 27, 24, 9, 0, 21, 12, 18, 10, 4, 16, 1, 13, 19, 37, 34, 22, 31, 28, 25, 7, 14, 8, 29, 5, 23, 32, 26, 11, 35, 2, 20, 38, 17]',
    'lists.range(300).sortBy(i, (i * 7919) % 13) == [273, 52, 221, 195, 299, 156, 234, 130, 117, 169, 91, 39, 182, 13, 247, 65, 143, 78, 286, 104, 208, 0, 260, 26, 72, 280, 241, 20, 176, 111, 150, 163, 215, 33, 59, 137, 189, 202, 267, 293, 85, 254, 7, 228, 98, 124, 46, 144, 209, 92, 261, 1, 157, 53, 196, 118, 131, 40, 170, 14, 79, 287, 248, 274, 235, 105, 66, 183, 27, 222, 281, 151, 242, 73, 138, 21, 177, 112, 203, 60, 34, 125, 268, 216, 229, 8, 86, 99, 294, 190, 164, 255, 47, 80, 249, 93, 223, 2, 158, 171, 288, 15, 145, 28, 236, 275, 106, 184, 210, 132, 41, 67, 262, 54, 197, 119, 191, 230, 217, 61, 165, 295, 204, 113, 256, 48, 126, 243, 9, 87, 152, 100, 282, 22, 269, 178, 139, 35, 74, 172, 237, 211, 185, 276, 133, 81, 68, 250, 16, 29, 107, 146, 42, 263, 289, 94, 198, 3, 224, 159, 120, 55, 75, 192, 88, 244, 166, 218, 101, 296, 62, 153, 10, 257, 205, 114, 49, 231, 36, 179, 127, 283, 270, 140, 23, 121, 173, 277, 30, 134, 82, 4, 238, 225, 69, 95, 160, 186, 147, 199, 264, 43, 17, 251, 212, 290, 56, 108, 37, 219, 258, 206, 11, 115, 154, 102, 297, 63, 167, 50, 245, 284, 180, 141, 89, 193, 24, 76, 128, 271, 232, 122, 109, 161, 5, 291, 174, 148, 226, 239, 18, 70, 83, 135, 96, 278, 187, 31, 265, 200, 57, 213, 252, 44, 142, 12, 103, 233, 207, 259, 116, 298, 168, 155, 77, 51, 285, 38, 90, 181, 194, 129, 272, 64, 220, 246, 25, 71, 266, 279, 32, 136, 19, 123, 175, 214, 240, 97, 188, 162, 227, 58, 292, 149, 6, 84, 201, 253, 45, 110]',
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


def ours(expression: str, device: dict[str, Any], release: CelRelease) -> tuple[str | None, int | None, Any]:
    try:
        selector = compile_selector(expression, release)
    except SelectorCompileError as error:
        return "error", None, None
    return None, selector.max_cost, selector.evaluate(device_input(device["driver"], device))


@pytest.mark.parametrize("oracle", RELEASES)
def test_gpudra_answers_as_kubernetes_on_every_case(oracle: str) -> None:
    release = release_of(minor_of(oracle))
    expressions, devices, pairs = corpus()
    queries = [(e, d) for e in expressions for d in devices] + pairs
    answers = ask(queries, oracle)
    disagreements: list[str] = []
    counted = {"cases": len(queries), "compiled": 0, "undetermined": 0, "cost-stopped": 0}
    for (expression, device), theirs in zip(queries, answers):
        failure, max_cost, result = ours(expression, device, release)
        where = f"{expression!r} on {device['driver']}/{device['name']}"
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
            sizes = device_sizes(device["driver"], attributes, capacity)
            bound = runtime_bound(compile_selector(expression, release).checked, sizes, release)
            if bound < theirs.actual_cost:
                disagreements.append(f"{where}: per-device bound {bound} below the actual cost {theirs.actual_cost}")
    print(f"\n[cel-oracle {oracle}] {counted}")
    # One line per expression (the first device it disagrees on): a rule that differs shows once.
    distinct = list({line.split("' on ")[0]: line for line in reversed(disagreements)}.values())[::-1]
    assert not disagreements, f"{len(disagreements)} disagreements, {len(distinct)} expressions:\n" + "\n".join(distinct[:60])
    # The corpus must reach the interesting paths, or agreeing proves little.
    assert counted["compiled"] > 1000 and counted["cost-stopped"] > 0 and counted["undetermined"] > 0
