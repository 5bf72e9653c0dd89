"""Instructions per uncontended hold, counted by valgrind (callgrind): where the core's cost
goes, without the timing noise of ``bench_overhead``.

The rows are ``bench_overhead``'s (driver alone, scope floor, guarantee floor, core inline,
asynclock), on the memory driver marked ``remote``: the core then takes the path it takes
on redis, redlock, postgres and etcd (no checkpoint before the attempt, the release bound
armed up front), minus the I/O. The driver suspends once per acquire and per release
(``asyncio.sleep(0)``), as a round trip does, so resuming through the core's coroutine
layers is counted too. Each row runs ``N`` and ``2N`` holds in a child process under
callgrind; instructions per hold = ``(I(2N) - I(N)) / N``, so start-up cancels out.

``--ablate`` adds rows: the asynclock row again on copies of the package with one piece of
the core stubbed out each, so each row says what that piece costs, and one with every
piece stubbed at once. A stub whose code is no longer found stops the run (the ablation is
stale, not silently zero).

Needs ``valgrind`` on PATH (Debian package ``valgrind``); about a minute per row pair on
one core, rows run in parallel on every CPU. A comparison table, not a pass/fail test.

Usage::

    uv run python -m benchmarks.bench_instructions [--holds N] [--ablate]
        [--backend memory|redis] [--against REV]

``--backend redis`` counts the rows against a redis-server started here (the client
process only: the server runs outside callgrind). ``--against REV`` adds the rows that use
only the public API (driver alone, asynclock) on the package as it was at git revision
``REV``, in the same run: the old and new core side by side.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

#: What ``--ablate`` stubs out, one row each: (file under asynclock/, code, stand-in).
#: The stand-ins keep the hold working for one uncontended task; they are not fixes.
ABLATIONS: dict[str, list[tuple[str, str, str]]] = {
    "debug-log checks": [
        (
            "_core/release.py",
            "if _known_level(_DEBUG, True) and logger.isEnabledFor(_DEBUG):",
            "if False:",
        ),
        (
            "_core/session.py",
            "if _known_level(_DEBUG, True) and logger.isEnabledFor(_DEBUG):",
            "if False:",
        ),
    ],
    "running-task lookup": [
        ("_core/lock.py", "task = acq.current_task()", "task = 1"),
    ],
    "owner id": [
        ("_core/acquisition.py", 'owner = "%032x" % next(self._owner_seq)', 'owner = "o"'),
    ],
    "lease stack (current_lease)": [
        (
            "_core/context.py",
            "            LEASES.set(stack + ((pusher, lease, scope),))",
            "            _LAST[:] = [(pusher, lease, scope)]",
        ),
        (
            "_core/context.py",
            "    stack = LEASES.get()\n    if stack and stack[-1][0] is pusher:\n"
            "        LEASES.set(stack[:-1])",
            "    stack = _LAST\n    if stack and stack[-1][0] is pusher:\n        pass",
        ),
        ("_core/context.py", "def enter_body(", "_LAST: list[Entry] = []\n\n\ndef enter_body("),
    ],
    "release bound": [
        (
            "_core/release.py",
            "bounds.inflight[scope] = now + bounds.timeout",
            "bounds.parked = None",
        ),
        ("_core/release.py", "bounds.inflight.pop(scope, None)", "pass"),
    ],
    "stats": [
        ("_core/session.py", "self.stats.acquired += 1", "pass"),
        (
            "_core/session.py",
            "self.stats.hold_times.append(now - lease.acquired_at)\n"
            "        if released:\n"
            "            self.stats.released += 1",
            "pass",
        ),
    ],
    "renewer/watchdog wake checks": [
        (
            "_core/session.py",
            "        if t_send + ttl * self.heartbeat < renewer.next_round:",
            "        if False:",
        ),
        (
            "_core/session.py",
            "        if lease._deadline < self._watch_until or (",
            "        if False and (",
        ),
    ],
    "observer seam": [
        (
            "_core/acquisition.py",
            "        if self.session.observer is not None and not observed:",
            "        if False:",
        ),
        (
            "_core/release.py",
            "                if session.observer is not None:",
            "                if False:",
        ),
    ],
    "enter-body deadline check": [
        (
            "_core/context.py",
            "        if now < lease._deadline and (hard is None or now < hard):",
            "        if True:",
        ),
    ],
}


#: All of them at once: what the core costs with every piece above taken off the hot path.
ABLATIONS["every piece above"] = [stub for stubs in ABLATIONS.values() for stub in stubs]


#: Rows whose code uses only the public API: they run on any version of the package, so
#: ``--against`` can count them on an older one too.
PUBLIC_ROWS = ("driver alone", "asynclock")


def child(row: str, holds: int, url: str = "memory://") -> None:
    """Run ``holds`` holds of ``row`` (in the child, under callgrind) on ``url``'s backend
    (``memory://``: the memory driver marked remote, see the module docstring)."""
    from asyncio import sleep

    import anyio

    import asynclock
    from asynclock.backends.memory import MemoryDriver

    class RemoteMemory(MemoryDriver):
        remote = True  # take the suspending backends' path through the core

        async def acquire(self, *args: Any, **kwargs: Any) -> Any:
            await sleep(0)  # one real suspension per call, as a round trip makes
            return await super().acquire(*args, **kwargs)

        async def release(self, *args: Any, **kwargs: Any) -> Any:
            await sleep(0)
            return await super().release(*args, **kwargs)

    def public_cycle(backend: asynclock.Backend) -> Any:
        driver, name = backend.driver, f"ir:{row}"
        owners = (f"driver-alone-{i}" for i in range(10**9))
        lock = backend.lock(name, ttl=60.0)

        async def bare() -> None:
            owner = next(owners)
            token = await driver.acquire(name, owner, 60.0, queue=True)
            await driver.release(name, owner, token)  # type: ignore[arg-type]

        async def ours() -> None:
            async with lock:
                pass

        return bare if row == "driver alone" else ours

    async def run() -> None:
        backend = (
            asynclock.Backend(RemoteMemory()) if url == "memory://" else asynclock.connect(url)
        )
        async with backend:
            if row in PUBLIC_ROWS:
                cycle = public_cycle(backend)
            else:
                from benchmarks.bench_overhead import row_cycles

                cycle = row_cycles(backend)[row]
            for _ in range(holds):
                await cycle()

    anyio.run(run)


def count(row: str, holds: int, package: Path | None, url: str = "memory://") -> int:
    """Instructions callgrind counts for a whole child run of ``holds`` holds."""
    # The project root is importable (editable install); PYTHONPATH puts a copy of the
    # package in front of it.
    # A fixed hash seed: dict and set probes then repeat from run to run.
    env = {**os.environ, "PYTHONPATH": str(package) if package else "", "PYTHONHASHSEED": "0"}
    code = f"from benchmarks.bench_instructions import child; child({row!r}, {holds}, {url!r})"
    with tempfile.TemporaryDirectory(prefix="asynclock-ir-") as tmp:
        valgrind = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={tmp}/out"]
        out = subprocess.run(
            [*valgrind, sys.executable, "-c", code],
            capture_output=True,
            text=True,
            timeout=1800,
            check=False,
            cwd=tmp,
            env=env,
        )
    found = re.search(r"Collected : (\d+)", out.stderr)
    if out.returncode != 0 or found is None:
        raise SystemExit(f"{row} ({package or 'asynclock'}): child failed:\n{out.stderr[-2000:]}")
    return int(found.group(1))


def per_hold(row: str, holds: int, package: Path | None = None, url: str = "memory://") -> float:
    return (count(row, 2 * holds, package, url) - count(row, holds, package, url)) / holds


def checked_out(root: Path, rev: str) -> Path:
    """The package as it was at git revision ``rev`` (under ``root``)."""
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", rev, "asynclock"],
        capture_output=True,
        check=True,
    ).stdout
    copy = root / f"at-{rev}"
    copy.mkdir()
    subprocess.run(["tar", "-x", "-C", str(copy)], input=archive, check=True)
    return copy


def ablated(root: Path, name: str) -> Path:
    """A copy of the package with ``name``'s stubs applied (under ``root``)."""
    copy = root / re.sub(r"\W+", "-", name)
    shutil.copytree(ROOT / "asynclock", copy / "asynclock")
    for file, code, stand_in in ABLATIONS[name]:
        target = copy / "asynclock" / file
        text = target.read_text()
        if code not in text:
            raise SystemExit(f"ablation {name!r} is stale: {code!r} is not in asynclock/{file}")
        target.write_text(text.replace(code, stand_in))
    return copy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--holds", type=int, default=2000)
    parser.add_argument("--ablate", action="store_true", help="also cost pieces of the core")
    parser.add_argument(
        "--backend",
        choices=("memory", "redis"),
        default="memory",
        help="memory: the memory driver on the remote path; redis: a redis-server started here",
    )
    parser.add_argument(
        "--against",
        metavar="REV",
        help="also count the public rows on the package as it was at git revision REV",
    )
    args = parser.parse_args()
    if shutil.which("valgrind") is None:
        raise SystemExit("needs valgrind on PATH (Debian: apt-get install valgrind)")
    from benchmarks.bench_overhead import ROWS, servers

    with (
        tempfile.TemporaryDirectory(prefix="asynclock-ablate-") as tmp,
        servers({args.backend}) as urls,
    ):
        url = urls[args.backend]
        jobs: dict[str, tuple[str, Path | None]] = {row: (row, None) for row in ROWS}
        if args.ablate:
            for name in ABLATIONS:
                jobs[f"asynclock without {name}"] = ("asynclock", ablated(Path(tmp), name))
        if args.against:
            old = checked_out(Path(tmp), args.against)
            for row in PUBLIC_ROWS:
                jobs[f"{row} at {args.against}"] = (row, old)
        with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
            futures = {
                label: pool.submit(per_hold, row, args.holds, package, url)
                for label, (row, package) in jobs.items()
            }
            result = {label: future.result() for label, future in futures.items()}
    bare, ours = result["driver alone"], result["asynclock"]
    where = "memory driver on the remote path" if args.backend == "memory" else "redis-server"
    print(f"instructions per hold, {where}, {args.holds} holds")
    print(f"{'row':<46} {'per hold':>9} {'over driver alone':>18} {'vs asynclock':>13}")
    for label, value in result.items():
        alone = result.get(f"driver alone at {args.against}", bare) if " at " in label else bare
        over = "" if label.startswith("driver alone") else f"{value - alone:>18,.0f}"
        versus = f"{value - ours:>+13,.0f}" if label != "asynclock" else ""
        print(f"{label:<46} {value:>9,.0f} {over:>18} {versus}")


if __name__ == "__main__":
    main()
