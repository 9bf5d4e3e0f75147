"""contains(): the compare-before-write check that keeps converged objects free of writes."""

from gpudra_core.diff import contains


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


def test_fields_this_manager_applied_and_no_longer_sends_are_found() -> None:
    from gpudra_core.diff import dropped_fields

    live = {"metadata": {"managedFields": [
        {"manager": "gpudra-operator", "operation": "Apply", "fieldsV1": {
            "f:metadata": {"f:annotations": {"f:example.com/owner": {}}},
            "f:spec": {"f:template": {"f:spec": {
                "f:nodeSelector": {},  # atomic: owned whole
                "f:tolerations": {},
                "f:containers": {'k:{"name":"agent"}': {".": {}, "f:name": {}, "f:resources": {"f:limits": {"f:memory": {}}}}},
            }}}}},
        {"manager": "kubectl", "operation": "Update", "fieldsV1": {"f:metadata": {"f:labels": {"f:x": {}}}}}]},
        "spec": {"template": {"spec": {"nodeSelector": {"a": "1", "b": "2"}, "tolerations": [{"key": "k"}],
                                       "containers": [{"name": "agent", "resources": {"limits": {"memory": "1Gi"}}}]}}}}
    same = {"metadata": {"annotations": {"example.com/owner": "x"}},
            "spec": {"template": {"spec": {"nodeSelector": {"a": "1", "b": "2"}, "tolerations": [{"key": "k"}],
                                           "containers": [{"name": "agent", "resources": {"limits": {"memory": "1Gi"}}}]}}}}
    assert dropped_fields(live, same, "gpudra-operator") == []
    assert dropped_fields(live, {}, "someone-else") == []  # another manager's fields are not ours to drop
    fewer = {"metadata": {}, "spec": {"template": {"spec": {
        "nodeSelector": {"a": "1"}, "containers": [{"name": "agent"}]}}}}
    assert sorted(dropped_fields(live, fewer, "gpudra-operator")) == [
        "metadata.annotations",
        'spec.template.spec.containers[{"name":"agent"}].resources',
        "spec.template.spec.nodeSelector.{b}",
        "spec.template.spec.tolerations",
    ]
