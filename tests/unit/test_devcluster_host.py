"""host.port_free, the one probe `devcluster up` and KWOK run before starting a server, on real
sockets."""

from __future__ import annotations

import socket

from dtjob.devcluster.host import free_port, port_free


def test_a_listening_port_is_not_free_on_its_address_or_on_every_address() -> None:
    port = free_port()
    assert port_free(port) and port_free(port, "127.0.0.1")
    with socket.socket() as server:
        server.bind(("127.0.0.1", port))
        server.listen()
        assert not port_free(port, "127.0.0.1")
        assert not port_free(port), "0.0.0.0 must see a server on 127.0.0.1 too"
    assert port_free(port, "127.0.0.1")


def test_a_port_held_on_every_address_is_not_free_on_loopback() -> None:
    with socket.socket() as server:
        server.bind(("0.0.0.0", 0))
        server.listen()
        port = server.getsockname()[1]
        assert not port_free(port, "127.0.0.1") and not port_free(port)
