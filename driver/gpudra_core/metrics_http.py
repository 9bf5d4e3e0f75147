"""The /metrics HTTP endpoint of the agent and the operator (each process registers only its own
metrics: this module defines none)."""

from __future__ import annotations

import errno
import logging

from prometheus_client import start_http_server


def serve(port: int, addr: str | None, logger: logging.Logger) -> None:
    """Serve ``/metrics`` on ``port`` in a background thread (0: do nothing). By default on every
    address of the pod, IPv6 and IPv4 alike (``::``, dual-stack: an IPv6-only cluster scrapes it
    too), or on IPv4's where the kernel has no IPv6."""
    if not port:
        return
    if addr is None:
        try:
            start_http_server(port, addr="::")
            addr = "::"
        except OSError as error:
            if error.errno not in (errno.EAFNOSUPPORT, errno.EADDRNOTAVAIL):
                raise
            addr = "0.0.0.0"
            start_http_server(port, addr=addr)
    else:
        start_http_server(port, addr=addr)
    logger.info("serving Prometheus metrics on port %d/metrics (%s)", port, addr)
