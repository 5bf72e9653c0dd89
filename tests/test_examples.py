"""Every example runs, as a user would run it, and says what it promises."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.redis_servers import DeploymentFactory
from tests.support.zk_servers import ZkEnsemble

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"


def run(name: str, *args: str) -> str:
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / name), *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_basic() -> None:
    out = run("basic.py")
    assert "holding 'report:daily' with token 1" in out
    assert "token 2 (always larger)" in out
    assert "second holder refused" in out


def test_basic_on_zookeeper(zk_ensemble: ZkEnsemble) -> None:
    out = run("basic.py", zk_ensemble.url)
    first, again = (int(line.split("token ")[1].split()[0]) for line in out.splitlines()[:2])
    assert out.startswith("holding 'report:daily' with token ")
    assert again > first  # czxids: ensemble-wide, so not 1 and 2
    assert "second holder refused" in out


def test_fencing() -> None:
    out = run("fencing.py")
    assert "late write rejected" in out
    assert "ledger: token 2: second holder" in out
    ledger = [line for line in out.splitlines() if line.startswith("ledger:")]
    assert ledger == ["ledger: token 1: first holder, on time", "ledger: token 2: second holder"]


def test_stuck_holder() -> None:
    out = run("stuck_holder.py")
    assert "held by token 1" in out
    assert "broken: True" in out
    assert "stuck run stopped: renewal refused" in out
    assert "next run got token 2 (larger" in out
    assert "still locked: False" in out


def test_leadership() -> None:
    out = run("leadership.py")
    assert out.splitlines() == [
        "node-a leads with token 1",
        "operator breaks the lock: True",
        "node-a lost its term (token 1): renewal refused: lease row gone or taken over",
        "node-a campaigns again",
        "node-a leads with token 2",
        "node-a leads again with token 2 (larger than 1)",
    ]


def test_idempotency() -> None:
    out = run("idempotency.py")
    assert out.splitlines() == [
        "first: rcpt-1; retry: rcpt-1; charges: 1",
        "other amount refused: idempotency key 'pay:o-1' was used before with different "
        "arguments (another fingerprint); use a new key for a different request",
        "replacement ran with token 2 and saved",
        "late save rejected: stale fencing token 1 for 'pay:o-2'; nothing was written",
        "stalled executor stopped: pretend a long pause",
        "stored for o-2: rcpt-2 (token 2)",
    ]


def test_idempotency_beyond_keep() -> None:
    out = run("idempotency_beyond_keep.py")
    assert out.splitlines() == [
        "first: sent; a retry within keep: replayed",
        "a duplicate after keep: sent before (unique constraint)",
        "invoices sent: 1",
    ]


def test_from_thread() -> None:
    out = run("from_thread.py")
    assert out.splitlines() == [
        "report:7 held with token 1",
        "charge: rcpt-1, again: rcpt-1; charges: 1",
        "job stopped: claim taken over",
    ]


def test_lock_all() -> None:
    out = run("lock_all.py")
    assert out.splitlines() == [
        "20 transfers in opposite directions finished: no deadlock",
        "balances: alice=100 bob=100 (total 200)",
        "busy: 'acct:bob'; alice left free: True",
        "lost 'acct:bob': renewal refused (simulated); body cancelled",
        "both free again: True",
    ]


def test_efficiency_lock() -> None:
    out = run("efficiency_lock.py")
    assert out.splitlines() == [
        "worker-a rebuilds the report",
        "worker-b skips: another worker is rebuilding it",
        "worker-c skips: another worker is rebuilding it",
        "rebuilds: 1 (3 workers asked)",
        "worker-a stalls past its ttl; its lease is lost: pretend a long pause",
        "worker-b rebuilds the report",
        "worker-a finishes its rebuild late",
        "rebuilds: 3; the report is whole: True",
    ]


def test_partitioned_outbox() -> None:
    out = run("partitioned_outbox.py")
    assert out.splitlines() == [
        "worker-a left the group midway",
        "applied 200 events of 40 entities, each in order once: True",
        "worker-a's partitions taken over by the others: True",
        "a write with worker-a's old partition token is refused: StaleToken",
    ]


def test_decide_page_points_to_examples_that_exist_and_run() -> None:
    """docs/decide.md gives each branch of the rule an example; each one is a file here
    and is run by a test (test_every_example_has_a_test covers the second part)."""
    import re

    page = (ROOT / "docs" / "decide.md").read_text()
    named = set(re.findall(r"examples/(\w+\.py)", page))
    assert {
        "efficiency_lock.py",
        "fencing.py",
        "idempotency.py",
        "claims_queue.py",
        "leadership.py",
        "partitioned_outbox.py",
    } <= named
    for name in named:
        assert (EXAMPLES / name).is_file(), name


def test_apscheduler_cluster() -> None:
    out = run("apscheduler_cluster.py")
    summary = out.splitlines()[-1]
    assert "each once: True; tokens rise: True" in summary, out
    assert int(summary.split()[0]) >= 2, out  # ran for a few one-second occurrences


@pytest.mark.parametrize("example", sorted(p.name for p in EXAMPLES.glob("*.py")))
def test_every_example_has_a_test(example: str) -> None:
    tested = Path(__file__).read_text() + "".join(
        p.read_text() for p in Path(__file__).parent.rglob("test_*.py")
    )
    assert f'"{example}"' in tested, f"examples/{example} is not run by any test"


def readme_python_blocks() -> list[str]:
    text = (ROOT / "README.md").read_text()
    return [block.split("```", 1)[0] for block in text.split("```python\n")[1:]]


def test_readme_snippets_compile() -> None:
    import ast

    blocks = readme_python_blocks()
    assert len(blocks) >= 3
    for block in blocks:  # the first one uses `async with` at the top, as a REPL would
        compile(block, "README.md", "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)


# Run after each README snippet, in a fresh interpreter: the objects it defines are what
# the text says (no server is contacted: a Celery app and a Locks connect only when used).
README_CHECKS = {
    "asynclock_celery": """
from asynclock_celery import LockedTask
app.finalize()  # checks the lock template against the task's parameters
task = app.tasks[build_report.name]
assert isinstance(task, LockedTask) and task.lock == "report:{customer_id}", task
assert task.lock_ttl == 30
print("celery snippet ok")
""",
    "asynclock_fastapi": """
from asynclock_fastapi import guard_info
[route] = [r for r in app.routes if getattr(r, "path", "") == "/accounts/{account_id}/rebuild"]
info = guard_info(route.endpoint)
assert info is not None and info.ttl == 10 and info.template.template == "account:{account_id}"
print("fastapi snippet ok")
""",
}


@pytest.mark.parametrize("package", sorted(README_CHECKS))
def test_readme_integration_snippets_define_what_they_say(package: str, tmp_path: Path) -> None:
    [block] = [b for b in readme_python_blocks() if f"from {package} import" in b]
    script = tmp_path / "snippet.py"
    script.write_text(block + README_CHECKS[package])
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().endswith("snippet ok")


def test_the_first_pages_a_user_reads_present_the_integrations_that_ship() -> None:
    """They ship in the wheel; the quickstart once called them "planned"."""
    shipped = sorted(p.name for p in (ROOT / "integrations").glob("asynclock_*"))
    assert {"asynclock_celery", "asynclock_fastapi", "asynclock_apscheduler"} <= set(shipped)
    quickstart = (ROOT / "docs" / "quickstart.md").read_text()
    assert "planned" not in quickstart
    for page in ("quickstart.md", "index.md"):
        text = (ROOT / "docs" / page).read_text()
        for name in ("celery", "fastapi", "apscheduler"):
            assert f"(integrations/{name}.md)" in text, (page, name)
    readme = (ROOT / "README.md").read_text()
    for package in ("asynclock_celery", "asynclock_fastapi", "asynclock_apscheduler"):
        assert package in readme, package


def test_otel_metrics() -> None:
    out = run("otel_metrics.py")
    assert "second holder refused (busy)" in out
    assert out.count("span 'acquire invoice:*': result=acquired") == 3
    assert "span 'acquire invoice:*': result=busy" in out
    assert "asynclock.result=busy} count=1" in out
    assert "asynclock.lease.duration{" in out and "invoice:42" not in out.split("busy)")[1]


def test_advice() -> None:
    out = run("advice.py")
    assert "before any hold: max_hold: not enough samples: 0 of 100 holds of 'report:*'" in out
    assert "advice for 'report:*': max_hold=" in out
    assert "from 120 holds and 25 renewal rounds" in out
    assert "5 x p99 hold" in out and "Hold time does not matter" in out
    advised = out.split("advice for 'report:*': ")[1].split(" from")[0]
    served = out.split("over HTTP: ")[1].splitlines()[0]
    assert advised == served  # the same numbers, read over HTTP
    assert "over HTTP: 121 leases acquired" in out


def test_redis_failover(deployment_factory: DeploymentFactory) -> None:
    deployment = deployment_factory.sentinel(replicas=2)
    out = run("redis_failover.py", deployment.url)
    assert out.splitlines() == [
        "holding 'report:nightly'",
        "lost in the failover: True",
        "next holder's token is larger: True",
    ]


def test_rwlock() -> None:
    out = run("rwlock.py")
    assert out.splitlines() == [
        "3 readers held the catalog at once",
        "a writer was refused while a reader held it",
        "the writer rebuilt the catalog alone: epoch 1 > 0",
        "a reader after the write sees epoch 1: True",
    ]


def test_semaphore() -> None:
    out = run("semaphore.py")
    assert out.count("on gpu slot") == 6
    assert "at most 2 jobs ran at once (limit 2)" in out
    assert "a third permit was refused while two were held" in out
    slots = {line.split("slot ")[1].split()[0] for line in out.splitlines() if "gpu slot" in line}
    assert slots == {"0", "1"}
