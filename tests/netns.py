"""Two "hosts" on one machine for the tests that run a command across nodes: two Linux network namespaces
joined by a veth pair. As two hosts, they share nothing but the filesystem: no loopback between them, an
address each. Making them needs root (CI runs as root); without it the caller fails saying why, never skips.
"""

from __future__ import annotations

import os
import secrets
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager

import pytest


def sh(*cmd: str) -> None:
    """Run `cmd`; fail the test with its stderr if it fails."""
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        pytest.fail(f"`{' '.join(cmd)}` failed ({done.returncode}): {done.stderr.strip()}")


@contextmanager
def two_nodes() -> Iterator[tuple[str, str, str, str]]:
    """Two namespaces joined by a veth pair: (netns 0, its address, netns 1, its address)."""
    if os.geteuid() != 0:
        pytest.fail("making network namespaces needs root (ip netns add); this test does not skip")
    tag = secrets.token_hex(3)
    ns0, ns1, a, b = f"ss{tag}a", f"ss{tag}b", f"vs{tag}a", f"vs{tag}b"
    subnet = f"10.{secrets.randbelow(200) + 20}.{secrets.randbelow(250)}"
    sh("ip", "netns", "add", ns0)
    try:
        sh("ip", "netns", "add", ns1)
        sh("ip", "link", "add", a, "type", "veth", "peer", "name", b)
        sh("ip", "link", "set", a, "netns", ns0)
        sh("ip", "link", "set", b, "netns", ns1)
        for ns, dev, ip in ((ns0, a, f"{subnet}.1"), (ns1, b, f"{subnet}.2")):
            sh("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", dev)
            sh("ip", "-n", ns, "link", "set", dev, "up")
            sh("ip", "-n", ns, "link", "set", "lo", "up")
        yield ns0, f"{subnet}.1", ns1, f"{subnet}.2"
    finally:
        for ns in (ns0, ns1):  # deleting a namespace deletes its end of the veth pair, and so the pair
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
