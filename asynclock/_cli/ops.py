"""Operator commands against any lock server: ``holder``, ``list``, ``break``, ``watch``.

Each opens the URL's backend for the one question (``--url``, else ``$ASYNCLOCK_URL``),
prints through :mod:`.output` (or one JSON object per answer with ``--json``) and closes
it. The URL is shown as the backend shows it (``Driver.display``): never a password.

Exit codes: 0 done (``holder``: the name is held), 1 ``holder``: not held / ``break``:
nothing live was removed, 2 bad options, 3 the server could not be asked (the message
says why).
"""

from __future__ import annotations

import argparse
import getpass
import json
import logging
import math
import os
import socket
import sys
import time
import warnings
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any

import asynclock

from .._core.leadership import identity_of
from .._core.owner_label import LABEL_MARK
from .._core.validation import check_name
from .holds import describe_hold, hold_json, holds_of, list_all, show_holds
from .output import Output, make_output, safe, wants_color
from .registry import Command, register

URL_ENV = "ASYNCLOCK_URL"
#: Exit codes (see the module docstring).
DONE, NO, USAGE, UNAVAILABLE = 0, 1, 2, 3


def _add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--url",
        metavar="URL",
        help=f"the lock server, any asynclock URL (default: ${URL_ENV})",
    )
    parser.add_argument("--json", action="store_true", help="one JSON object per answer")
    parser.add_argument(
        "--no-color", action="store_true", help="plain output (default: colors on a terminal)"
    )


def _backend(args: argparse.Namespace, parser: argparse.ArgumentParser) -> asynclock.Backend:
    url = args.url or os.environ.get(URL_ENV)
    if not url:
        parser.error(f"no lock server: give --url URL or set {URL_ENV}")
    scheme = url.partition(":")[0].strip().lower()
    if scheme == "memory":
        parser.error("--url memory:// keeps locks inside one process: nothing to look at here")
    try:
        return asynclock.connect(url)  # builds the driver only: no I/O yet
    except (ValueError, TypeError) as exc:
        parser.error(f"--url: {exc}")
    except ModuleNotFoundError as exc:
        parser.error(f"--url: the {scheme}:// backend is not available here ({exc})")


def _name(parser: argparse.ArgumentParser, name: str) -> str:
    try:
        check_name(name)
    except (ValueError, TypeError) as exc:
        parser.error(f"NAME: {exc}")
    return name


def _run(
    args: argparse.Namespace,
    parser: argparse.ArgumentParser,
    ask: Callable[[asynclock.Backend, Output], Awaitable[int]],
) -> int:
    import anyio

    # A client library's own log lines and warnings (kazoo logs every refused connect)
    # are not for the operator's terminal: the command says what failed, once.
    logging.getLogger("kazoo").addHandler(logging.NullHandler())
    logging.getLogger("kazoo").propagate = False
    warnings.filterwarnings("ignore", module="kazoo")
    backend = _backend(args, parser)
    out = make_output(wants_color(args.no_color))

    async def main() -> int:
        async with backend:
            return await ask(backend, out)

    try:
        return anyio.run(main)
    except asynclock.BackendUnavailable as exc:
        print(f"asynclock {args.command}: {safe(str(exc))}", file=sys.stderr)
        return UNAVAILABLE
    except NotImplementedError as exc:
        print(f"asynclock {args.command}: {safe(str(exc))}", file=sys.stderr)
        return USAGE
    except KeyboardInterrupt:
        return 130


def _as_json(held: asynclock.Holder | None, name: str, display: str) -> dict[str, Any]:
    return {
        "backend": display,
        "name": name,
        "kind": "lock",
        "held": held is not None and held.grace_until is None,
        "owner": held.owner if held else None,
        "label": held.label if held else None,
        "identity": _identity(held),
        "token": held.token if held else None,
        "ttl_left": None if held is None or held.remaining is None else round(held.remaining, 3),
        "grace_until": held.grace_until if held else None,
        "detail": held.detail if held else None,
    }


def _identity(held: asynclock.Holder | None) -> str | None:
    """The identity in the owner's tag: a leadership term's identity, or the member id of
    a partition group's member and partition locks (``<group>/member/<id>``,
    ``<group>/partition/<i>``); None for a plain lock."""
    return None if held is None or held.owner is None else identity_of(held.owner)


def _owner_shown(held: asynclock.Holder) -> str | None:
    """The owner id a person reads: without the hex of the label (shown as the label
    itself) where there is one; ``--json`` keeps the whole stored owner."""
    if held.owner is None or held.label is None:
        return held.owner
    return held.owner.partition(LABEL_MARK)[0]


def _describe(held: asynclock.Holder | None) -> str:
    """One line on ``held`` as a stranger reads it (no claim about when it frees)."""
    if held is None:
        return "free: nobody holds it"
    if held.grace_until is not None:
        end = datetime.fromtimestamp(held.grace_until, UTC).strftime("%H:%M:%S UTC")
        return f"not granted before {end}: the server is in its restart grace"
    owner = _owner_shown(held) or "unknown (the server keeps no owner)"
    if held.label is not None:
        owner = f"{owner} ({held.label})"
    token = "unknown" if held.token is None else str(held.token)
    if held.remaining is None:
        left = "no expiry (held for the holder's session)"
    else:
        left = f"lease ends in {held.remaining:.1f}s unless renewed"
    if held.detail is not None:
        return f"{held.detail}; token {token}; {left}"
    return f"held by owner {owner}, token {token}; {left}"


# -- holder -----------------------------------------------------------------------------


def run_holder(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    name = _name(parser, args.name)

    async def ask(backend: asynclock.Backend, out: Output) -> int:
        held = await backend.holder(name)
        # The name's semaphore permits and read-write holds (namespaces of their own).
        holds, note = await holds_of(backend, name)
        lock_held = held is not None and held.grace_until is None
        if args.json:
            seen = _as_json(held, name, backend.driver.display)
            seen["held"] = lock_held or bool(holds)
            seen["holds"] = None if note and not holds else [hold_json(h) for h in holds]
            seen["holds_note"] = note or None
            print(json.dumps(seen))
        else:
            out.line([(name, "h"), (f" on {backend.driver.display}", "dim")])
            if held is not None or not holds:
                lock = "" if not holds else "lock: "
                out.paragraph([(lock + _describe(held), "")], "  ", "  ")
            show_holds(out, holds)
            if note:
                out.paragraph(
                    [(f"(permits and read-write holds not shown: {note})", "dim")], "  ", "  "
                )
        return DONE if lock_held or holds else NO

    return _run(args, parser, ask)


# -- list -------------------------------------------------------------------------------


def _whole(low: int, high: int | None = None) -> Callable[[str], int]:
    """An argparse type: a whole number from ``low`` (to ``high``)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a whole number, got {text!r}") from None
        if value < low or (high is not None and value > high):
            allowed = f"from {low} to {high}" if high is not None else f"at least {low}"
            raise argparse.ArgumentTypeError(f"must be {allowed}, got {text!r}")
        return value

    return parse


def _listed_json(held: asynclock.Holder, display: str) -> dict[str, Any]:
    """One row of ``asynclock list --json``: a lock's, a permit's or a read-write hold's."""
    seen = _as_json(held, held.name, display)
    seen.update(kind=held.kind, slot=held.slot, limit=held.limit)
    seen["held"] = seen["held"] and held.kind != "intent"  # a waiting writer holds nothing
    return seen


def run_list(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    async def ask(backend: asynclock.Backend, out: Output) -> int:
        found, note = await list_all(backend, args.pattern, args.limit)
        display = backend.driver.display
        if args.json:
            print(json.dumps([_listed_json(h, display) for h in found]))
            if note:
                print(f"asynclock list: not listed: {safe(note)}", file=sys.stderr)
            return DONE
        if not found:
            out.line(
                [(f"no held lock matches {args.pattern!r} on {display}", ""),
                 (" (nor any permit or read-write hold)" if not note else "", "")]
            )  # fmt: skip
        else:
            holds = any(h.kind != "lock" for h in found)  # (else no kind, no slot column)
            rows = [
                [
                    h.name,
                    h.kind,
                    "-" if h.slot is None else str(h.slot),
                    h.label or "?",
                    _owner_shown(h) or "?",
                    "?" if h.token is None else str(h.token),
                    "-" if h.remaining is None else f"{h.remaining:.1f}s",
                ]
                for h in found
            ]
            columns = [
                ("name", "<"), ("kind", "<"), ("slot", ">"), ("label", "<"), ("owner", "<"),
                ("token", ">"), ("lease left", ">"),
            ]  # fmt: skip
            for at, unused in ((2, all(h.slot is None for h in found)), (1, not holds)):
                if unused:
                    del columns[at]
                    for row in rows:
                        del row[at]
            identities = [_identity(h) for h in found]
            if any(identities):  # terms and partition groups: who, by identity / member id
                at = len(columns) - 2
                columns.insert(at, ("identity / member", "<"))
                for row, identity in zip(rows, identities, strict=True):
                    row.insert(at, identity or "-")
            out.table(f"{len(found)} held on {display}", columns, rows)
            if len(found) == args.limit:
                out.line([(f"(stopped at --limit {args.limit})", "dim")])
        if note:
            out.paragraph([(f"(not listed: {note})", "dim")], "", "  ")
        return DONE

    return _run(args, parser, ask)


# -- break ------------------------------------------------------------------------------


def _who() -> str:
    try:
        user = getpass.getuser()
    except Exception:  # no user name (a container without one)
        user = str(os.getuid()) if hasattr(os, "getuid") else "?"
    return f"{user}@{socket.gethostname()} (pid {os.getpid()})"


def _broken_story(backend: asynclock.Backend, held: asynclock.Holder) -> str:
    """What a break did, and what follows, as the operator reads it."""
    token = "unknown" if held.token is None else str(held.token)
    was = f"(was token {token})."
    if getattr(backend.driver, "mode", None) == "session" and held.detail is not None:
        # PostgreSQL mode=session: a session lock is freed only by its own session.
        session = held.detail.removeprefix("held by ")
        return (
            f"{was} asynclock ended {session}: a session lock can be freed only by its own "
            "session, so every other lock and open transaction of that session ended with "
            "it. Its holder's connection is gone: it loses the lease and its body is "
            f"cancelled; a write it still makes with token {token} is refused by a fence; "
            "the next holder gets a larger token."
        )
    return (
        f"{was} Its holder loses the lease at its next renewal and its body is cancelled; "
        f"a write it still makes with token {token} is refused by a fence; the next holder "
        "gets a larger token."
    )


def run_break(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    name = _name(parser, args.name)
    if not args.yes and not sys.stdin.isatty():
        parser.error(f"refusing to break {name!r} without --yes: no terminal to ask on")
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(message)s")

    async def ask(backend: asynclock.Backend, out: Output) -> int:
        import anyio.to_thread

        display = backend.driver.display
        held = await backend.holder(name)
        if held is None or held.grace_until is not None:
            if args.json:
                print(json.dumps({**_as_json(held, name, display), "broken": False}))
            else:
                out.line([(f"{name}: ", "h"), (_describe(held) + "; nothing to break", "")])
            return NO
        if not args.yes:
            question = f"Break {name!r} on {display}, {_describe(held)}? [y/N] "
            answer = await anyio.to_thread.run_sync(input, question)
            if answer.strip().lower() not in ("y", "yes"):
                out.line([("not broken", "")])
                return NO
        logging.getLogger("asynclock").warning(
            "asynclock break %r on %s: requested by %s; holder %s token %s",
            name,
            display,
            _who(),
            held.owner,
            held.token,
        )
        broken = await backend.break_lock(name)
        if args.json:
            print(json.dumps({**_as_json(held, name, display), "broken": broken}))
        elif broken:
            out.paragraph([(f"broken: {name}", "good"), (" " + _broken_story(backend, held), "")])
        else:
            out.line([(f"{name}: its lease ended before the break; nothing removed", "")])
        return DONE if broken else NO

    return _run(args, parser, ask)


# -- watch ------------------------------------------------------------------------------


def _interval(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of seconds, got {text!r}") from None
    if not (math.isfinite(value) and 0.05 <= value <= 60):
        raise argparse.ArgumentTypeError(f"must be from 0.05 to 60 seconds, got {text!r}")
    return value


def run_watch(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    name = _name(parser, args.name)

    async def ask(backend: asynclock.Backend, out: Output) -> int:
        import anyio

        display = backend.driver.display
        if not args.json:
            out.line([(f"watching {name} on {display}", "h"), (" (Ctrl-C stops)", "dim")])
        seen: tuple[object, ...] | None = None
        events = 0
        while True:
            held = await backend.holder(name)
            # The name's permits and read-write holds too (namespaces of their own).
            holds, note = await holds_of(backend, name)
            state = (
                (None,) if held is None else (held.owner, held.token, held.grace_until),
                [(h.kind, h.slot, h.owner, h.token) for h in holds],
            )
            if state != seen:
                if seen is None and note and not args.json:
                    out.paragraph([(f"(permits and read-write holds not shown: {note})", "dim")])
                seen = state
                events += 1
                stamp = datetime.now(UTC).strftime("%H:%M:%S.%f")[:-3]
                if args.json:
                    shown = {"at": time.time(), **_as_json(held, name, display)}
                    shown["held"] = shown["held"] or bool(holds)
                    shown["holds"] = None if note and not holds else [hold_json(h) for h in holds]
                    print(json.dumps(shown))
                    sys.stdout.flush()
                else:
                    lock = "lock: " if holds else ""
                    out.paragraph([(lock + _describe(held), "")], f"  {stamp}  ", " " * 16)
                    for h in holds:
                        out.paragraph([(describe_hold(h), "")], " " * 16, " " * 18)
                if args.count is not None and events >= args.count:
                    return DONE
            await anyio.sleep(args.interval)

    return _run(args, parser, ask)


# -- registration -----------------------------------------------------------------------


def _holder_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", metavar="NAME", help="the lock name")
    _add_common(parser)


def _list_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "pattern",
        metavar="PATTERN",
        nargs="?",
        default="*",
        help="shell-style glob of names, e.g. 'invoice:*' (default: every name)",
    )
    parser.add_argument(
        "--limit", type=_whole(1, 100_000), default=1000, help="at most this many (default: 1000)"
    )
    _add_common(parser)


def _break_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", metavar="NAME", help="the lock name")
    parser.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    _add_common(parser)


def _watch_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", metavar="NAME", help="the lock name")
    parser.add_argument(
        "--interval", type=_interval, default=0.5, help="seconds between looks (default: 0.5)"
    )
    parser.add_argument(
        "--count", type=_whole(1), help="stop after this many changes (default: never)"
    )
    _add_common(parser)


def _exits(one: str | None = None) -> str:
    """The epilog's last line: what each exit code means for this command."""
    answer = "0 done" if one is None else f"0 done, 1 {one}"
    return f"\nexit codes: {answer}, 2 bad options, 3 the server could not be asked."


register(
    Command(
        name="holder",
        help="who holds a lock now: owner and its label, token, lease time left",
        description="Ask the lock server who holds NAME now (a snapshot, not a permission).",
        epilog="examples:\n  asynclock holder invoice:42 --url redis://localhost:6379/0\n"
        "  ASYNCLOCK_URL=sqlite:///locks.db asynclock holder invoice:42 --json"
        + _exits("nobody holds it"),
        add_arguments=_holder_args,
        run=run_holder,
    )
)
register(
    Command(
        name="list",
        help="the names held now (sqlite, redis, postgres mode=lease, etcd)",
        description="List the held names matching PATTERN, with label, owner, token and lease "
        "left.\n"
        "Redlock and PostgreSQL mode=session cannot enumerate their names (asked, they say "
        "why); ask `asynclock holder NAME` there.",
        epilog="examples:\n  asynclock list 'invoice:*' --url postgresql://app@db/app\n"
        "  asynclock list --json --url etcd://localhost:2379" + _exits(),
        add_arguments=_list_args,
        run=run_list,
    )
)
register(
    Command(
        name="break",
        help="remove whoever holds a lock (asks first; the holder is fenced off)",
        description="Remove the live lease of NAME, whoever holds it: for a stuck holder.\n"
        "The holder loses its lease at its next renewal (its body is cancelled and raises\n"
        "LeaseLost); the next holder's token is larger, so a fence refuses the old holder's\n"
        "late writes. Asks for confirmation unless --yes; logs who asked, on stderr.",
        epilog="examples:\n  asynclock break invoice:42 --url redis://localhost:6379/0\n"
        "  asynclock break invoice:42 --yes --json --url sqlite:///locks.db"
        + _exits("nothing live was removed (or you said no)"),
        add_arguments=_break_args,
        run=run_break,
    )
)
register(
    Command(
        name="watch",
        help="follow a lock live: each grant and release, as the server sees it",
        description="Look at NAME every --interval seconds and print each change of holder\n"
        "(granted to an owner with a token, freed, a restart grace). A holder that comes and\n"
        "goes between two looks is not seen; waiters are not shown.",
        epilog="examples:\n  asynclock watch invoice:42 --url redis://localhost:6379/0\n"
        "  asynclock watch invoice:42 --json --count 2 --url sqlite:///locks.db" + _exits(),
        add_arguments=_watch_args,
        run=run_watch,
    )
)
