"""The local cluster's certificates verify under the strictest default of a current Python."""

from __future__ import annotations

import socket
import ssl
import threading
from pathlib import Path

from gpudra_dev.localcluster.pki import LocalPKI


def test_a_server_certificate_verifies_with_x509_strict(tmp_path: Path) -> None:
    """Python 3.13 verifies with VERIFY_X509_STRICT by default (the release image's interpreter),
    which refuses a chain without key identifiers."""
    pki = LocalPKI(tmp_path)
    server = pki.issue("server", "localhost", dns_names=("localhost",), ips=("127.0.0.1",), server=True)
    server_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_context.load_cert_chain(server.cert, server.key)
    listener = socket.create_server(("127.0.0.1", 0))
    errors: list[Exception] = []

    def serve() -> None:
        connection, _ = listener.accept()
        try:
            with server_context.wrap_socket(connection, server_side=True) as tls:
                tls.recv(1)
        except (ssl.SSLError, OSError) as error:
            errors.append(error)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    client_context = ssl.create_default_context(cafile=str(pki.ca.cert))
    client_context.verify_flags |= ssl.VERIFY_X509_STRICT
    try:
        with socket.create_connection(listener.getsockname()) as raw, \
                client_context.wrap_socket(raw, server_hostname="localhost") as tls:
            tls.send(b"x")
    finally:
        thread.join(10)
        listener.close()
    assert not errors
