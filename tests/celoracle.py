"""Kubernetes' own DRA CEL (hack/cel-oracle: k8s.io/dynamic-resource-allocation/cel, as
kube-apiserver and kube-scheduler run it) for the CEL tests: the estimated cost, the match, the
runtime error and the actual cost of each case, to compare gpudra's Python evaluator with.

The binary is built by ``make cel-oracle`` (``make test`` does it) into the cache, keyed by a hash
of its sources; without it a test fails with that command, never skips."""

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


class CelOracleUnavailable(RuntimeError):
    pass


@dataclass(frozen=True)
class OracleAnswer:
    compile_error: str | None
    max_cost: int
    matches: bool | None
    error: str | None
    actual_cost: int | None


def oracle_binary() -> Path:
    given = os.environ.get("GPUDRA_CEL_ORACLE_DIR")
    digest = hashlib.sha256(b"".join((SOURCE / f).read_bytes() for f in ("go.mod", "go.sum", "main.go"))).hexdigest()
    directory = Path(given) if given else cache_root() / "cel-oracle" / digest[:16]
    binary = directory / "cel-oracle"
    if not os.access(binary, os.X_OK):
        raise CelOracleUnavailable(
            f"cel-oracle (Kubernetes' DRA CEL library, hack/cel-oracle) is not built: no {binary}. The CEL "
            f"tests compare gpudra's evaluator with it. Build it (Go, the Go module proxy or a warm module "
            f"cache):\n  cd {REPO} && make cel-oracle")
    return binary


def ask(queries: Iterable[tuple[str, Mapping[str, Any] | None]]) -> list[OracleAnswer]:
    """One answer per (expression, ResourceSlice device with its ``driver``, or None) query."""
    lines = [json.dumps({"expression": e, **({"device": dict(d)} if d is not None else {})}) for e, d in queries]
    result = subprocess.run([str(oracle_binary())], input="\n".join(lines) + "\n", capture_output=True,
                            text=True, timeout=300, check=False)
    if result.returncode != 0:
        raise AssertionError(f"cel-oracle failed (exit {result.returncode}): {result.stderr.strip()}")
    answers = [json.loads(line) for line in result.stdout.splitlines()]
    assert len(answers) == len(lines), result.stderr
    return [OracleAnswer(a["compileError"], a["maxCost"], a["matches"], a["error"], a["actualCost"]) for a in answers]
