"""Inline DeviceClass templates render in a worker process with hard limits.

An inline template is code a GpuDraConfig author writes. Jinja2's sandbox stops it from reaching
Python objects, but not from allocating or computing: ``{% set x = (range(100000)|list) * 3000 %}``
is one C-level operation of 2.4 GiB, which no signal interrupts and an output cap sees only after
the allocation. Rendered in the operator, it would get the operator OOM-killed, and crash-loop,
since every restart renders the config again. So inline templates render in a child process:

* its address space is capped (``RLIMIT_AS``, :data:`MEMORY_LIMIT`): an allocation past it fails
  with ``MemoryError`` in the child, never in the operator;
* its CPU per render is capped (``RLIMIT_CPU`` moved ahead before each render): the kernel ends a
  render that loops in C, where a timer signal would wait for the next bytecode;
* the parent kills a child that has used no CPU for :data:`WALL_LIMIT` seconds without answering
  (a blocked render, a stopped child): the wall clock is for those. A child that computes is left
  to its CPU bound, so a CPU-bound template fails by that bound however busy the machine is (on a
  loaded node the 2 s of CPU take longer than 5 s of wall time); :data:`BUSY_WALL_LIMIT` is the
  backstop for a machine that gives the child almost no CPU at all.

A child that dies is replaced at the next render; the failing class gets a :class:`RenderError`
naming the bound it hit, and the other classes render as before. Built-in templates are the
project's own and render in-process. The protocol is one JSON line each way over the child's
stdin/stdout: ``{"name", "driver", "params", "source"}`` in, ``{"text"}`` or ``{"error"}`` out.
"""

from __future__ import annotations

import json
import logging
import math
import os
import resource
import select
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from typing import IO, Any

from gpudra_core.procstat import stat_fields

log = logging.getLogger("gpudra.operator")

MEMORY_LIMIT = 256 * 1024 * 1024  # the child's whole address space (a rendering child uses ~30 MiB)
CPU_LIMIT = 2  # seconds of CPU per render
WALL_LIMIT = 5.0  # seconds the operator waits for an answer from a child that computes nothing
BUSY_WALL_LIMIT = 60.0  # seconds it waits for one render in any case (CPU_LIMIT at a twentieth of a core)


class TemplateBoundExceeded(Exception):
    """The render hit a memory, CPU or time bound; the message says which."""


class TemplateWorker:
    """One child process at a time, started on first use, replaced when it dies."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._child: subprocess.Popen[bytes] | None = None

    def render(self, name: str, driver: str, params: Mapping[str, str], source: str) -> str:
        """The rendered text; ``ValueError`` with the template's own error (as the in-process
        render describes it), or :class:`TemplateBoundExceeded`."""
        request = json.dumps({"name": name, "driver": driver, "params": dict(params), "source": source})
        with self._lock:
            child = self._running()
            assert child.stdin is not None and child.stdout is not None
            try:
                child.stdin.write(request.encode() + b"\n")
                child.stdin.flush()
                line = _read_line(child.stdout, WALL_LIMIT, BUSY_WALL_LIMIT, lambda: _cpu_seconds(child.pid))
            except (BrokenPipeError, TimeoutError) as error:
                self._stop(child)
                if isinstance(error, TimeoutError):
                    raise TemplateBoundExceeded(str(error)) from None
                raise TemplateBoundExceeded(self._death(child)) from None
            if not line:
                self._stop(child)
                raise TemplateBoundExceeded(self._death(child))
        answer = json.loads(line)
        if "error" in answer:
            raise ValueError(answer["error"])
        return str(answer["text"])

    def _running(self) -> subprocess.Popen[bytes]:
        if self._child is None or self._child.poll() is not None:
            self._child = subprocess.Popen(
                [sys.executable, "-m", "gpudra_operator.deviceclasses.worker"], stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})
        return self._child

    def _stop(self, child: subprocess.Popen[bytes]) -> None:
        if child.poll() is None:
            child.kill()
        child.wait()
        if self._child is child:
            self._child = None

    @staticmethod
    def _death(child: subprocess.Popen[bytes]) -> str:
        signal_number = -child.returncode if child.returncode and child.returncode < 0 else None
        if signal_number == 24:  # SIGXCPU
            return f"template used more than {CPU_LIMIT} s of CPU"
        return (f"template rendering ended its worker (exit {child.returncode}): more than "
                f"{MEMORY_LIMIT // 2**20} MiB or {CPU_LIMIT} s of CPU")

    def close(self) -> None:
        with self._lock:
            if self._child is not None:
                self._stop(self._child)


def _read_line(stream: IO[bytes], idle_limit: float, limit: float, cpu_seconds: Callable[[], float | None]) -> bytes:
    """One line from the child (b"" once it has died). :class:`TimeoutError`, saying which, once
    ``idle_limit`` seconds passed in which the child used no CPU (``cpu_seconds()``: its CPU time
    so far, None where unknown, which counts as none), or ``limit`` seconds in all."""
    start = time.monotonic()
    looked, used = start, cpu_seconds()
    fd = stream.fileno()
    chunks: list[bytes] = []
    while True:
        now = time.monotonic()
        if now - start >= limit:
            raise TimeoutError(f"template took longer than {limit:g} s to render")
        if now - looked >= idle_limit:
            computed = cpu_seconds()
            if computed is None or used is None or computed <= used:
                raise TimeoutError(f"template rendering used no CPU and gave no answer for {idle_limit:g} s")
            looked, used = now, computed
        ready, _, _ = select.select([fd], [], [], min(looked + idle_limit, start + limit) - now)
        if not ready:
            continue
        chunk = os.read(fd, 65536)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)
        if chunk.endswith(b"\n"):
            return b"".join(chunks)


def _cpu_seconds(pid: int) -> float | None:
    """The user and system CPU time of process ``pid`` so far (Linux's /proc; None elsewhere)."""
    fields = stat_fields(pid)
    if fields is None:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime: fields 14, 15


WORKER = TemplateWorker()


# -- the child ----------------------------------------------------------------------------------


def _serve() -> None:
    from gpudra_operator.deviceclasses.sandbox import describe_error, render_text_here, template_context

    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # SIGXCPU dumps core by default: no dumps on the node
    out = sys.stdout.buffer
    for line in sys.stdin.buffer:
        try:
            request: dict[str, Any] = json.loads(line)
            # Only the soft limit moves (raising a hard limit needs CAP_SYS_RESOURCE, which the
            # operator's pod has not): SIGXCPU ends the child once this render used CPU_LIMIT
            # seconds. The hard limit stays unlimited; the parent's wall limit is the backstop.
            usage = resource.getrusage(resource.RUSAGE_SELF)
            _, hard = resource.getrlimit(resource.RLIMIT_CPU)
            soft = math.ceil(usage.ru_utime + usage.ru_stime) + CPU_LIMIT
            resource.setrlimit(resource.RLIMIT_CPU, (soft if hard == resource.RLIM_INFINITY else min(soft, hard), hard))
            context = template_context(request["name"], request["driver"], request["params"])
            answer = {"text": render_text_here(request["source"], context)}
        except MemoryError:
            answer = {"error": f"template allocated more than the {MEMORY_LIMIT // 2**20} MiB it may use"}
        except Exception as error:  # noqa: BLE001 - the template's own failure, described for the class
            answer = {"error": describe_error(error)}
        out.write(json.dumps(answer).encode() + b"\n")
        out.flush()


if __name__ == "__main__":
    _serve()
