"""Rank 0's messages to the other ranks of an engine (step plans, rank
operations, results, stop): length-prefixed pickles over one TCP connection
per rank, in order.

Sending does not wait for the receiver (the socket buffers the message), so a
step plan costs rank 0 a few microseconds and each rank takes it when it is
ready. A broadcast over the gloo group is a collective instead: rank 0 would
wait on every rank at every step, and the ranks' host work would add up.
Replies to rank 0 (a rank operation's result) stay on the gloo group.
"""
from __future__ import annotations

import pickle
import socket
import struct
from typing import Any

import torch.distributed as dist

HEADER = struct.Struct("!Q")
CONNECT_TIMEOUT = 600.0


def _tune(sock: socket.socket) -> socket.socket:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # a plan goes out at once, not batched
    return sock


def _recv_exactly(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ConnectionError("rank 0 closed the connection")
        got += k
    return buf


class Outbox:
    """Rank 0's side: one connection to every other rank (in rank order)."""

    def __init__(self, socks: list[socket.socket]):
        self.socks = socks

    def send(self, message: Any) -> None:
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        frame = HEADER.pack(len(data)) + data
        for sock in self.socks:
            sock.sendall(frame)

    def close(self) -> None:
        for sock in self.socks:
            sock.close()


class Inbox:
    """Ranks 1..k-1: the connection from rank 0."""

    def __init__(self, sock: socket.socket):
        self.sock = sock

    def receive(self) -> Any:
        (n,) = HEADER.unpack(_recv_exactly(self.sock, HEADER.size))
        return pickle.loads(_recv_exactly(self.sock, n))

    def close(self) -> None:
        self.sock.close()


def connect(tp_rank: int, tp_size: int, control) -> Outbox | Inbox:
    """Open the connections (every rank of the group calls this together):
    rank 0 listens and tells the others where over the gloo group `control`."""
    hosts = [None] * tp_size
    dist.all_gather_object(hosts, socket.gethostname(), group=control)
    one_host = len(set(hosts)) == 1
    if tp_rank == 0:
        listener = socket.create_server(("127.0.0.1" if one_host else "", 0))
        listener.settimeout(CONNECT_TIMEOUT)
        address = [("127.0.0.1" if one_host else socket.gethostbyname(socket.gethostname()),
                    listener.getsockname()[1])]
    else:
        address = [None]
    dist.broadcast_object_list(address, group=control, group_src=0)
    if tp_rank:
        sock = _tune(socket.create_connection(address[0], timeout=CONNECT_TIMEOUT))
        sock.sendall(HEADER.pack(tp_rank))
        sock.settimeout(None)
        return Inbox(sock)
    with listener:
        socks: dict[int, socket.socket] = {}
        while len(socks) < tp_size - 1:
            sock, _ = listener.accept()
            sock.settimeout(CONNECT_TIMEOUT)
            (rank,) = HEADER.unpack(_recv_exactly(sock, HEADER.size))
            sock.settimeout(None)
            socks[rank] = _tune(sock)
    return Outbox([socks[r] for r in sorted(socks)])
