"""What the machine says about itself for a vLLM over several GPUs: the size of ``/dev/shm``
and the IPv4 address of each network interface.

Read with the standard library alone: ``os.statvfs`` for the size of the file system, and for
the addresses ``socket.if_nameindex`` with the ``SIOCGIFADDR`` ioctl (Linux's netdevice(7):
the interface's primary IPv4 address, ``EADDRNOTAVAIL`` for one without). What they mean is
decided in :mod:`worker.config.nccl`.
"""

from __future__ import annotations

import fcntl
import os
import socket
import struct
from collections.abc import Callable

from worker.config.nccl import SHM_PATH

#: netdevice(7)'s request for an interface's address (linux/sockios.h).
SIOCGIFADDR = 0x8915
#: The size of ``struct ifreq``, and where its IPv4 address lies in it (after the name's 16
#: bytes, sockaddr_in's family and port).
_IFREQ_SIZE = 40
_ADDRESS = slice(20, 24)


def shm_bytes(path: str = SHM_PATH, statvfs: Callable[[str], os.statvfs_result] = os.statvfs
              ) -> int | None:
    """The size of the file system at ``path`` in bytes; None where it cannot be read."""
    try:
        stats = statvfs(path)
    except OSError:
        return None
    return stats.f_blocks * stats.f_frsize


def _ipv4_of(sock: socket.socket, name: str) -> str | None:
    request = struct.pack(f"{_IFREQ_SIZE}s", name.encode()[:15])
    try:
        answer = fcntl.ioctl(sock.fileno(), SIOCGIFADDR, request)
    except OSError:  # no IPv4 address (EADDRNOTAVAIL), or gone meanwhile
        return None
    return socket.inet_ntoa(answer[_ADDRESS])


def interface_addresses() -> tuple[tuple[str, str], ...]:
    """Each network interface with an IPv4 address, as ``(name, address)``; none where they
    cannot be listed."""
    try:
        names = [name for _, name in socket.if_nameindex()]
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    except OSError:
        return ()
    with sock:
        found = ((name, _ipv4_of(sock, name)) for name in names)
        return tuple((name, address) for name, address in found if address is not None)
