"""``asynclock drill``: attack a lock deployment with pauses, partitions, kills and clock
drift, and prove from the recorded history whether anything was lost
(:func:`asynclock.drill.run`)."""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any

from .output import Output, make_output, wants_color
from .registry import Command, register

DESCRIPTION = """\
Run worker processes that share one lock and one fenced register, inject faults while
they run, and check the history: no lost update, tokens in order, every stale write
rejected by the fence.

Each worker loops: acquire the lock -> read the register (through the fence) -> a little
work -> write register+1 with the lease's token -> release. Faults (loopback only):

  pause      SIGSTOP a holder past its TTL with its write on the way; SIGCONT it once a
             successor has written (its late write must be rejected)
  partition  a TCP proxy between each worker and the lock servers: blackhole or added
             latency for one worker (not for SQLite: no network)
  kill       kill -9 a holder (a new worker takes its lane); with --spawn every other
             kill is a lock server's (restarted; a cluster's node at the next kill)
  clock      one worker's clock runs at 0.5x or 2x (the injectable Clock)

Only when asked for (--faults ...,restart,failover), on servers the drill started:

  restart    kill -9 a lock server and start it again without its data (the restart grace)
  failover   --spawn redis-sentinel: cut a holder off from the sentinels, SENTINEL FAILOVER
             (the split brain: with --no-wait it keeps granting on the old primary: double
             grants, every stale write rejected by the fence); --spawn redis-cluster:
             CLUSTER FAILOVER FORCE

It prints a summary table, writes history.jsonl, report.json and report.html (an SVG
timeline) into --report DIR, and exits 0 only if nothing was lost with the fence on;
--no-fence runs the same schedule without the fence and exits 1, showing the damage."""

EPILOG = """\
examples:
  asynclock drill --spawn sqlite
  asynclock drill --spawn redis --workers 6 --duration 60 --report drill-report
  asynclock drill --spawn sqlite --no-fence
  asynclock drill --spawn zookeeper        (a 3-member ensemble; members are killed)
  asynclock drill --spawn redis-sentinel --faults failover,restart,pause
  asynclock drill --spawn redis-sentinel --faults failover --no-wait   (the double grant)
  asynclock drill --spawn redis-cluster --faults kill,failover,partition
  asynclock drill --url redis://127.0.0.1:6379/0 --faults pause,kill"""


def _positive(kind: type, low: float, high: float) -> Any:
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
        if not (math.isfinite(value) and low <= value <= high):
            raise argparse.ArgumentTypeError(f"must be from {low:g} to {high:g}, got {text!r}")
        return value

    return parse


def _faults(text: str) -> tuple[str, ...]:
    from ..drill import ALL_FAULTS

    if text.strip() in ("", "none"):
        return ()
    items = tuple(dict.fromkeys(t.strip() for t in text.split(",")))
    bad = [t for t in items if t not in ALL_FAULTS]
    if bad:
        raise argparse.ArgumentTypeError(
            f"unknown fault {bad[0]!r}; allowed: {','.join(ALL_FAULTS)} (comma-separated) or none"
        )
    return items


def add_arguments(p: argparse.ArgumentParser) -> None:
    from ..drill import ALL_FAULTS, FAULTS, SPAWN

    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument(
        "--url",
        metavar="URL",
        help="your lock deployment (sqlite:///..., "
        "redis://..., redlock://h1,h2,h3, postgresql://..., etcd://..., zookeeper://h1,h2,h3)",
    )
    where.add_argument("--spawn", choices=SPAWN, help="start throwaway servers on this machine")
    # (option, kind, low, high, default, metavar, help): the numbers share one shape.
    numbers = (
        ("--workers", int, 1, 256, 4, "N", "worker processes"),
        ("--duration", float, 0.5, 86400, 10.0, "SECONDS", "how long the workers run"),
        ("--ttl", float, 0.05, 60, 0.5, "SECONDS", "lease time-to-live"),
    )
    for flag, kind, low, high, default, metavar, text in numbers:
        p.add_argument(
            flag,
            type=_positive(kind, low, high),
            default=default,
            metavar=metavar,
            help=f"{text} (default: {default:g})",
        )
    p.add_argument(
        "--faults",
        type=_faults,
        default=FAULTS,
        metavar="LIST",
        help=f"comma-separated, from {','.join(ALL_FAULTS)} (default: {','.join(FAULTS)}) or none",
    )
    p.add_argument(
        "--no-wait",
        action="store_true",
        help="--spawn redis-sentinel/redis-cluster: no wait_replicas (WAIT) for the workers: "
        "a failover then shows its double grant",
    )
    p.add_argument(
        "--no-fence",
        action="store_true",
        help="the same schedule without the fence: shows what it would corrupt",
    )
    p.add_argument(
        "--report",
        type=Path,
        metavar="DIR",
        help="write history.jsonl, report.json and report.html here",
    )
    p.add_argument("--seed", type=int, help="which workers the faults hit (default: random)")
    p.add_argument(
        "--allow-remote-faults",
        action="store_true",
        help="inject faults even though --url names a non-loopback host",
    )
    p.add_argument("--no-color", action="store_true", help="plain output without colors")


class _Bar:
    """A progress line: rich's progress bar when installed, else a plain line per second."""

    def __init__(self, rich: bool, total: float) -> None:
        self.rich = None
        self.last = -1
        if rich:
            from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

            self.rich = Progress(
                TextColumn("drill"),
                BarColumn(),
                TimeRemainingColumn(),
                TextColumn("{task.description}"),
                transient=True,
            )
            self.task = self.rich.add_task("", total=total)
            self.rich.start()

    def __call__(self, elapsed: float, total: float, counters: dict[str, int]) -> None:
        text = (
            f"{counters['acquisitions']} acquisitions, {counters['faults injected']} faults, "
            f"{counters['stale writes rejected']} stale writes rejected"
        )
        if self.rich is not None:
            self.rich.update(self.task, completed=min(elapsed, total), description=text)
        elif int(elapsed) != self.last:
            self.last = int(elapsed)
            print(f"  {min(elapsed, total):5.1f}/{total:g} s  {text}", flush=True)

    def close(self) -> None:
        if self.rich is not None:
            self.rich.stop()


def render(report: Any, out: Output) -> None:
    counters = report.counters()
    rows = [[k, str(v)] for k, v in counters.items()]
    styles = {str(counters["lost updates"]): "good" if not counters["lost updates"] else "bad"}
    out.table("Drill summary", [("", "<"), ("count", ">")], rows, styles)
    if report.faults:
        faults = [
            [f"{(f.start - report.start) * 1000:.0f}", f.kind, f.target, f.detail]
            for f in report.faults
        ]
        out.table(
            "Faults injected (ms since start)",
            [("t", ">"), ("fault", "<"), ("target", "<"), ("what", "<")],
            faults,
        )


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from .. import drill

    try:
        if args.url is not None:
            drill.check_url(args.url, args.faults, args.allow_remote_faults)
    except ValueError as exc:
        parser.error(str(exc))
    color = wants_color(args.no_color)
    out = make_output(color)
    fence = not args.no_fence
    out.header(
        "asynclock drill: faults against a lock, a fenced register, a checked history",
        [
            ("backend", args.url or f"--spawn {args.spawn} (throwaway servers)"),
            (
                "workers",
                f"{args.workers} processes for {args.duration:g} s, lease ttl {args.ttl:g} s",
            ),
            ("faults", ",".join(args.faults) or "none"),
            ("fence", "on" if fence else "OFF (--no-fence: showing what it would corrupt)"),
        ],
    )
    bar = _Bar(type(out).__name__ == "RichOutput" and sys.stdout.isatty(), args.duration)
    try:
        report = drill.run(
            args.url,
            spawn=args.spawn,
            workers=args.workers,
            duration=args.duration,
            faults=args.faults,
            fence=fence,
            ttl=args.ttl,
            report_dir=args.report,
            seed=args.seed,
            allow_remote_faults=args.allow_remote_faults,
            progress=bar,
            wait=not args.no_wait,
        )
    finally:
        bar.close()
    render(report, out)
    lines = list(report.problems)
    if report.skipped:
        lines += [f"skipped {s}" for s in report.skipped]
    if args.report is not None:
        lines.append(f"report: {args.report / 'report.html'} (history: history.jsonl)")
    if report.ok:
        out.verdict(True, "Nothing was lost: every stale write was rejected by the fence.", lines)
        return 0
    if report.double_grants and not args.no_fence:
        title = (
            f"A failover granted {report.double_grants} hold(s) twice (the split brain"
            + (": run without --no-wait" if args.no_wait else "")
            + f"); the fence rejected every stale access and {report.lost_updates} "
            "update(s) were lost."
        )
        out.verdict(False, title, lines, label="NO WAIT" if args.no_wait else "")
        return 1
    if not fence:
        title = (
            f"Without the fence, {report.lost_updates} update(s) were lost."
            if report.lost_updates
            else "Without the fence nothing is guaranteed (none lost this time; run longer)."
        )
        out.verdict(False, title, lines, label="NO FENCE")
        return 1
    out.verdict(False, "The drill found problems:", lines)
    return 1


COMMAND = register(
    Command(
        name="drill",
        help="attack a lock with pauses, partitions, kills and clock drift; check the history",
        description=DESCRIPTION,
        epilog=EPILOG,
        add_arguments=add_arguments,
        run=run,
    )
)
