"""Ports for the sandbox's servers: free, distinct, and out of the outgoing connections' way."""

from __future__ import annotations

import socket

from cacheroute.sandbox.process import bound_socket, fixed_port_range, free_ports


def test_ports_are_free_distinct_and_below_the_ephemeral_range() -> None:
    fixed = fixed_port_range()
    assert len(fixed) > 0, "the kernel's ephemeral range is readable on Linux"
    first = free_ports(20)
    second = free_ports(20)
    assert len(set(first + second)) == 40, "a port handed out is not offered again"
    assert all(port in fixed for port in first + second)
    for port in first:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", port))


def test_a_port_in_use_is_not_offered() -> None:
    fixed = fixed_port_range()
    # Occupy every port of the range but a few: the draw skips the busy ones, and takes what it
    # still needs from the ephemeral range.
    busy: list[socket.socket] = []
    try:
        for port in fixed[:-3]:
            sock = bound_socket(port)
            if sock is not None:
                busy.append(sock)
        held = {s.getsockname()[1] for s in busy}
        ports = free_ports(5)
        assert not held & set(ports)
        assert len(set(ports)) == 5
        for port in ports:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                sock.bind(("127.0.0.1", port))
    finally:
        for sock in busy:
            sock.close()
