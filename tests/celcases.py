"""Selector families whose CEL cost grows with a size ``n``, each exercising other cost rules
(device paths and their declared sizes, string and regex functions, quantities, the list and set
extensions, macros and the two-variable comprehensions, ``cel.bind``, conditionals, ``has()``,
optionals). gpudra-allocator's cost estimate (Kubernetes' own CEL of the release) must draw the
same line as the API server (tests/integration/test_allocator_release.py)."""

from __future__ import annotations

from collections.abc import Callable

A = 'device.attributes["a.example.com"]'
CAP = 'device.capacity["a.example.com"]'


def literal_list(n: int) -> str:
    return "[" + ",".join("0" for _ in range(n)) + "]"


def ranged(body: str) -> Callable[[int], str]:
    return lambda n: f"lists.range({n}).all(i, {body})"


FAMILIES: dict[str, Callable[[int], str]] = {
    "nested literal lists": lambda n: f"{literal_list(n)}.all(i, {literal_list(40)}.all(j, i <= j))",
    "regex on an attribute": lambda n: f'{literal_list(n)}.all(i, {literal_list(20)}.all(j, {A}.name.matches("^a.*b+c?$")))',
    "attribute maps, keys": ranged('device.attributes.exists(d, device.attributes[d].exists(k, k.startsWith("abc")))'),
    "attribute values": ranged('device.attributes.all(d, device.attributes[d].all(k, device.attributes[d][k] == "x"))'),
    "quantity equality": ranged(f'{CAP}.memory == quantity("1Gi")'),
    "capacity compareTo": ranged('device.capacity.all(d, device.capacity[d].all(k, '
                                 'device.capacity[d][k].compareTo(quantity("1")) >= 0))'),
    "contains the driver": ranged(f"{A}.name.contains(device.driver)"),
    "in map, in list": ranged(f'"x" in {A} && i in [1, 2, 3, 4, 5, 6, 7]'),
    "strings extension": ranged(f'{A}.s.lowerAscii().split(",").join("-") != "x"'),
    "replace": ranged(f'{A}.s.replace("a", "bbb") == "x"'),
    "trim, substring, upper": ranged(f'{A}.s.trim().upperAscii().substring(1) == "x"'),
    "lists extension": ranged("[3, 1, 2].sort().distinct().reverse().slice(0, 2).size() > i"),
    "flatten": ranged("[[1], [2, 3]].flatten().size() > i"),
    "sets": ranged("sets.contains([1, 2, 3], [i]) || sets.equivalent([i], [1]) || sets.intersects([i], [2])"),
    "cel.bind and has": ranged(f"cel.bind(a, {A}, a.x == i && has(a.y))"),
    "exists_one, map, filter": ranged("[1, 2, 3].map(x, x * i).filter(y, y > 2).exists_one(z, z == 3)"),
    "conditional": ranged(f'i > 5 ? {A}.s.matches("x+y") : device.driver.endsWith("y")'),
    "semver": ranged(f'{A}.v == semver("1.0.0") || {A}.v.isGreaterThan(semver("1.2.3"))'),
    "string concatenation": ranged(f'{A}.s + "suffix" == device.driver + "x"'),
    "indexOf": ranged(f"[1, 2, 3].indexOf(i) >= 0 && {A}.s.indexOf(\"x\") >= 0"),
    "string ordering": ranged(f'{A}.s < "zzzz" && {A}.s >= device.driver'),
    "sizes": ranged(f"size({A}.s) + string(i).size() + size({A}) > 3"),
    "map literal": ranged('{"a": i, "b": 2}["a"] == i'),
    "dyn": ranged(f"dyn({A}.x) == 1"),
    "optional": ranged(f"{A}.?x.orValue(1) == 1"),
    # two-variable comprehensions, whose key paths cel-go's estimator reads as the values' (Go slices)
    "two-variable all, key sizes": ranged(f'{CAP}.all(k, v, k == "memory12345memory12345") && {A}.exists(k, v, v == k)'),
    "transformMap, transformList": ranged(f'{A}.transformMap(k, v, k != "x", string(v)).size() > 0 && '
                                          f'{CAP}.transformList(k, v, v.isGreaterThan(quantity("1"))).all(b, b)'),
    "cross-type ordering": ranged(f"{A}.x < 1.5 && 2u > i"),
    # costed like s.matches(re) from 1.37 (cel-go 0.29), at 1 before
    "function-form matches": ranged(f'matches({A}.name, "^a.*b+c?$") || matches(device.driver, "x+")'),
    "includes": ranged(f'{A}.name.includes("a") || [1, 2, 3].includes(i) || {A}.includes(size({A}.s))'),
}

# The families the API server admits only from a later release: the first minor. The scheduler has
# includes from 1.36 (the CEL of stored expressions), but a new expression may use only what the
# previous release had (the CEL compatibility version), so the list library's arrives in 1.38.
SINCE = {"includes": 38}
