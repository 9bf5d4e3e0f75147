"""What a DRA selector does differently on the Kubernetes releases gpudra supports, 1.35 to 1.37:
the evaluator compiles, costs and runs a selector as the cluster's own release does.

* **1.36**: Kubernetes builds with ``godebug default=go1.26`` (its go.mod), so ``isURL`` and
  ``url`` get Go 1.26's net/url, which refuses an ``http``/``https`` URL whose host has more than
  one colon (``urlstrictcolons``; golang.org/issue/75223). 1.35 builds with ``default=go1.25``.
  The scheduler's CEL environment (``StoredExpressions``, which ignores feature gates) has
  ``<dyn>.includes(<dyn>)``, the DRA compiler's for list-type attributes (dynamic-resource-
  allocation/cel/compile.go): a list longer than 48 values is an error, and it costs 1.
* **1.37**: cel-go 0.29 charges ``startsWith``/``endsWith`` at run time by the prefix, no longer by
  the string searched (interpreter/runtimecost.go), and costs ``matches(s, re)`` as it costs
  ``s.matches(re)``, estimated and run (checker/cost.go); ``includes`` is the Kubernetes list
  library's (version 1: k8s.io/apiserver/pkg/cel/library/lists.go), without the length limit and
  costed by the list's size (library/cost.go).

gpudra answers for the scheduler, so a selector compiles here as the scheduler compiles a stored
one. The API server is stricter with a new selector: it gets the previous release's CEL (the CEL
compatibility version) and honours feature gates, so it refuses ``includes`` on 1.36 without
``DRAListTypeAttributes`` and on 1.37 ("undeclared reference to 'includes'").

A cluster whose release is unknown is taken as the oldest supported one; one newer than gpudra
knows, as the newest.
"""

from __future__ import annotations

from dataclasses import dataclass

OLDEST_MINOR = 35
NEWEST_MINOR = 37


@dataclass(frozen=True)
class CelRelease:
    """The CEL of Kubernetes 1.<minor>."""

    minor: int = OLDEST_MINOR

    @property
    def strict_url_colons(self) -> bool:
        return self.minor >= 36

    @property
    def charges_prefix_at_run(self) -> bool:
        return self.minor >= 37

    @property
    def costs_function_matches(self) -> bool:
        return self.minor >= 37

    @property
    def has_includes(self) -> bool:
        return self.minor >= 36

    @property
    def limits_includes(self) -> bool:
        """1.36's ``includes``: an error on a list longer than 48 values."""
        return self.minor == 36

    @property
    def costs_includes(self) -> bool:
        return self.minor >= 37

    def __str__(self) -> str:
        return f"Kubernetes 1.{self.minor}"


OLDEST = CelRelease(OLDEST_MINOR)


def release_of(minor: int | None) -> CelRelease:
    """The rules of a cluster that says it is 1.<minor> (None: it did not say)."""
    if minor is None:
        return OLDEST
    return CelRelease(min(max(minor, OLDEST_MINOR), NEWEST_MINOR))
