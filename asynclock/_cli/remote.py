"""``asynclock stats`` and ``asynclock advise``: ask a running process, not a lock server.

A process opts in with ``asynclock.serve_stats(backend, ADDRESS)`` (a unix socket or a
loopback port; see ``asynclock/_ops/serve.py``); these commands read it with ``--from
ADDRESS``. Exit codes as the other operator commands: 0 done, 1 ``advise``: not enough
samples yet (or the process does not collect advice), 2 bad options, 3 nothing answered
at the address (the message says why).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any
from urllib.parse import quote

from .._ops.serve import fetch, parse_address
from .ops import DONE, NO, UNAVAILABLE, USAGE
from .output import Output, make_output, safe, wants_color
from .registry import Command, register


def _ask(args: argparse.Namespace, parser: argparse.ArgumentParser, target: str) -> Any:
    """The JSON at ``target`` of ``--from``, or an exit code (printed why)."""
    try:
        parse_address(args.source)
    except (ValueError, TypeError) as exc:
        parser.error(f"--from: {exc}")
    try:
        status, body = fetch(args.source, target)
    except OSError as exc:
        print(
            f"asynclock {args.command}: nothing answered at {args.source} ({exc}); is the "
            "process running with asynclock.serve_stats(backend, ADDRESS)?",
            file=sys.stderr,
        )
        return UNAVAILABLE
    if status != 200:
        error = body.get("error") if isinstance(body, dict) else body
        print(f"asynclock {args.command}: {args.source}: {safe(str(error))}", file=sys.stderr)
        return USAGE if status in (400, 404) else NO
    return body


def _seconds(value: float | None) -> str:
    if value is None:
        return "-"
    if value < 0.001:
        return f"{value * 1e6:.0f}µs"
    if value < 1:
        return f"{value * 1e3:.3g}ms"
    return f"{value:.3g}s"


def run_stats(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    body = _ask(args, parser, "/")
    if isinstance(body, int):
        return body
    if args.json:
        print(json.dumps(body))
        return DONE
    out = make_output(wants_color(args.no_color))
    stats = body["stats"]
    holds = stats["hold_times"]
    rows = [
        ["held now", str(stats["held"])],
        ["acquired", str(stats["acquired"])],
        ["released", str(stats["released"])],
        ["busy attempts", str(stats["busy_attempts"])],
        ["renewals", f"{stats['renewals']} in {stats['renewal_round_trips']} round trips"],
        ["renewal errors", str(stats["renewal_errors"])],
        ["leases lost", str(stats["losses"])],
    ]
    rows += [[f"  lost: {why}", str(n)] for why, n in sorted(stats["loss_reasons"].items())]
    rows.append(
        [
            "hold p50/p90/p99/max",
            " / ".join(_seconds(holds[k]) for k in ("p50", "p90", "p99", "max"))
            + f" ({holds['count']} holds)",
        ]
    )
    title = f"{body['backend']} in pid {body['pid']} (asynclock {body['asynclock']})"
    out.table(title, [("", "<"), ("", "<")], rows)
    _advice_table(out, body.get("advice"))
    return DONE


def _advice_table(out: Output, advice: list[dict[str, Any]] | None) -> None:
    if advice is None:
        out.line([("advice is not collected (backend.collect_advice() turns it on)", "dim")])
        return
    rows = [
        [
            a["template"],
            str(a["samples"]),
            _seconds(a["hold_p99"]),
            _seconds(a["max_hold"]),
            _seconds(a["ttl"]),
        ]
        for a in advice
    ]
    columns = [("template", "<"), ("holds", ">"), ("p99 hold", ">"), ("max_hold", ">")]
    out.table("advice per name template", [*columns, ("ttl", ">")], rows)


def run_advise(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    if not args.name:
        parser.error("NAME: give a lock name or template, e.g. invoice:42 or 'invoice:*'")
    body = _ask(args, parser, "/advise?name=" + quote(args.name, safe=""))
    if isinstance(body, int):
        return body
    code = DONE if body["enough"] else NO
    if args.json:
        print(json.dumps(body))
        return code
    out = make_output(wants_color(args.no_color))
    rows = [
        ["max_hold", _seconds(body["max_hold"])],
        ["ttl", _seconds(body["ttl"])],
        ["holds measured", f"{body['samples']} (p99 {_seconds(body['hold_p99'])})"],
        [
            "renewal rounds",
            f"{body['renewal_samples']} (p99 round trip {_seconds(body['round_trip_p99'])}, "
            f"p99 loop lag {_seconds(body['loop_lag_p99'])})",
        ],
    ]
    out.table(f"advice for {body['template']} on {body['backend']}", [("", "<"), ("", "<")], rows)
    out.paragraph([(body["reasoning"], "")], "  ", "  ")
    return code


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--from",
        dest="source",
        metavar="ADDRESS",
        required=True,
        help="where the process serves its stats: unix:/path or 127.0.0.1:PORT "
        "(asynclock.serve_stats)",
    )
    parser.add_argument("--json", action="store_true", help="one JSON object")
    parser.add_argument(
        "--no-color", action="store_true", help="plain output (default: colors on a terminal)"
    )


def _advise_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", metavar="NAME", help="a lock name or its template")
    _common(parser)


_EXITS = "\nexit codes: 0 done{}, 2 bad options, 3 nothing answered at the address."

register(
    Command(
        name="stats",
        help="a running process's lock counters, hold times and advice",
        description="Read backend.stats() (and, when collected, the advice per name template)\n"
        "from a process that serves them: asynclock.serve_stats(backend, ADDRESS).",
        epilog="examples:\n  asynclock stats --from unix:/run/app/asynclock.sock\n"
        "  asynclock stats --from 127.0.0.1:9181 --json" + _EXITS.format(""),
        add_arguments=_common,
        run=run_stats,
    )
)
register(
    Command(
        name="advise",
        help="ttl and max_hold for a lock, from a running process's measured holds",
        description="Ask a process that collects advice (backend.collect_advice()) and serves\n"
        "it (asynclock.serve_stats) for the ttl and max_hold of NAME's template:\n"
        "max_hold = 5 x p99 hold, ttl from the tail of renewal round trips and loop lag.",
        epilog="examples:\n  asynclock advise invoice:42 --from unix:/run/app/asynclock.sock\n"
        "  asynclock advise 'invoice:*' --from 127.0.0.1:9181 --json"
        + _EXITS.format(", 1 not enough samples yet"),
        add_arguments=_advise_args,
        run=run_advise,
    )
)
