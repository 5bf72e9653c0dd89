"""A partition member in its own process, for tests/backends/test_partition_processes.py.

``python -m tests.support.partition_worker CONFIG_JSON`` (``url``, ``options``, ``group``,
``count``, ``ttl``, ``parent``): joins the group and prints one JSON line per assignment
change, ``{"owned": [ids]}``, until killed.
"""

from __future__ import annotations

import json
import sys

import anyio

import asynclock
from asynclock._harness import die_with_parent


async def main(cfg: dict[str, object]) -> None:
    async with (
        asynclock.connect(str(cfg["url"]), **cfg["options"]) as backend,  # type: ignore[arg-type]
        backend.partitions(str(cfg["group"]), count=cfg["count"], ttl=cfg["ttl"]) as member,  # type: ignore[arg-type]
    ):
        async for owned in member.changes():
            print(json.dumps({"owned": sorted(owned)}), flush=True)


if __name__ == "__main__":
    config = json.loads(sys.argv[1])
    die_with_parent(int(config["parent"]))
    anyio.run(main, config)
