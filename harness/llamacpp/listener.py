"""Who listens on a local TCP port: the check that the llama-server answering is the one we started.

Owns: reading the listening sockets of a port from the kernel's tables (`/proc/net/tcp`,
`/proc/net/tcp6`, state LISTEN), the socket inodes a process holds (`/proc/PID/fd/* ->
socket:[INODE]`), finding the process that holds a socket (`holder`), and the verdict
(`check_port`): the port is ours only when every listener a connection to 127.0.0.1 could reach
belongs to our child. Does not own: starting the server or talking to it (harness.llamacpp.server).

Why: a port picked by binding port 0 and closing it can be taken by anything before the server
binds it, and llama.cpp's HTTP library binds with SO_REUSEPORT, so a process of the same user that
also set it listens on the same port beside our server and the kernel hands it some of our
connections. Linux only (the tables are /proc's); elsewhere `check_port` says it cannot verify.

    verdict = check_port(port, child_pid)     # Ours() | NotYet() | Foreign(holders)
"""
from __future__ import annotations

import ipaddress
import os
import struct
from dataclasses import dataclass
from pathlib import Path

LISTEN = "0A"                  # TCP_LISTEN in /proc/net/tcp's `st` column
TABLES = (("/proc/net/tcp", 4), ("/proc/net/tcp6", 6))


def _address(hex_addr: str, family: int) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """/proc/net/tcp prints an address as 32-bit words, each the network-order bytes read as a
    native integer ("0100007F" is 127.0.0.1 on a little-endian host)."""
    packed = b"".join(struct.pack("=I", int(hex_addr[i:i + 8], 16)) for i in range(0, len(hex_addr), 8))
    return ipaddress.IPv4Address(packed) if family == 4 else ipaddress.IPv6Address(packed)


def _reaches_loopback(addr: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    """Whether a connection to 127.0.0.1 can land on a socket bound to `addr` (its own address, a
    wildcard, or an IPv6 socket that takes IPv4 too)."""
    if isinstance(addr, ipaddress.IPv6Address):
        if addr.ipv4_mapped is not None:
            addr = addr.ipv4_mapped
        else:
            return addr.is_unspecified
    return addr.is_unspecified or addr == ipaddress.IPv4Address("127.0.0.1")


def listeners(port: int) -> list[int]:
    """Inodes of the listening sockets on `port` that a connection to 127.0.0.1:port can reach.
    Raises OSError when the kernel's tables cannot be read (no /proc)."""
    found: list[int] = []
    read_any = False
    for table, family in TABLES:
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except FileNotFoundError:
            continue                                     # no IPv6 on this kernel
        read_any = True
        for line in lines:
            cols = line.split()
            if len(cols) < 10 or cols[3] != LISTEN:
                continue
            hex_addr, _, hex_port = cols[1].partition(":")
            if int(hex_port, 16) == port and _reaches_loopback(_address(hex_addr, family)):
                found.append(int(cols[9]))
    if not read_any:
        raise OSError("/proc/net/tcp is not readable: cannot tell which process listens on a port")
    return found


def socket_inodes(pid: int) -> set[int]:
    """The socket inodes process `pid` holds (empty when it is gone or its fds are not readable)."""
    out = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return out
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            out.add(int(target[8:-1]))
    return out


def holder(inode: int) -> str:
    """'pid N (name)' of the process holding socket `inode`, or why it is not known."""
    link = f"socket:[{inode}]"
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            fds = os.listdir(f"/proc/{entry.name}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{entry.name}/fd/{fd}") == link:
                    try:
                        name = Path(f"/proc/{entry.name}/comm").read_text().strip()
                    except OSError:
                        name = "?"
                    return f"pid {entry.name} ({name})"
            except OSError:
                continue
    return "a process whose pid is not known (another user's?)"


@dataclass(frozen=True)
class Ours:
    """Every listener on the port is our child's."""


@dataclass(frozen=True)
class NotYet:
    """Nothing listens on the port yet, or only others do while our child has not bound it (it
    will, beside them, or fail to bind and exit)."""
    holders: tuple[str, ...] = ()


@dataclass(frozen=True)
class Foreign:
    """Our child listens on the port and so does another process: connections may reach either."""
    holders: tuple[str, ...]


def check_port(port: int, pid: int) -> Ours | NotYet | Foreign:
    """Whether 127.0.0.1:`port` is served by process `pid` and by nothing else."""
    found = listeners(port)
    mine = socket_inodes(pid)
    others = [i for i in found if i not in mine]
    if not found:
        return NotYet()
    if not others:
        return Ours()
    holders = tuple(holder(i) for i in others)
    return Foreign(holders) if len(others) < len(found) else NotYet(holders)
