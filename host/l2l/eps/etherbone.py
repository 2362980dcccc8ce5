"""Bus reads and writes of a LiteX SoC over Etherbone (UDP), in LiteX's own packet codec.

One record a datagram, as LiteX's ``CommUDP`` sends them, of at most 255 words (the record's
8-bit counts): about 1 KiB, under any Ethernet MTU. What this adds to ``CommUDP`` is what a
training run needs of a link that may lose datagrams:

* **Reads are pipelined and retried.** Up to :data:`WINDOW` read records are in flight, each
  tagged (its ``base_ret_addr``) and matched to its answer by the tag; one unanswered within
  the timeout is sent again, at most :data:`RETRIES` times, then :class:`BoardTimeout`.
  Answers to a request sent twice are taken once.
* **Writes are posted** (Etherbone answers no write), so :meth:`write_verified` reads the block
  back and writes again what differs: a lost datagram can never leave last step's gradient
  in the board's memory.
* **Where the answers go.** LiteEth's Etherbone core answers to the UDP port it listens on
  (1234), not to the sender's port, so the host listens on that port number too, on the
  address the OS sends to the board from. A simulated board on 127.0.0.2 and its host on
  127.0.0.1 then share a port number, as two machines do.
"""
from __future__ import annotations

import socket
import time

import numpy as np

from ..errors import UserError

MAX_WORDS = 255   # words in one record (its wcount/rcount are 8 bits)
WINDOW = 4        # read records in flight (LiteEth's Etherbone buffers a few packets)
RETRIES = 10
TIMEOUT_S = 0.5


class BoardTimeout(OSError):
    """A read went unanswered ``RETRIES`` times: the board is gone, or never was there."""


def _codec():
    try:
        from litex.tools.remote import etherbone
    except ImportError:
        raise UserError("--eps board needs LiteX's Etherbone client: pip install 'l2l[board]'") from None
    return etherbone


def parse_url(url: str, default_port: int) -> tuple[str, int]:
    """``udp://HOST[:PORT]`` -> (HOST, PORT); UserError in one line otherwise."""
    scheme, sep, rest = url.partition("://")
    host, _, port = rest.partition(":")
    if sep == "" or scheme != "udp" or not host or (port and not port.isdigit()) or "/" in rest:
        raise UserError(f"--board-url {url!r}: expected udp://HOST[:PORT] (the board's IP address; "
                        f"port {default_port} by default)")
    return host, int(port) if port else default_port


class EtherboneLink:
    """32-bit bus reads and writes of one Etherbone device at ``host:port``."""

    def __init__(self, host: str, port: int, *, timeout_s: float = TIMEOUT_S, window: int = WINDOW) -> None:
        self.eb = _codec()
        self.host, self.port, self.timeout_s, self.window = host, port, timeout_s, window
        try:
            probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            probe.connect((host, port))  # no datagram: only which local address reaches the board
            local = probe.getsockname()[0]
            probe.close()
        except OSError as exc:
            raise UserError(f"--board-url udp://{host}:{port}: no route to the board ({exc.strerror or exc})") from None
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            self.sock.bind((local, port))
        except OSError as exc:
            self.sock.close()
            raise UserError(f"--board-url udp://{host}:{port}: cannot listen on {local}:{port} for the board's "
                            f"answers ({exc.strerror}); is another program talking to a board?") from None
        self.sock.settimeout(timeout_s)
        self._tag = 0
        self.sent = self.resent = 0  # datagrams, for the bench and the tests

    def close(self) -> None:
        self.sock.close()

    # ------------------------------------------------------------ datagrams
    def _send(self, packet) -> None:
        packet.encode()
        self.sock.sendto(packet.bytes, (self.host, self.port))
        self.sent += 1

    def _record(self):
        return self.eb.EtherboneRecord(addr_size=4)

    def _decode(self, data: bytes):
        """The Etherbone packet in ``data``, or None for a datagram that is not one (a stray
        sender on the port is ignored, not a crash)."""
        try:
            packet = self.eb.EtherbonePacket(32, data)
            packet.decode()
        except Exception:  # noqa: BLE001 -- LiteX's codec raises whatever a short buffer makes it raise
            return None
        return packet if packet.magic == self.eb.etherbone_magic else None

    def probe(self) -> None:
        """Etherbone's probe: the board answers, or BoardTimeout."""
        for _ in range(RETRIES):
            packet = self.eb.EtherbonePacket(32)
            packet.pf = 1
            packet.encode()
            self.sock.sendto(packet.bytes + bytes(4), (self.host, self.port))
            try:
                data, _ = self.sock.recvfrom(65536)
            except socket.timeout:
                continue
            answer = self._decode(data)
            if answer is not None and answer.pr == 1:
                return
        raise BoardTimeout(f"no Etherbone device answers at udp://{self.host}:{self.port}")

    # ------------------------------------------------------------ reads
    def read(self, addr: int, count: int) -> np.ndarray:
        """``count`` 32-bit words from ``addr`` (incrementing), as uint32."""
        out = np.empty(count, np.uint32)
        todo = [(i, min(MAX_WORDS, count - i)) for i in range(0, count, MAX_WORDS)]
        flight: dict[int, list] = {}  # tag -> [offset, words, sent at, tries]
        while todo or flight:
            while todo and len(flight) < self.window:
                offset, words = todo.pop(0)
                flight[self._read_request(addr + 4 * offset, words)] = [offset, words, time.monotonic(), 1]
            try:
                data, _ = self.sock.recvfrom(65536)
            except socket.timeout:
                data = None
            answer = None if data is None else self._decode(data)
            if answer is not None:
                for record in answer.records:
                    if record.writes is None:
                        continue
                    got = flight.pop(record.writes.base_addr, None)
                    if got is not None and len(record.writes.get_datas()) == got[1]:
                        out[got[0]:got[0] + got[1]] = record.writes.get_datas()
            now = time.monotonic()
            for tag, (offset, words, sent, tries) in list(flight.items()):
                if now - sent < self.timeout_s:
                    continue
                del flight[tag]
                if tries >= RETRIES:
                    raise BoardTimeout(f"the board at udp://{self.host}:{self.port} did not answer a read of "
                                       f"{words} words at {addr + 4 * offset:#x} ({RETRIES} tries)")
                self.resent += 1
                flight[self._read_request(addr + 4 * offset, words)] = [offset, words, now, tries + 1]
        return out

    def _read_request(self, addr: int, words: int) -> int:
        self._tag = (self._tag + 1) & 0xFFFF_FFFF
        record = self._record()
        record.reads = self.eb.EtherboneReads(addr_size=4, addrs=[addr + 4 * j for j in range(words)])
        record.rcount = words
        record.reads.base_ret_addr = self._tag
        packet = self.eb.EtherbonePacket(32)
        packet.records = [record]
        self._send(packet)
        return self._tag

    def read_word(self, addr: int) -> int:
        return int(self.read(addr, 1)[0])

    # ------------------------------------------------------------ writes
    def write(self, addr: int, words) -> None:
        """Post ``words`` (uint32) from ``addr`` on; nothing answers."""
        words = np.ascontiguousarray(words, dtype=np.uint32).ravel()
        for i in range(0, words.shape[0], MAX_WORDS):
            chunk = words[i:i + MAX_WORDS].tolist()
            record = self._record()
            record.writes = self.eb.EtherboneWrites(addr_size=4, base_addr=addr + 4 * i, datas=iter(chunk))
            record.wcount = len(chunk)
            packet = self.eb.EtherbonePacket(32)
            packet.records = [record]
            self._send(packet)

    def write_verified(self, addr: int, words, rounds: int = 5 * RETRIES) -> None:
        """Write ``words`` and read them back until the board holds every one (the records that
        differ are written again); BoardTimeout after ``rounds`` rounds."""
        words = np.ascontiguousarray(words, dtype=np.uint32).ravel()
        pending = [(0, words.shape[0])]
        for _ in range(rounds):
            for start, stop in pending:
                self.write(addr + 4 * start, words[start:stop])
            again = []
            for start, stop in pending:
                held = self.read(addr + 4 * start, stop - start)
                bad = np.flatnonzero(held != words[start:stop])
                if bad.size:  # again from the first wrong record to the end of this range
                    again.append((start + bad[0] // MAX_WORDS * MAX_WORDS, stop))
            if not again:
                return
            self.resent += len(again)
            pending = again
        raise BoardTimeout(f"the board at udp://{self.host}:{self.port} did not take a write of "
                           f"{words.shape[0]} words at {addr:#x} ({rounds} rounds)")
