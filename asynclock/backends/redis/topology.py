"""Redis Cluster's layout as ``redis+cluster://`` sees it: the hash slot of a name, keys per
slot (the epoch and era keys every lock of a slot shares), ``CLUSTER NODES``, and the
redirections (``MOVED``, ``ASK``) a node answers with.
"""

from __future__ import annotations

import binascii
from dataclasses import dataclass

from .keys import KeyCache, WireKeys, epoch_key, era_key

SLOTS = 16384


def key_slot(key: bytes) -> int:
    """The hash slot of ``key`` (CRC16 of its hash tag, as Redis Cluster computes it)."""
    start = key.find(b"{")
    if start >= 0:
        end = key.find(b"}", start + 1)
        if end > start + 1:
            key = key[start + 1 : end]
    return binascii.crc_hqx(key, 0) % SLOTS


# A hash tag for every slot, found by solving CRC16's linear equations instead of searching:
# for strings of one length CRC16 (initial value 0) is linear over GF(2), so the tag of a
# slot is a fixed base string with chosen low nibbles (5 bytes from "`" to "o": no braces).
_TAG_BYTES = 5
_BASE = b"`" * _TAG_BYTES


def _basis() -> list[tuple[int, int]]:
    """Rows (crc, nibble bits) in echelon form: each flips one crc bit pattern."""
    rows: list[tuple[int, int]] = []
    for bit in range(4 * _TAG_BYTES):
        delta = bytearray(_TAG_BYTES)
        delta[bit // 4] = 1 << (bit % 4)
        crc, bits = binascii.crc_hqx(bytes(delta), 0), 1 << bit
        for row_crc, row_bits in rows:
            if crc ^ row_crc < crc:
                crc, bits = crc ^ row_crc, bits ^ row_bits
        if crc:
            rows.append((crc, bits))
            rows.sort(reverse=True)
    return rows


_ROWS = _basis()
_BASE_CRC = binascii.crc_hqx(_BASE, 0)


def slot_tag(slot: int) -> str:
    """A short hash tag (no braces) whose slot is ``slot``."""
    target, bits = (_BASE_CRC ^ slot) & (SLOTS - 1), 0
    for row_crc, row_bits in _ROWS:
        if target ^ row_crc < target:
            target, bits = target ^ row_crc, bits ^ row_bits
    return "".join(chr(0x60 | (bits >> (4 * i)) & 15) for i in range(_TAG_BYTES))


class SlotKeyCache(KeyCache):
    """:class:`KeyCache` whose epoch key is the name's slot's (``<prefix>epoch:{<tag>}``): a
    script's keys must share one slot, so each slot has its own restart grace and era."""

    def __call__(self, name: str) -> WireKeys:
        k = self._cache.get(name)
        if k is None:
            k = super().__call__(name)
            epoch = self.slot_keys(key_slot(k.lock))[0]
            k = self._cache[name] = WireKeys(
                k.lock,
                k.fence,
                k.queue,
                k.queue_exp,
                k.channel,
                k.channel_name,
                (k.lock, k.fence, k.queue, k.queue_exp, epoch),
                k.release_keys,
                (k.lock, k.fence, epoch),
            )
        return k

    def slot_keys(self, slot: int) -> tuple[bytes, bytes]:
        """(epoch key, era key) of ``slot``."""
        tag = slot_tag(slot)
        return (
            f"{epoch_key(self.prefix)}:{{{tag}}}".encode(),
            f"{era_key(self.prefix)}:{{{tag}}}".encode(),
        )


@dataclass(frozen=True, slots=True)
class ClusterNode:
    """One line of ``CLUSTER NODES``."""

    id: str
    address: str  # host:port
    flags: frozenset[str]
    primary_of: str  # the id of its primary, or "-"
    #: (first, last) slot ranges it serves (primaries only).
    ranges: tuple[tuple[int, int], ...]

    @property
    def serving(self) -> bool:
        """A primary in service (not failed, not a replica)."""
        return "master" in self.flags and not {"fail", "fail?", "noaddr"} & self.flags


def parse_nodes(text: str) -> list[ClusterNode]:
    """``CLUSTER NODES``: one node a line (``id addr@cport[,hostname] flags primary … slots``)."""
    nodes = []
    for line in text.splitlines():
        words = line.split()
        if len(words) < 8:
            continue
        address = words[1].split("@")[0].split(",")[0]
        ranges = []
        for word in words[8:]:
            if word.startswith("["):
                continue  # a slot being migrated or imported: its owner is the one above
            first, _, last = word.partition("-")
            ranges.append((int(first), int(last or first)))
        nodes.append(
            ClusterNode(words[0], address, frozenset(words[2].split(",")), words[3], tuple(ranges))
        )
    return nodes


def redirection(text: str) -> tuple[str, int, str] | None:
    """``MOVED 3999 127.0.0.1:6381`` -> ("MOVED", 3999, "127.0.0.1:6381") (or ASK); else None."""
    words = text.split()
    if len(words) == 3 and words[0] in ("MOVED", "ASK") and words[1].isdigit():
        return words[0], int(words[1]), words[2]
    return None
