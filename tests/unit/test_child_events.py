"""What an event on a config's child calls for (childevents.child_event_action): a deletion or a
hand edit is repaired by a full reconcile; the echo of the operator's own write or prune, or a
DaemonSet whose status moved, is not (a DaemonSet's status is reported again)."""

from __future__ import annotations

import copy

import pytest

from gpudra_operator.childevents import child_event_action

DESIRED_DS = {"apiVersion": "apps/v1", "kind": "DaemonSet",
              "metadata": {"name": "gpudra-agent", "namespace": "gpudra-system",
                           "labels": {"app.kubernetes.io/managed-by": "gpudra-operator", "gpudra.io/config": "c"}},
              "spec": {"template": {"spec": {"containers": [{"name": "agent", "image": "example.com/gpudra:1"}]}}}}
DESIRED_CLASS = {"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass",
                 "metadata": {"name": "big.gpudra.io", "labels": {"gpudra.io/config": "c"}},
                 "spec": {"selectors": [{"cel": {"expression": 'device.driver == "gpu.gpudra.io"'}}]}}


def live(desired: dict) -> dict:
    """``desired`` as the API server returns it (defaults, metadata, status added)."""
    obj = copy.deepcopy(desired)
    obj["metadata"].update(uid="u", resourceVersion="7", generation=1)
    if obj["kind"] == "DaemonSet":
        obj["spec"]["template"]["spec"]["containers"][0]["imagePullPolicy"] = "IfNotPresent"
        obj["status"] = {"desiredNumberScheduled": 3, "numberReady": 1}
    return obj


def action(event_type: str | None, child: dict, desired: dict | None, reconciled: bool = True) -> str:
    return child_event_action(event_type, child, desired, reconciled=reconciled)


@pytest.mark.parametrize("event_type", ["ADDED", "MODIFIED", None])
def test_a_daemonset_as_written_only_has_its_status_reported(event_type: str | None) -> None:
    assert action(event_type, live(DESIRED_DS), DESIRED_DS) == "status"


def test_echoes_of_writes_and_prunes_need_nothing() -> None:
    assert action("MODIFIED", live(DESIRED_CLASS), DESIRED_CLASS) == "none"
    assert action("DELETED", live(DESIRED_CLASS), None) == "none"  # a class that left the spec, pruned


def test_hand_edits_deletions_and_unknown_children_are_reconciled() -> None:
    edited = live(DESIRED_DS)
    edited["spec"]["template"]["spec"]["containers"][0]["image"] = "evil.example.com/x:1"
    assert action("MODIFIED", edited, DESIRED_DS) == "reconcile"
    unlabelled = live(DESIRED_CLASS)
    del unlabelled["metadata"]["labels"]["gpudra.io/config"]
    assert action("MODIFIED", unlabelled, DESIRED_CLASS) == "reconcile"
    assert action("DELETED", live(DESIRED_CLASS), DESIRED_CLASS) == "reconcile"  # a wanted one, in its last state
    assert action("ADDED", live(DESIRED_CLASS), None) == "reconcile"  # one that should not be there: pruned
    for event_type in ("MODIFIED", "DELETED", None):  # nothing to compare with yet (the operator just started)
        assert action(event_type, live(DESIRED_DS), DESIRED_DS, reconciled=False) == "reconcile"
