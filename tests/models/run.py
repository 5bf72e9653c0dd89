"""Check every Promela model here with Spin: the design must hold, each weaker variant must fail.

Run ``python3 tests/models/run.py`` (the standard library only; needs the Debian packages
``spin`` and ``gcc``). For each model, and for the design and each weaker variant's
compile flag, it runs ``spin -a``, compiles ``pan.c`` with ``-DSAFETY`` (assertions and invalid
end states only: every property here is an assertion) and runs the exhaustive search, in a
temporary directory. It prints one row per run (errors, states stored, depth, seconds, the
assertion that failed) and exits 1 if the design has an error or a weaker variant has none: a
model whose weaker variant passes checks nothing.

``--trail`` also prints, for each weaker variant, its shortest counterexample (a breadth-first
search) as ``spin -t -p`` steps, shortened; docs/proved.md summarises them.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

#: Compile flags for every verifier: safety only, a memory ceiling (MB) so a model that grew
#: by mistake fails fast instead of swapping a shared machine.
CFLAGS = ("-O2", "-w", "-DSAFETY", "-DMEMLIM=1024")
#: pan: DFS depth limit, 2^20 hash slots (enough for the largest model; -w24 would take 128 MB).
PAN_ARGS = ("-m200000", "-w20")
TIMEOUT = 300.0


@dataclasses.dataclass(frozen=True)
class Model:
    file: str
    guarantee: str
    weaker: tuple[tuple[str, str], ...]  # (compile flag, what it weakens)
    cflags: tuple[str, ...] = ()
    #: The design's check runs in the test suite too (False: its search takes half a
    #: minute or more; .ci/run's run of this script checks it, every variant in the suite).
    design_in_suite: bool = True


MODELS = (
    Model(
        "lease.pml",
        "G1 exclusion, G3 stop before the successor, G2 tokens across a data-losing restart",
        (
            ("NO_LOCAL_DEADLINE", "the holder runs until told it lost"),
            ("NO_DRIFT_ALLOWANCE", "deadline without the drift term"),
            ("SHORT_GRACE", "restart grace one tick shorter than the ttl"),
            ("NO_SEED", "a lost counter restarts from zero"),
        ),
        cflags=("-DCOLLAPSE",),
        design_in_suite=False,  # 2 million states: 7.5 s search + compile, ~29 s under load
    ),
    Model(
        "fence.pml",
        "G8 (G3 at the resource): no older token overwrites a newer write",
        (
            ("NONATOMIC_FENCE", "check, then write in a second step"),
            ("NO_FENCE", "no check at the resource"),
        ),
    ),
    Model(
        "idempotency.pml",
        "idempotency keys: one stored result, no run after it, no body after a lost hold",
        (
            ("UNFENCED_SAVE", "the save does not check the lease"),
            ("NO_ENTRY_CHECK", "the body starts without checking the hold"),
            ("NO_RECORD_CHECK", "a call ignores the stored result"),
        ),
    ),
    Model(
        "redlock.pml",
        "Redlock's two-phase tokens over 3 nodes: G1 one valid holder, G2 rising tokens, G3 fence",
        (
            ("TOKEN_BEFORE_QUORUM", "the token of one node, not the quorum's largest"),
            ("NO_PHASE2", "the quorum's largest, counters not raised"),
            ("NO_GRACE", "a node that lost its data grants at once"),
            ("DUPLICATE_NODE", "one server named twice votes twice"),
        ),
        cflags=("-DCOLLAPSE",),
        design_in_suite=False,  # 4.2 million states: 27 s quiet, ~50 s under the suite's load
    ),
    Model(
        "claims.pml",
        "claims: a row completed once, a stale completion refused, no body after a lost claim",
        (
            ("BODY_AFTER_LOSS", "the body starts without checking the claim"),
            ("UNFENCED_COMPLETE", "completion checks id and status, not the token"),
        ),
    ),
)


#: pan's words for a search that did not finish (its counts would be a lower bound). pan also
#: says "Search not completed" after the first error, where that is expected.
_CUT_SHORT = ("out of memory", "max search depth too small", "-DMEMLIM bound")


@dataclasses.dataclass
class Result:
    model: str
    variant: str  # "design" or the weaker variant's flag
    errors: int
    states: int
    depth: int
    seconds: float
    violated: str  # the failed assertion, "" if none
    output: str

    @property
    def expected_errors(self) -> bool:
        return self.variant != "design"

    @property
    def ok(self) -> bool:
        return (self.errors > 0) == self.expected_errors


def tools_missing() -> list[str]:
    """The tools this needs that are not on PATH (empty when everything is there)."""
    return [tool for tool in ("spin", "gcc") if shutil.which(tool) is None]


def _run(args: list[str], cwd: Path) -> str:
    done = subprocess.run(
        args, cwd=cwd, capture_output=True, text=True, timeout=TIMEOUT, check=False
    )
    if done.returncode != 0 and args[0] != "./pan":
        raise RuntimeError(f"{' '.join(args)} failed:\n{done.stdout}{done.stderr}")
    return done.stdout + done.stderr


def _number(pattern: str, text: str) -> float:
    found = re.search(pattern, text)
    if found is None:
        raise RuntimeError(f"pan output without {pattern!r}:\n{text}")
    return float(found.group(1))


def _compile(model: Model, flag: str | None, work: Path, extra: tuple[str, ...] = ()) -> None:
    shutil.copy(HERE / model.file, work / model.file)
    defines = [f"-D{flag}"] if flag else []
    _run(["spin", *defines, "-a", model.file], work)
    _run(["gcc", *CFLAGS, *model.cflags, *extra, "-o", "pan", "pan.c"], work)


def check(model: Model, flag: str | None) -> Result:
    """Run one exhaustive search: the design (``flag=None``) or one weaker variant."""
    with tempfile.TemporaryDirectory(prefix="asynclock-models-") as tmp:
        work = Path(tmp)
        _compile(model, flag, work)
        started = time.monotonic()
        out = _run(["./pan", *PAN_ARGS], work)
        elapsed = time.monotonic() - started
    errors = int(_number(r"errors: (\d+)", out))
    if any(cut in out for cut in _CUT_SHORT) or (errors == 0 and "Search not completed" in out):
        raise RuntimeError(f"{model.file} {flag or 'design'}: the search was cut short:\n{out}")
    violated = re.search(r"assertion violated (.*?) \(at depth", out)
    return Result(
        model=model.file,
        variant=flag or "design",
        errors=errors,
        states=int(_number(r"(\d+) states, stored", out)),
        depth=int(_number(r"depth reached (\d+)", out)),
        seconds=round(elapsed, 2),
        violated=" ".join(violated.group(1).split()) if violated else "",
        output=out,
    )


#: Trail statements that say nothing about the protocol (control flow inside a step).
_NOISE = {"IF", "DO", ".(goto)", "sub-sequence", "(1)", "break", "else"}


def trail(model: Model, flag: str) -> str:
    """The shortest counterexample of a weaker variant: one line per step of ``spin -t -p``.

    Each line is the step number, the process (in lease.pml pid 0 ``:init:`` is the clock and
    the server's restart, pids 1 and 2 are clients 0 and 1) and the statements of that step.
    """
    with tempfile.TemporaryDirectory(prefix="asynclock-models-") as tmp:
        work = Path(tmp)
        _compile(model, flag, work, extra=("-DBFS",))
        _run(["./pan", *PAN_ARGS], work)
        out = _run(["spin", f"-D{flag}", "-t", "-p", "-k", f"{model.file}.trail", model.file], work)
    steps: dict[tuple[str, str], list[str]] = {}
    step_line = re.compile(r"\s*(\d+):\s+proc\s+(\d+) \((.*?)\) \S+ \(state \d+\)\s*\[(.*)\]\s*$")
    for line in out.splitlines():
        found = step_line.match(line)
        if found is None:
            continue
        number, pid, name, statement = found.groups()
        if statement not in _NOISE:
            steps.setdefault((number, f"pid {pid} {name}"), []).append(statement)
    lines = [f"{number:>3} {who}: {'; '.join(stmts)}" for (number, who), stmts in steps.items()]
    violated = re.search(r"(assertion violated.*)", out)
    if violated:
        lines.append(violated.group(1))
    return "\n".join(lines)


def check_all() -> list[Result]:
    results = []
    for model in MODELS:
        results.append(check(model, None))
        results.extend(check(model, flag) for flag, _ in model.weaker)
    return results


def table(results: list[Result]) -> str:
    rows = [("model", "variant", "errors", "states", "depth", "seconds", "verdict", "violated")]
    for r in results:
        verdict = "ok" if r.ok else ("UNEXPECTED: passes" if r.expected_errors else "FAILS")
        rows.append(
            (r.model, r.variant, str(r.errors), str(r.states), str(r.depth), f"{r.seconds:g}",
             verdict, r.violated[:60])
        )  # fmt: skip
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in rows
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--trail", action="store_true", help="print each counterexample too")
    args = parser.parse_args(argv)
    missing = tools_missing()
    if missing:
        why = "the Debian packages spin and gcc; .ci/run installs them"
        print(f"missing: {', '.join(missing)} ({why})", file=sys.stderr)
        return 2
    results = check_all()
    print(table(results))
    if args.trail:
        for model in MODELS:
            for flag, what in model.weaker:
                print(f"\n== {model.file} -D{flag} ({what}): the shortest counterexample")
                print(trail(model, flag))
    bad = [r for r in results if not r.ok]
    for r in bad:
        what = "no violation found" if r.expected_errors else f"violated {r.violated}"
        print(f"\n{r.model} {r.variant}: {what}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
