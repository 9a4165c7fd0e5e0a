"""Host-side bootstrap of the VMM transports: gather-to-root-and-broadcast over an abstract Unix
socket (file descriptors passed with SCM_RIGHTS), every wait bounded. See ulysses.transport."""

from __future__ import annotations

import json
import os
import socket
import struct
import time
from typing import Optional, Sequence

from ulysses.transport_base import TransportSetupError, _reason

__all__: list[str] = []

# ---- bootstrap over a Unix socket (bounded waits) ----------------------------------------------
_HEADER = struct.Struct("!Q")
_MAX_FDS = 64


def _send_msg(sock: socket.socket, obj, fds: Sequence[int] = ()) -> None:
    data = json.dumps(obj).encode()
    data = _HEADER.pack(len(data)) + data
    sent = socket.send_fds(sock, [data], list(fds)) if fds else sock.send(data)
    if sent < len(data):
        sock.sendall(data[sent:])


def _recv_msg(sock: socket.socket):
    """(object, received fds); the fds arrive with the message's first bytes."""
    data, fds, _, _ = socket.recv_fds(sock, 1 << 16, _MAX_FDS)
    fds = list(fds)
    try:
        if not data:
            raise ConnectionError("the peer closed the connection")
        while len(data) < _HEADER.size:
            more = sock.recv(1 << 16)
            if not more:
                raise ConnectionError("the peer closed the connection")
            data += more
        (n,) = _HEADER.unpack(data[:_HEADER.size])
        while len(data) < _HEADER.size + n:
            more = sock.recv(1 << 16)
            if not more:
                raise ConnectionError("the peer closed the connection")
            data += more
        return json.loads(data[_HEADER.size:_HEADER.size + n]), fds
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise


class _Bootstrap:
    """Gather-to-root-and-broadcast over an abstract Unix socket, every wait bounded.

    Rank 0 listens; in each step every other rank connects, sends (step, value[, fd]) and waits
    for the root's answer: the list of every rank's value (and the fds passed along), or the
    root's error. Steps carry a sequence number and a name, so ranks that call different steps
    are told so instead of exchanging the wrong data. The root gives up on ranks that have not
    arrived within the timeout and tells the ranks that did; the others wait for the root's answer
    up to twice the timeout (the root may start the step up to one timeout after them) and then
    give up naming rank 0. Any failure leaves the bootstrap broken (later steps raise).
    """

    def __init__(self, rank: int, world_size: int, address: str, timeout_s: float):
        self.rank, self.world_size, self.address, self.timeout_s = rank, world_size, address, timeout_s
        self._seq = 0
        self._listener = None
        self.broken: Optional[str] = None
        if rank == 0 and world_size > 1:
            lst = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                lst.bind(address)
                lst.listen(max(world_size, 8))
            except BaseException:
                lst.close()
                raise
            self._listener = lst

    def close(self) -> None:
        if self._listener is not None:
            self._listener.close()
            self._listener = None

    def allgather(self, step: str, value, fd: int = -1, timeout_s: Optional[float] = None):
        """Every rank's value (list by rank) and, for ranks that passed one, their fd (dup'ed
        into this process; list by rank, -1 where none). Raises TransportSetupError."""
        if self.broken is not None:
            raise TransportSetupError(step, {self.rank: f"the bootstrap failed earlier ({self.broken})"})
        self._seq += 1
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + (timeout_s if self.rank == 0 else 2 * timeout_s)
        try:
            if self.world_size == 1:
                return [value], [os.dup(fd) if fd >= 0 else -1]
            if self.rank == 0:
                return self._root(step, value, fd, deadline, timeout_s)
            return self._leaf(step, value, fd, deadline)
        except TransportSetupError as exc:
            self.broken = str(exc)
            raise
        except OSError as exc:  # a peer went away mid-step
            self.broken = _reason(exc)
            raise TransportSetupError(step, {self.rank: f"bootstrap socket error ({_reason(exc)})"}) from exc

    def _root(self, step, value, fd, deadline, timeout_s):
        P = self.world_size
        values, fds, conns = [None] * P, [-1] * P, {}
        values[0] = value
        fds[0] = os.dup(fd) if fd >= 0 else -1
        problems: dict[int, str] = {}
        try:
            while len(conns) < P - 1:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._listener.settimeout(left)
                try:
                    conn, _ = self._listener.accept()
                except socket.timeout:
                    break
                conn.settimeout(max(deadline - time.monotonic(), 0.001))
                try:
                    msg, got = _recv_msg(conn)
                except (OSError, ValueError) as exc:
                    conn.close()
                    problems[0] = f"could not read a bootstrap message ({_reason(exc)})"
                    continue
                q = msg.get("rank")
                if not isinstance(q, int) or not 0 < q < P or q in conns:
                    for f in got:
                        os.close(f)
                    conn.close()
                    problems[0] = f"received an unexpected bootstrap message {msg!r}"
                    continue
                conns[q] = conn
                if (msg.get("seq"), msg.get("step")) != (self._seq, step):
                    problems[q] = (f"was at setup step {msg.get('seq')} {msg.get('step')!r} while rank 0 was at "
                                   f"step {self._seq} {step!r}: the ranks' windows() calls differ")
                values[q] = msg.get("value")
                if got:
                    fds[q] = got[0]
                    for f in got[1:]:
                        os.close(f)
            for q in range(1, P):
                if q not in conns:
                    problems[q] = f"did not arrive within {timeout_s:g} s"
            if problems:
                err = TransportSetupError(step, problems)
                for conn in conns.values():
                    try:
                        _send_msg(conn, {"error": str(err), "failures": {str(k): v for k, v in problems.items()}})
                    except OSError:
                        pass
                raise err
            reply = {"values": values, "has_fd": [f >= 0 for f in fds]}
            passed = [f for f in fds if f >= 0]
            for q, conn in conns.items():
                conn.settimeout(max(deadline - time.monotonic(), 0.001))
                _send_msg(conn, reply, passed)
            return values, fds
        except BaseException:
            for f in fds:
                if f >= 0:
                    os.close(f)
            raise
        finally:
            for conn in conns.values():
                conn.close()

    def _leaf(self, step, value, fd, deadline):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            try:  # the root listens from before the ranks first met: a refusal means it is gone
                sock.settimeout(max(deadline - time.monotonic(), 0.001))
                sock.connect(self.address)
            except (OSError, ValueError) as exc:
                raise TransportSetupError(step, {0: f"did not answer rank {self.rank} "
                                                    f"(connecting: {_reason(exc)})"}) from None
            _send_msg(sock, {"rank": self.rank, "seq": self._seq, "step": step, "value": value},
                      [fd] if fd >= 0 else [])
            sock.settimeout(max(deadline - time.monotonic(), 0.001))
            try:
                msg, got = _recv_msg(sock)
            except (OSError, ValueError) as exc:
                raise TransportSetupError(step, {0: f"did not answer rank {self.rank} "
                                                    f"({_reason(exc)})"}) from None
            if "error" in msg:
                for f in got:
                    os.close(f)
                raise TransportSetupError(step, {int(k): v for k, v in msg["failures"].items()})
            fds, it = [], iter(got)
            for has in msg["has_fd"]:
                fds.append(next(it) if has else -1)
            return msg["values"], fds
        finally:
            sock.close()
