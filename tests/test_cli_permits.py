"""``asynclock holder NAME`` for a semaphore and a read-write lock (issue 42: the CLI said
"free" while permits were held): an operator in another process sees every permit's
holder (slot, owner and label, token, ttl left) and the read-write lock's writer, readers
and waiting writers, in words (escaped) and with ``--json``; a backend that cannot list
them says so in one plain line."""

from __future__ import annotations

import json
import os
import sys

import anyio
import pytest

from asynclock._core.owner_label import label_tag
from tests.support.spec import BackendSpec
from tests.test_cli_ops import HOSTILE, ROOT, _clean, _lines, cli

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(90)]


@pytest.mark.parametrize("shared_spec", ["sqlite", "postgres", "redis", "etcd"], indirect=True)
async def test_an_operator_sees_every_permits_holder(
    shared_spec: BackendSpec, lock_name: str
) -> None:
    url = shared_spec.url
    async with (
        shared_spec.connect(owner_label="gpu-worker:1") as one,
        shared_spec.connect(owner_label="gpu-worker:2") as two,
    ):
        code, out, err = await cli("holder", lock_name, "--url", url)
        assert code == 1 and "free: nobody holds it" in out, (code, out, err)
        with anyio.fail_after(60):
            async with (
                one.semaphore(lock_name, 3).acquire(ttl=30) as p1,
                two.semaphore(lock_name, 3).acquire(ttl=30) as p2,
            ):
                code, out, err = await cli("holder", lock_name, "--url", url, "--json")
                assert code == 0, err
                seen = json.loads(out)
                assert seen["held"] is True and seen["owner"] is None  # the lock is free
                assert seen["holds_note"] is None
                got = {h["slot"]: h for h in seen["holds"]}
                for permit, label in ((p1, "gpu-worker:1"), (p2, "gpu-worker:2")):
                    h = got[permit.slot]
                    assert (h["kind"], h["limit"], h["token"]) == ("permit", 3, permit.token)
                    assert (h["owner"], h["label"]) == (permit.lease.owner, label)
                    assert 0 < h["ttl_left"] <= 30

                code, out, err = await cli("holder", lock_name, "--url", url)
                assert code == 0, err
                said = " ".join(out.split())
                assert "free: nobody holds it" not in said, said
                assert "semaphore: 2 permit(s) held of limit 3" in said, said
                assert f"slot {p1.slot}: held by owner" in said and "(gpu-worker:1)" in said
                assert f"token {p2.token}" in said and "(gpu-worker:2)" in said, said


@pytest.mark.parametrize("shared_spec", ["sqlite", "redis", "postgres_lease"], indirect=True)
async def test_an_operator_sees_the_writer_readers_and_waiting_writer(
    shared_spec: BackendSpec, lock_name: str
) -> None:
    url = shared_spec.url
    async with shared_spec.connect(owner_label="reader-node") as backend:
        rw = backend.rwlock(lock_name)
        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                async with rw.read(ttl=30) as r:

                    async def writer() -> None:
                        async with rw.write(ttl=30, timeout=40):
                            pass

                    tg.start_soon(writer)
                    # The intent shows at the server only: ask it, bounded by fail_after.
                    while not any(h.kind == "intent" for h in await rw.holders()):  # noqa: ASYNC110
                        await anyio.sleep(0.01)
                    code, out, err = await cli("holder", lock_name, "--url", url, "--json")
                    assert code == 0, err
                    holds = json.loads(out)["holds"]
                    assert [h["kind"] for h in holds] == ["read", "intent"], holds
                    assert holds[0]["token"] == r.token and holds[0]["label"] == "reader-node"
                    assert holds[1]["token"] is None
                    code, out, err = await cli("holder", lock_name, "--url", url)
                    said = " ".join(out.split())
                    assert code == 0 and "read-write lock:" in said, (out, err)
                    assert "reader: owner" in said and f"reads epoch {r.token}" in said, said
                    assert "waiting writer: owner" in said, said
                    assert "new readers wait behind it" in said, said


@pytest.mark.parametrize("spec", ["sqlite", "redis"], indirect=True)
async def test_permit_holders_are_escaped(spec: BackendSpec, lock_name: str) -> None:
    """A hostile semaphore name and label are shown escaped, never acted on."""
    name = f"{lock_name[-8:]}:{HOSTILE}"
    async with spec.connect() as backend:
        backend._acq.label_tag = label_tag("lbl\x1b]0;pwned\x07")
        with anyio.fail_after(30):
            async with backend.semaphore(name, 2).acquire(ttl=30):
                code, out, err = await cli("holder", name, "--url", spec.url)
    assert code == 0, err
    _clean(out + err)
    assert "\\x1b[2J" in out and "lbl\\x1b]0;pwned\\x07" in out, out


@pytest.mark.parametrize("shared_spec", ["redlock"], indirect=True)
async def test_a_backend_without_them_says_so_plainly(
    shared_spec: BackendSpec, lock_name: str
) -> None:
    code, out, err = await cli("holder", lock_name, "--url", shared_spec.url, "--json")
    assert code == 1, err  # nothing held; not an error of the command
    seen = json.loads(out)
    assert seen["held"] is False and seen["holds"] is None and seen["holds_note"], seen
    code, out, err = await cli("holder", lock_name, "--url", shared_spec.url)
    assert code == 1 and "free: nobody holds it" in out, (out, err)
    assert "permits and read-write holds not shown" in " ".join(out.split()), out


# One of each listing code (PostgreSQL's modes share theirs: its session mode, which
# cannot list locks, is in test_cli_ops; ZooKeeper's is in test_zookeeper_semaphores).
@pytest.mark.parametrize(
    "shared_spec", ["sqlite", "redis", "postgres_lease", "etcd"], indirect=True
)
async def test_list_shows_permits_and_read_write_holds_beside_locks(
    shared_spec: BackendSpec, lock_name: str
) -> None:
    """``asynclock list``: a kind column (lock / permit / write ...), the permit's slot,
    a hostile name escaped, and the same rows in ``--json``."""
    # A control character (a short name: the table's cells stay whole in 120 columns).
    url, name = shared_spec.url, f"{lock_name[-8:]}:\x1b[2J"
    pattern = f"{lock_name[-8:]}:*"
    async with shared_spec.connect(owner_label="lister:1") as backend:
        with anyio.fail_after(60):
            async with (
                backend.lock(name, ttl=30) as lease,
                backend.semaphore(name, 2).acquire(ttl=30) as p,
                backend.rwlock(name).write(ttl=30) as w,
            ):
                code, out, err = await cli("list", pattern, "--url", url, "--json")
                assert code == 0, err
                rows = json.loads(out)
                assert [(r["name"], r["kind"], r["slot"], r["token"]) for r in rows] == [
                    (name, "lock", None, lease.token),
                    (name, "permit", p.slot, p.token),
                    (name, "write", None, w.token),
                ]
                assert [r["limit"] for r in rows] == [None, 2, None]
                assert all(r["held"] and r["label"] == "lister:1" for r in rows), rows
                assert rows[1]["owner"] == p.lease.owner and 0 < rows[1]["ttl_left"] <= 30

                code, out, err = await cli("list", pattern, "--url", url)
                assert code == 0, err
                _clean(out + err)
                assert "3 held on" in out and "\\x1b[2J" in out, out
                header = next(line.split() for line in out.splitlines() if "kind" in line)
                assert header[:3] == ["name", "kind", "slot"], out
                cells = [line.split() for line in out.splitlines() if "lister:1" in line]
                kinds = [next(c for c in row if c in ("lock", "permit", "write")) for row in cells]
                assert kinds == ["lock", "permit", "write"], out
                assert str(p.slot) in cells[1] and str(p.token) in cells[1], out
        code, out, err = await cli("list", pattern, "--url", url)
    assert code == 0 and "no held lock matches" in out, (out, err)


@pytest.mark.parametrize("spec", ["sqlite"], indirect=True)
async def test_watch_prints_each_change_of_permits(spec: BackendSpec, lock_name: str) -> None:
    """``asynclock watch NAME`` sees the semaphore ``NAME`` too: a permit granted, then
    given back (the lock itself stays free)."""
    command = [sys.executable, "-m", "asynclock._cli", "watch", lock_name, "--url", spec.url]
    command += ["--json", "--count", "3", "--interval", "0.05"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    async with spec.connect() as backend, await anyio.open_process(command, env=env) as proc:
        assert proc.stdout is not None
        lines = _lines(proc.stdout)
        with anyio.fail_after(30):
            assert (await anext(lines))["holds"] == []
            async with backend.semaphore(lock_name, 2).acquire(ttl=5.0) as p:
                granted = await anext(lines)
            freed = await anext(lines)
            assert await proc.wait() == 0
    assert granted["held"] is True and granted["owner"] is None  # a permit, not the lock
    [h] = granted["holds"]
    assert (h["kind"], h["slot"], h["token"], h["owner"]) == (
        "permit",
        p.slot,
        p.token,
        p.lease.owner,
    )
    assert freed["held"] is False and freed["holds"] == []
