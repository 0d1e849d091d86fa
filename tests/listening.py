"""The TCP sockets processes listen on, read from /proc (Linux): which address and port, and which process."""

from __future__ import annotations

import ipaddress
import os


def listening_sockets(pids) -> list[tuple[str, int, int]]:
    """(local address ("127.0.0.1", "0.0.0.0", "::", ...), port, pid) of each TCP socket these processes listen
    on."""
    inodes: dict[str, int] = {}
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    inodes[target[8:-1]] = pid
        except OSError:  # gone meanwhile
            continue
    sockets = []
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                    raw_address, raw_port = fields[1].split(":")
                    raw = bytes.fromhex(raw_address)  # little-endian 32-bit words
                    words = b"".join(raw[i:i + 4][::-1] for i in range(0, width // 2, 4))
                    address = ipaddress.ip_address(words)
                    address = str(getattr(address, "ipv4_mapped", None) or address)  # ::ffff:a.b.c.d: IPv4
                    sockets.append((address, int(raw_port, 16), inodes[fields[9]]))
    return sockets
