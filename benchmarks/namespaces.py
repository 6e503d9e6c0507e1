"""Two "hosts" on this machine for a bench that runs a command per node: two network namespaces joined by a
veth pair (an address each, no loopback between them, the filesystem shared), as the multi-node tests make
(tests/netns.py). Making them needs root; without it, or without `ip`, `two_namespaces` raises saying why.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["Nodes", "two_namespaces"]

Nodes = tuple[str, str, str, str]  # (namespace 0, its address, namespace 1, its address)


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"`ip {' '.join(args)}` failed ({done.returncode}): {done.stderr.strip()}")


@contextmanager
def two_namespaces() -> Iterator[Nodes]:
    """Two fresh namespaces on a veth pair, deleted (with the pair) on exit, whatever happened."""
    if os.geteuid() != 0:
        raise RuntimeError("two network namespaces need root (ip netns add): run the bench as root")
    if shutil.which("ip") is None:
        raise RuntimeError("two network namespaces need iproute2's `ip` on PATH")
    tag = secrets.token_hex(3)
    names, links = (f"sk{tag}a", f"sk{tag}b"), (f"vk{tag}a", f"vk{tag}b")
    subnet = f"10.{secrets.randbelow(200) + 20}.{secrets.randbelow(250)}"
    made: list[str] = []
    try:
        for ns in names:
            _ip("netns", "add", ns)
            made.append(ns)
        _ip("link", "add", links[0], "type", "veth", "peer", "name", links[1])
        for host, (ns, dev) in enumerate(zip(names, links, strict=True), start=1):
            _ip("link", "set", dev, "netns", ns)
            _ip("-n", ns, "addr", "add", f"{subnet}.{host}/24", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        yield names[0], f"{subnet}.1", names[1], f"{subnet}.2"
    finally:  # a namespace takes its end of the pair with it; a pair never moved is deleted here
        for ns in made:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        subprocess.run(["ip", "link", "del", links[0]], capture_output=True)
