"""contains(): the compare-before-write check that keeps converged objects free of writes."""

from gpudra_driver.diff import contains, quantity_value


def test_extra_live_fields_are_ignored_and_lists_compare_whole() -> None:
    live = {"spec": {"a": 1, "b": [1, 2], "status": "x"}, "metadata": {"uid": "u"}}
    assert contains(live, {"spec": {"a": 1, "b": [1, 2]}})
    assert not contains(live, {"spec": {"b": [1]}})
    assert not contains(live, {"spec": {"a": 2}})
    assert not contains(live, {"spec": {"missing": 1}})


def test_canonicalised_quantities_equal_what_was_asked_for() -> None:
    assert contains({"cpu": "500m"}, {"cpu": "0.5"})
    assert contains({"memory": "1Gi"}, {"memory": "1024Mi"})
    assert contains({"cpu": "1"}, {"cpu": 1})
    assert contains({"memory": "1k"}, {"memory": "1e3"})
    assert not contains({"cpu": "501m"}, {"cpu": "0.5"})
    assert not contains({"image": "nginx:1"}, {"image": "nginx:1.0"})
    assert not contains({"flag": "True"}, {"flag": True})


def test_quantity_value() -> None:
    assert quantity_value("81559Mi") == 81559 * 2**20
    assert quantity_value("2") == 2 and quantity_value(3) == 3
    assert quantity_value("gpu") is None and quantity_value(None) is None and quantity_value(True) is None
