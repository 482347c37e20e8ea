"""The loopback ports fitter's servers listen on (the emulated GPU's RPC server, a user's llama-server).

A port found free can be taken before the server binds it (another program, another tune): the starters retry on a
fresh port when the bind fails, and check that the process they started is the only one listening there: a server
that sets SO_REUSEPORT (llama-server with --reuse-port, tools/server/server-http.cpp; cpp-httplib's own
`default_socket_options` sets it) binds beside another such socket without an error, and the two share the
connections.

Who listens where comes from /proc/net/tcp{,6} (the socket inodes in LISTEN) and /proc/PID/fd (the inodes a process
holds): Linux only; elsewhere `port_state` cannot tell and answers "ours".
"""

from __future__ import annotations

import os
import socket
import struct
from pathlib import Path

from fitter.errors import FitterError

HOST = "127.0.0.1"
_LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp's st column (include/net/tcp_states.h)


def port_is_free(port: int) -> bool:
    """Nothing listens on HOST:port and it can be bound (bind without SO_REUSEADDR is the stricter test)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((HOST, port))
        except OSError:
            return False
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.2)
        return s.connect_ex((HOST, port)) != 0


def pick_free_port(what: str, tries: int = 20) -> int:
    """A port the kernel hands out on HOST that nothing listens on; `what` names the server in the error."""
    for _ in range(tries):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((HOST, 0))
            port = int(s.getsockname()[1])
        if port_is_free(port):
            return port
    raise FitterError(f"{what}: found no free TCP port on {HOST} in {tries} tries")


def _address(hex_ip: str) -> str:
    """/proc/net/tcp's address column: the kernel prints each 32-bit word of the network-order address as a
    native-endian %08X (net/ipv4/tcp_ipv4.c get_tcp4_sock, net/ipv6/tcp_ipv6.c get_tcp6_sock)."""
    raw = b"".join(struct.pack("=I", int(hex_ip[i:i + 8], 16)) for i in range(0, len(hex_ip), 8))
    return socket.inet_ntop(socket.AF_INET if len(raw) == 4 else socket.AF_INET6, raw)


def listeners() -> dict[str, tuple[str, int]]:
    """Every listening TCP socket of this network namespace: {inode: (address, port)}."""
    out: dict[str, tuple[str, int]] = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if len(f) > 9 and f[3] == _LISTEN:
                ip, port = f[1].rsplit(":", 1)
                out[f[9]] = (_address(ip), int(port, 16))
    return out


def socket_inodes(pid: int) -> set[str]:
    """The inodes of the sockets process `pid` holds (empty when it is gone or not ours to read)."""
    inodes: set[str] = set()
    try:
        fds = list(Path(f"/proc/{pid}/fd").iterdir())
    except OSError:
        return inodes
    for fd in fds:
        try:
            link = os.readlink(fd)
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[len("socket:["):-1])
    return inodes


def listening_addresses(pid: int) -> set[tuple[str, int]]:
    """Where process `pid` listens: {(address, port)}."""
    held = socket_inodes(pid)
    return {where for inode, where in listeners().items() if inode in held}


def port_state(pid: int, port: int) -> str:
    """"ours" when process `pid` listens on `port` and nothing else does (on any address), "taken" when another
    process listens there, "none" when nothing does yet; "ours" where /proc cannot tell."""
    if not Path("/proc/net/tcp").is_file():
        return "ours"
    on_port = {inode for inode, (_, p) in listeners().items() if p == port}
    if not on_port:
        return "none"
    held = socket_inodes(pid)
    if on_port - held:
        return "taken"
    return "ours"
