"""Kubernetes' own DRA CEL (hack/cel-oracle: k8s.io/dynamic-resource-allocation/cel, as
kube-apiserver and kube-scheduler run it) for the CEL tests: the estimated cost, the match, the
runtime error and the actual cost of each case, to compare gpudra's Python evaluator with. One
binary per release (hack/cel-oracle/v1.*), each on that release's library, cel-go and Go settings.

The binaries are built by ``make cel-oracle`` (``make test`` does it) into the cache, keyed by a
hash of their sources; without one a test fails with that command, never skips."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cdispec import cache_root

REPO = Path(__file__).resolve().parent.parent
SOURCE = REPO / "hack" / "cel-oracle"
RELEASES = tuple(sorted((p.name for p in SOURCE.glob("v1.*")), key=lambda name: int(name.split(".")[1])))


def minor_of(release: str) -> int:
    """``v1.37`` -> 37."""
    return int(release.split(".")[1])


class CelOracleUnavailable(RuntimeError):
    pass


@dataclass(frozen=True)
class OracleAnswer:
    compile_error: str | None
    max_cost: int
    matches: bool | None
    error: str | None
    actual_cost: int | None


def oracle_binary(release: str = RELEASES[0]) -> Path:
    """The oracle of ``release`` (a directory name under hack/cel-oracle, ``v1.35``)."""
    source = SOURCE / release
    digest = hashlib.sha256(b"".join((source / f).read_bytes() for f in ("go.mod", "go.sum", "main.go"))).hexdigest()
    binary = cache_root() / "cel-oracle" / digest[:16] / "cel-oracle"
    if not os.access(binary, os.X_OK):
        raise CelOracleUnavailable(
            f"cel-oracle {release} (Kubernetes' DRA CEL library, hack/cel-oracle) is not built: no {binary}. The CEL "
            f"tests compare gpudra's evaluator with it. Build it (Go, the Go module proxy or a warm module "
            f"cache):\n  cd {REPO} && make cel-oracle")
    return binary


def ask(queries: Iterable[tuple[str, Mapping[str, Any] | None]], release: str = RELEASES[0]) -> list[OracleAnswer]:
    """One answer per (expression, ResourceSlice device with its ``driver``, or None) query, from
    ``release``'s oracle."""
    lines = [json.dumps({"expression": e, **({"device": dict(d)} if d is not None else {})}) for e, d in queries]
    result = subprocess.run([str(oracle_binary(release))], input="\n".join(lines) + "\n", capture_output=True,
                            text=True, timeout=300, check=False)
    if result.returncode != 0:
        raise AssertionError(f"cel-oracle failed (exit {result.returncode}): {result.stderr.strip()}")
    answers = [json.loads(line) for line in result.stdout.splitlines()]
    assert len(answers) == len(lines), result.stderr
    return [OracleAnswer(a["compileError"], a["maxCost"], a["matches"], a["error"], a["actualCost"]) for a in answers]
