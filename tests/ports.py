"""A free loopback port for a test's rendezvous: tests that start several processes each take
their own, so test workers running side by side (pytest -n) never meet on one."""

import socket


def free_port() -> int:
    """A TCP port the OS just handed out on 127.0.0.1 and released again."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
