"""The DRA selector evaluator (gpudra_operator.cel): the Kubernetes libraries against upstream's own
documented examples (k8s.io/apiserver/pkg/cel/library/quantity.go, semverlib.go, lists.go), and the
``device`` variable against k8s.io/dynamic-resource-allocation/cel/compile.go's semantics."""

from __future__ import annotations

import pytest

from gpudra_operator.cel import SelectorCompileError, SelectorResult, compile_selector, device_input
from gpudra_operator.cel.releases import release_of

DRIVER = "gpu.gpudra.io"
H100 = device_input(DRIVER, {
    "name": "gpu-0",
    "attributes": {
        "type": {"string": "gpu"},
        "index": {"int": 0},
        "productName": {"string": "NVIDIA H100 80GB HBM3"},
        "cudaComputeCapability": {"version": "9.0.0"},
        "resource.kubernetes.io/pciBusID": {"string": "0000:3b:00.0"},
    },
    "capacity": {"memory": {"value": "81559Mi"}, "shares": {"value": "4"}},
    "allowMultipleAllocations": True,
})


def evaluate(expression: str, device=H100) -> SelectorResult:
    # The semantics and the libraries, without the cost gate (tests/unit/test_cel_cost.py has it):
    # some library cases are selectors the API server refuses as too costly.
    return compile_selector(expression).evaluate(device, cost_limit=None)


def value_of(expression: str) -> bool:
    result = evaluate(expression)
    assert result.error is None, result.error
    return result.matched


@pytest.mark.parametrize("expression", [
    # quantity.go's examples
    'quantity("200M").compareTo(quantity("0.2G")) == 0',
    'quantity("50M").compareTo(quantity("50Mi")) == -1',
    'quantity("50Mi").compareTo(quantity("50M")) == 1',
    'quantity("150Mi").isGreaterThan(quantity("100Mi"))',
    '!quantity("50Mi").isGreaterThan(quantity("100Mi"))',
    'quantity("50M").isLessThan(quantity("100M"))',
    'quantity("50000000G").isInteger()',
    'quantity("50k").asInteger() == 50000',
    '!quantity("9999999999999999999999999999999999999G").isInteger()',
    'quantity("50k").sub(20000).asApproximateFloat() == 30000.0',
    'quantity("50k").add(20) == quantity("50020")',
    'quantity("50k").sub(quantity("20k")) == quantity("30k")',
    'quantity("50k").add(20).sub(quantity("100k")).sub(-50000) == quantity("20")',
    'isQuantity("1.3Gi") && !isQuantity("200K") && isQuantity("Mi")',  # ParseQuantity reads "Mi" as 0 (cel-oracle)
    'sign(quantity("-1k")) == -1 && sign(quantity("0")) == 0',
    'quantity("1Gi") == quantity("1024Mi")',  # Equal is Cmp == 0, whatever the spelling
    # semverlib.go's examples
    'semver("1.2.3").compareTo(semver("1.2.3")) == 0',
    'semver("1.2.3").compareTo(semver("2.0.0")) == -1',
    'semver("1.2.3").compareTo(semver("0.1.2")) == 1',
    'semver("1.2.3").major() == 1 && semver("1.2.3").minor() == 2 && semver("1.2.3").patch() == 3',
    'semver("v1.0.0", true) == semver("1.0.0") && semver("01.01.01", true) == semver("1.1.1")',
    'isSemver("1.0.0") && !isSemver("hello") && !isSemver("v1.0") && isSemver("v1.0", true)',
    'semver("1.0.0-alpha").isLessThan(semver("1.0.0-alpha.1"))',  # semver.org precedence
    'semver("1.0.0-alpha.1").isLessThan(semver("1.0.0-alpha.beta"))',
    'semver("1.0.0-rc.1").isLessThan(semver("1.0.0"))',
    'semver("1.0.0+a") == semver("1.0.0+b")',  # build metadata does not count
    # lists.go's examples, cel-go's sets and lists extensions, strings v2
    '[1, 2, 3].isSorted() && ![2, 1].isSorted()',
    '[1, 2, 3].sum() == 6 && [1.0, 2.5].sum() == 3.5',
    '[1, 2, 3].max() == 3 && ["b", "a"].min() == "a"',
    '[1, 2, 2, 3].indexOf(2) == 1 && [1, 2, 2, 3].lastIndexOf(2) == 2 && [1].indexOf(5) == -1',
    'sets.contains([1, 2, 3], [3, 1]) && sets.equivalent([1, 2], [2, 1, 1]) && sets.intersects([1], [1, 2])',
    '[3, 1, 2].sort() == [1, 2, 3] && [1, 1, 2].distinct() == [1, 2] && [[1], [2]].flatten() == [1, 2]',
    'lists.range(3) == [0, 1, 2] && [1, 2, 3].slice(1, 3) == [2, 3] && [1, 2].reverse() == [2, 1]',
    '"a,b".split(",") == ["a", "b"] && "ABC".lowerAscii() == "abc" && ["a", "b"].join("-") == "a-b"',
    # cel-go's optional library (cel/library.go, cel_test.go): first and last on lists
    '[1, 2, 3].first().value() == 1 && [1, 2, 3].last() == optional.of(3) && ![].first().hasValue()',
])
def test_kubernetes_libraries_answer_as_upstream_documents(expression: str) -> None:
    assert value_of(expression) is True


@pytest.mark.parametrize("expression, error", [
    ('quantity("200K").sign() == 1', None),  # sign is a global function upstream: compile error
    ('quantity("200K") == quantity("1")', "quantities"),
    ('quantity("1.5").asInteger() == 1', "cannot convert value to integer"),
    ('[1].slice(1, 0) == []', "start index must be less than or equal to end index"),
    ('[0].max() < [].max()', "max called on empty list"),
    ('semver("1.0").major() == 1', "not a semantic version"),
])
def test_library_errors_are_errors_not_false(expression: str, error: str | None) -> None:
    if error is None:
        with pytest.raises(SelectorCompileError):
            compile_selector(expression)
        return
    result = evaluate(expression)
    assert result.matched is False
    if error != "quantities":
        assert error in (result.error or "")
    else:
        assert "not a Kubernetes quantity" in (result.error or "")


def test_device_variable_is_the_schedulers() -> None:
    assert value_of(f'device.driver == "{DRIVER}"')
    assert value_of('device.allowMultipleAllocations')
    assert value_of(f'device.attributes["{DRIVER}"].type == "gpu"')  # a bare name is in the driver's domain
    assert value_of('device.attributes["resource.kubernetes.io"].pciBusID.startsWith("0000:3b")')
    assert value_of(f'device.capacity["{DRIVER}"].memory.isGreaterThan(quantity("80G"))')
    assert value_of(f'device.capacity["{DRIVER}"].memory.compareTo(quantity("81559Mi")) == 0')
    assert value_of(f'device.attributes["{DRIVER}"].cudaComputeCapability.isGreaterThan(semver("8.0.0"))')
    assert value_of(f'cel.bind(gpu, device.attributes["{DRIVER}"], gpu.index == 0 && gpu.type == "gpu")')
    # an int attribute compared with a double: cross-type at run time, as cel-go
    assert value_of(f'device.attributes["{DRIVER}"].index < 0.5')
    # heterogeneous equality is false, not an error
    assert evaluate(f'device.attributes["{DRIVER}"].index == "0"') == SelectorResult(False)


def test_a_missing_attribute_is_an_error_not_false() -> None:
    missing = evaluate(f'device.attributes["{DRIVER}"].memoryBandwidth > 5')
    assert missing.matched is False and missing.error == "no such key: memoryBandwidth"
    # an unknown domain is an empty map (newStringInterfaceMapWithDefault): its keys are errors,
    # membership and has() are plain false
    assert evaluate('device.attributes["example.com"].model == "x"').error == "no such key: model"
    assert evaluate('"model" in device.attributes["example.com"]') == SelectorResult(False)
    assert evaluate('has(device.capacity["example.com"].memory)') == SelectorResult(False)
    # errors are absorbed by || and && as CEL says, in either order
    assert evaluate(f'device.attributes["{DRIVER}"].nope == 1 || true') == SelectorResult(True)
    assert evaluate(f'false && device.attributes["{DRIVER}"].nope == 1') == SelectorResult(False)


def test_a_malformed_device_is_an_error_before_evaluation() -> None:
    bad_version = device_input(DRIVER, {"name": "g", "attributes": {"v": {"version": "1.0"}}})
    assert "parse semantic version" in (evaluate("true", bad_version).error or "")
    bad_capacity = device_input(DRIVER, {"name": "g", "capacity": {"memory": {"value": "lots"}}})
    assert "capacity memory" in (evaluate("true", bad_capacity).error or "")


def test_compile_errors_say_why() -> None:
    with pytest.raises(SelectorCompileError) as syntax:
        compile_selector("device.driver ==")
    assert "Syntax error" in syntax.value.message
    with pytest.raises(SelectorCompileError, match="must evaluate to bool"):
        compile_selector('device.driver + "x"')
    with pytest.raises(SelectorCompileError, match="exceeds 10240 bytes"):
        compile_selector("true || " * 1300 + "true")


# cel-go's two-variable comprehensions (ext.TwoVarComprehensions: the first variable is a list's
# index or a map's key, the second its value) and ordering across numeric types
# (cel.CrossTypeNumericComparisons), both in the Kubernetes base environment.
@pytest.mark.parametrize(("expression", "expected"), [
    ('device.attributes["gpu.gpudra.io"].all(k, v, k != "")', True),
    ('device.attributes["gpu.gpudra.io"].exists(k, v, k == "index" && v == 0)', True),
    ('device.attributes["gpu.gpudra.io"].existsOne(k, v, k.startsWith("pro"))', True),
    ('device.attributes["gpu.gpudra.io"].exists_one(k, v, v == "gpu")', True),
    ('["a", "b", "c"].all(i, s, i < 3 && s.size() == 1)', True),
    ('["a", "b"].exists(i, s, i == 1 && s == "a")', False),
    ('[10, 20, 30].transformList(i, x, x + i) == [10, 21, 32]', True),
    ('[10, 20, 30].transformList(i, x, i > 0, x * 2) == [40, 60]', True),
    ('device.attributes["gpu.gpudra.io"].transformList(k, v, k).size() == 4', True),
    ('device.attributes["gpu.gpudra.io"].transformMap(k, v, k.size())["productName"] == 11', True),
    ('device.capacity["gpu.gpudra.io"].transformMap(k, v, k == "memory", v.isGreaterThan(quantity("80Gi"))) '
     '== {"memory": false}', True),
    ('["a", "b"].transformMap(i, s, s + "!") == {0: "a!", 1: "b!"}', True),
    ('["x", "y"].transformMapEntry(i, s, {s: i}) == {"x": 0, "y": 1}', True),
    ('["x", "y"].transformMapEntry(i, s, i == 1, {s: i}).size() == 1', True),
    ('device.attributes["gpu.gpudra.io"].index < 1.5 && 1 < 1.5', True),
    ('2u > 1 && 1.5 >= 1u && -1 < 0u && !(3 <= 2.5)', True),
    ('device.attributes["gpu.gpudra.io"].index >= 0.5', False),
])
def test_two_variable_comprehensions_and_cross_type_ordering_as_cel_go_runs_them(expression: str,
                                                                                  expected: bool) -> None:
    assert value_of(expression) is expected


def test_a_map_built_with_a_key_twice_is_an_error_as_in_cel_go() -> None:
    # cel-go common/types InsertMapKeyValue: "insert failed: key %v already exists"
    result = evaluate('["x", "x"].transformMapEntry(i, s, {s: i}).size() == 1')
    assert not result.matched and result.error == "insert failed: key x already exists"
    # true and 1 are two keys in CEL and one in a Python dict: not answered, never answered wrong
    mixed = evaluate('[dyn(true), dyn(1)].transformMapEntry(i, k, {k: i}).size() == 2')
    assert mixed.undetermined and "bool key and an int key" in (mixed.error or "")
    with pytest.raises(SelectorCompileError, match="duplicate|different"):
        compile_selector('[1].all(x, x, x > 0)')


# What differs by release (gpudra_operator.cel.releases): each case's answer on 1.35, 1.36, 1.37;
# None: it does not compile there.
@pytest.mark.parametrize(("expression", "answers"), [
    # Go 1.26's urlstrictcolons, from 1.36: an http(s) host with two colons is not a URL
    ("isURL('http://localhost:1:2')", (True, False, False)),
    ("isURL('https://a:b:8080/x') && !isURL('https://a:b:80x')", (True, False, False)),
    ("isURL('ftp://localhost:1:2') && url('ftp://localhost:1:2').getPort() == '2'", (True, True, True)),
    ("format.uri().validate('http://h:1:2').hasValue()", (False, True, True)),
    # includes: the DRA compiler's in 1.36's scheduler, the list library's from 1.37
    ("[1, 2, 3].includes(2) && !['a'].includes('b')", (None, True, True)),
    ('device.attributes["gpu.gpudra.io"].productName.includes("NVIDIA H100 80GB HBM3")', (None, True, True)),
])
def test_what_a_selector_does_depends_on_the_clusters_release(expression: str,
                                                               answers: tuple[bool | None, ...]) -> None:
    for minor, expected in zip((35, 36, 37), answers):
        release = release_of(minor)
        if expected is None:
            with pytest.raises(SelectorCompileError, match="includes"):
                compile_selector(expression, release)
            continue
        result = compile_selector(expression, release).evaluate(H100, cost_limit=None)
        assert (result.matched, result.error) == (expected, None), (minor, result)


def test_includes_refuses_a_list_past_48_values_on_1_36_only() -> None:
    expression = "lists.range(49).includes(48)"
    limited = compile_selector(expression, release_of(36)).evaluate(H100, cost_limit=None)
    assert not limited.matched and limited.error == "'includes' function cannot be applied to lists longer than 48 values"
    assert compile_selector(expression, release_of(37)).evaluate(H100, cost_limit=None) == SelectorResult(True)


def test_an_unknown_release_is_the_oldest_and_a_newer_one_the_newest() -> None:
    assert release_of(None) == release_of(35) == release_of(30)
    assert release_of(99) == release_of(37) and release_of(37).has_includes
