"""status.devices from a watch (operator/gpudra_operator/devicecount.py), against the real API
server: unknown until the driver's slices were listed (page by page), then following creates,
updates and deletes, and no request at all to read it."""

from __future__ import annotations

import secrets

from counting import CountingKube
from gpudra_core.kubeapi import Kube, resource_type
from gpudra_operator.classcounts import ClassSelectors, class_selectors
from gpudra_operator.devicecount import DeviceCounts
from gpudra_dev.localcluster.objects import fake_slice
from gpudra_dev.localcluster.waiting import wait_for

SLICE = resource_type("resource.k8s.io/v1", "ResourceSlice")


async def test_the_count_follows_the_drivers_slices_without_a_request_per_read(kube: Kube) -> None:
    suffix = secrets.token_hex(3)
    driver, other = f"count{suffix}.gpudra.io", f"other{suffix}.gpudra.io"
    names = [f"count-{suffix}-{i}" for i in range(5)]
    for i, name in enumerate(names):  # 1 + 2 + 3 + 4 + 5 devices, listed two slices a page
        await kube.create(fake_slice(name, driver, f"node-{suffix}-{i}", devices=i + 1))
    await kube.create(fake_slice(f"other-{suffix}", other, f"node-{suffix}-x", devices=8))
    counting = CountingKube(kube.api, "gpudra-operator")
    counts = DeviceCounts(counting, page_size=2)
    try:
        assert counts.devices(driver) is None  # not listed yet: the reconciler keeps what status says

        async def count_is(expected: int) -> bool:
            return counts.devices(driver) == expected

        await wait_for(lambda: count_is(15), timeout=30, what="the first list")
        assert [m for m, _ in counting.requests] == ["GET"] * 3  # three pages, then the watch
        counting.requests.clear()
        for _ in range(100):
            assert counts.devices(driver) == 15
        assert counting.requests == []

        await kube.create(fake_slice(f"count-{suffix}-new", driver, f"node-{suffix}-new", devices=8))
        await wait_for(lambda: count_is(23), timeout=10, what="a new slice counted")
        await kube.delete(SLICE, names[4])
        await wait_for(lambda: count_is(18), timeout=10, what="a deleted slice uncounted")
        fewer = fake_slice(names[3], driver, f"node-{suffix}-3", devices=1)
        live = await kube.get(SLICE, names[3])
        assert live is not None
        fewer["metadata"]["resourceVersion"] = live["metadata"]["resourceVersion"]
        await kube.request("PUT", SLICE.path(name=names[3]), body=fewer)
        await wait_for(lambda: count_is(15), timeout=10, what="a changed slice recounted")
        assert counting.requests == []  # the watch carried all of it

        counts.forget(driver)
        assert counts.devices(driver) is None  # forgotten: listed again from scratch
    finally:
        await counts.close()
        for name in [*names, f"count-{suffix}-new", f"other-{suffix}"]:
            await kube.delete(SLICE, name)


async def test_class_counts_follow_a_change_of_the_classes_without_listing_the_slices_again(kube: Kube) -> None:
    suffix = secrets.token_hex(3)
    driver = f"classes{suffix}.gpudra.io"
    names = [f"classes-{suffix}-{i}" for i in range(3)]
    for i, name in enumerate(names):  # 1 + 2 + 3 devices, indexes 0..i on each node
        await kube.create(fake_slice(name, driver, f"node-{suffix}-{i}", devices=i + 1))

    minor = await kube.server_minor()  # matched by gpudra-allocator of the cluster's release

    def classes(threshold: int) -> tuple[ClassSelectors, ...]:
        return (class_selectors({"metadata": {"name": "low"}, "spec": {"selectors": [{"cel": {
            "expression": f'device.attributes["{driver}"].index < {threshold}'}}]}}, minor),)

    counting = CountingKube(kube.api, "gpudra-operator")
    counts = DeviceCounts(counting, page_size=2)
    try:
        async def low_is(wanted: tuple[int, int], threshold: int) -> bool:
            got = counts.class_counts(driver, classes(threshold), set())
            return got is not None and (got[0].devices, got[0].nodes_with_free) == wanted

        await wait_for(lambda: low_is((3, 3), 1), timeout=30, what="index < 1: one device per node")
        assert [m for m, _ in counting.requests] == ["GET"] * 2  # two pages, then the watch
        counting.requests.clear()
        await wait_for(lambda: low_is((5, 3), 2), timeout=30, what="index < 2, matched again")
        await wait_for(lambda: low_is((6, 3), 9), timeout=30, what="index < 9, matched again")
        assert counting.requests == []  # the kept slices were matched again: no list
    finally:
        await counts.close()
        for name in names:
            await kube.delete(SLICE, name)
