"""Telling users that a prepared claim's dynamic MIG instance was lost (a GPU reset or a driver
reload) and made again, or why not (:mod:`gpudra_driver.plugin.migrepair` finds and repairs them):
a log line and a ``MigInstanceLost`` Warning Event on the Node and on each pod the claim is
reserved for. Here, above the kubelet plugin and device health, because it reads a claim's pods
the way device health's pod events do."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from gpudra_driver.devicehealth.podevents import reserved_pods
from gpudra_driver.plugin.migrepair import LOST_REASON, Outcome, message

log = logging.getLogger("gpudra.agent")

PostOnNode = Callable[[str, str, str], Awaitable[None]]  # type, reason, message
PostOnPod = Callable[[str, str, str, str, str, str], Awaitable[None]]  # ns, name, uid, type, reason, message
GetClaim = Callable[[str, str], Awaitable[Mapping[str, Any] | None]]


class Reporter:
    """Each finding in the log and in a Warning Event on the Node and on each pod the claim is
    reserved for (where ``kubectl describe pod`` shows it), once: a claim whose instance cannot be
    made again is found at every check and every retried prepare, and is said again only when what
    is said changes. Best effort: a claim that cannot be read is logged."""

    def __init__(self, post: PostOnNode, get_claim: GetClaim, post_on_pod: PostOnPod) -> None:
        self.post, self.get_claim, self.post_on_pod = post, get_claim, post_on_pod
        self.said: dict[str, str] = {}  # claim UID -> the last message said about it

    async def __call__(self, outcomes: Sequence[Outcome]) -> None:
        for outcome in outcomes:
            text = message(outcome)
            if self.said.get(outcome.claim.uid) == text:
                continue
            self.said[outcome.claim.uid] = text
            if len(self.said) > 4096:  # claims come and go: forget the oldest
                del self.said[next(iter(self.said))]
            log.warning("%s", text)
            await report(outcome, text, self.post, self.get_claim, self.post_on_pod)


async def report(outcome: Outcome, text: str, post: PostOnNode, get_claim: GetClaim, post_on_pod: PostOnPod) -> None:
    """One finding's Warning Events: on the Node, and on each pod its claim is reserved for."""
    await post("Warning", LOST_REASON, text)
    ref = outcome.claim.ref
    try:
        live = await get_claim(ref.namespace, ref.name)
    except Exception as error:  # noqa: BLE001 - best effort: the Node event says it
        log.warning("cannot read %s to tell its pods that its MIG instance was lost: %r", ref, error)
        return
    if live is None or (live.get("metadata") or {}).get("uid") != ref.uid:
        return
    for name, uid in reserved_pods(live):
        await post_on_pod(ref.namespace, name, uid, "Warning", LOST_REASON, text)
