# Celery ships no type information, so its decorators are untyped.
# mypy: disable-error-code="untyped-decorator"
"""asynclock_celery without a worker: definition-time checks, argument checks, eager runs."""

from __future__ import annotations

import asyncio
import inspect
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import anyio
import pytest
import redis
from celery import Celery

import asynclock
from asynclock.backends.redis import keys_for
from asynclock_celery import LockedTask, locked
from asynclock_celery.testing import force_loss, run_eagerly
from tests.integrations import celery_tasks as tasks
from tests.support.celery_worker import celery_redis, redis_db  # noqa: F401  (fixture)
from tests.support.redis_servers import RedisServer


def make_app(**conf: Any) -> Celery:
    app = Celery("t", broker=conf.pop("broker", "memory://"), backend="cache+memory://")
    app.conf.update(conf)
    return app


def test_bad_template_is_a_type_error_at_definition() -> None:
    app = make_app()

    def build(customer_id: int) -> None: ...

    with pytest.raises(TypeError, match=r"uses customer, which task .*build\(\) does not take"):
        app.task(base=LockedTask, lock="report:{customer}", lazy=False)(build)
    with pytest.raises(TypeError, match=r"uses customer, which .*build\(\) does not take"):
        locked("report:{customer}")(build)
    with pytest.raises(ValueError, match="positional field"):
        locked("report:{}")(build)


def test_bad_options_are_refused_at_definition() -> None:
    app = make_app()

    def build(customer_id: int) -> None: ...

    with pytest.raises(ValueError, match="on_busy must be one of 'wait', 'retry', 'skip', 'fail'"):
        app.task(base=LockedTask, lock="r:{customer_id}", on_busy="later", lazy=False)(build)
    with pytest.raises(ValueError, match="lock_ttl must be a finite number of seconds > 0"):
        app.task(base=LockedTask, lock="r:{customer_id}", lock_ttl=0, lazy=False)(build)
    with pytest.raises(TypeError, match="ttl must be a number of seconds, not str"):
        locked("r:{customer_id}", ttl="5")  # type: ignore[arg-type]


TOO_LONG = 2 * asynclock.MAX_TTL


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({"lock_ttl": 0.001}, ValueError, r"lock_ttl=0.001s leaves no time .* at least 0.011s"),
        ({"lock_ttl": TOO_LONG}, ValueError, r"lock_ttl must be at most 604800 seconds"),
        ({"lock_ttl": float("nan")}, ValueError, "lock_ttl must be a number of seconds, not NaN"),
        ({"lock_ttl": True}, TypeError, "lock_ttl must be a number of seconds, not bool"),
        ({"lock_timeout": -1}, ValueError, r"lock_timeout must be None \(wait as long as"),
        ({"lock_timeout": "5"}, TypeError, "lock_timeout must be a number of seconds, not str"),
        (
            {"lock_timeout": 5, "on_busy": "retry"},
            ValueError,
            "lock_timeout bounds the wait of on_busy='wait'; with on_busy='retry' nothing waits",
        ),
        ({"lock_retry_backoff": 0}, ValueError, "lock_retry_backoff must be a finite number"),
        (
            {"lock_retry_backoff": 10, "lock_retry_backoff_max": 5},
            ValueError,
            r"lock_retry_backoff_max \(5s\) must be at least lock_retry_backoff \(10s\)",
        ),
    ],
)
def test_lease_options_are_checked_where_the_task_is_declared(
    options: dict[str, Any], error: type[Exception], message: str
) -> None:
    """Issue 21 item 6: what every run would refuse is refused when the task is made (before:
    lock_ttl=0.001 or 2 * MAX_TTL were accepted and every run failed)."""
    app = make_app(asynclock_url="memory://")

    def build(customer_id: int) -> None: ...

    with pytest.raises(error, match=message):
        app.task(base=LockedTask, lock="r:{customer_id}", lazy=False, **options)(build)


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({"ttl": 0.001}, ValueError, r"ttl=0.001s leaves no time .* at least 0.011s"),
        ({"ttl": TOO_LONG}, ValueError, r"ttl must be at most 604800 seconds \(7 days\)"),
        ({"ttl": -1}, ValueError, "ttl must be a finite number of seconds > 0, got -1"),
        ({"on_busy": "later"}, ValueError, "on_busy must be one of 'wait', 'retry'"),
        ({"timeout": float("inf")}, ValueError, r"timeout must be None \(wait as long as"),
        ({"timeout": 1, "on_busy": "skip"}, ValueError, "timeout bounds the wait of on_busy="),
        ({"retry_backoff": "1"}, TypeError, "retry_backoff must be a number of seconds"),
    ],
)
def test_locked_options_are_checked_at_decoration(
    options: dict[str, Any], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        locked("r:{customer_id}", **options)


def test_the_longest_and_shortest_allowed_ttls_run() -> None:
    """The limits are the core's: a ttl the declaration accepts, every run accepts."""
    app = make_app(asynclock_url="memory://")
    for ttl in (0.011, asynclock.MAX_TTL):

        @app.task(
            bind=True, base=LockedTask, lock="edge:{n}", lock_ttl=ttl, name=f"edge{ttl}", lazy=False
        )
        def edge(self: LockedTask, n: int) -> float:
            return float(self.lease.ttl)

        @app.task(name=f"edge-fn{ttl}", lazy=False)
        @locked("edge-fn:{n}", ttl=ttl)
        def edge_fn(n: int) -> float:
            return float(asynclock.current_lease().ttl)

        assert edge.apply((1,), throw=True).get() == ttl
        assert edge_fn.apply((1,), throw=True).get() == ttl


def test_delay_with_wrong_arguments_is_rejected_before_sending() -> None:
    with pytest.raises(TypeError):
        tasks.report.delay(1, "eu", "extra")
    with pytest.raises(TypeError):
        tasks.report.delay(region="eu")  # customer_id missing
    # @locked keeps the signature, so Celery's check still sees the real parameters.
    assert list(inspect.signature(tasks.plain_locked.run).parameters) == ["key", "extra"]
    with pytest.raises(TypeError):
        tasks.plain_locked.delay("k", 1, 2)
    with pytest.raises(TypeError):
        tasks.plain_locked.delay(nope=1)


def test_missing_celery_names_the_extra() -> None:
    code = "import sys; sys.modules['celery'] = None; import asynclock_celery"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert 'pip install "asynclock[celery]"' in proc.stderr


def test_backend_is_the_setting_else_a_redis_broker_else_an_error() -> None:
    app = make_app(broker="amqp://guest@127.0.0.1:1//")

    @app.task(base=LockedTask, lock="x:{n}", lazy=False)
    def task(n: int) -> int:
        return n

    with pytest.raises(RuntimeError, match="set the Celery setting 'asynclock_url'") as info:
        task.apply((1,), throw=True)
    assert "guest" not in str(info.value)  # the broker URL is not shown
    app.conf.asynclock_url = "memory://"
    assert task.apply((1,), throw=True).get() == 1


def test_a_redis_broker_is_the_default_lock_server(celery_redis: RedisServer) -> None:  # noqa: F811
    broker = redis_db(celery_redis, 5)
    app = make_app(broker=broker)

    async def first_use() -> None:
        # A database that never held a lock grants none for restart_grace (default: the
        # ttl asked for) after its first use, in case it lost its data: wait that out.
        async with asynclock.connect(broker) as backend:
            async with backend.lock("warm-up", ttl=1.0, timeout=30):
                pass

    anyio.run(first_use)

    @app.task(bind=True, base=LockedTask, lock="brokered:{n}", lock_ttl=1.0, lazy=False)
    def task(self: LockedTask, n: int) -> bool:
        return bool(redis.Redis.from_url(broker).exists(keys_for(self.lease.name).lock))

    assert task.apply((1,), throw=True).get() is True  # the lease lives in the broker's Redis


def test_eager_run_holds_a_real_lease() -> None:
    result = run_eagerly(tasks.report, (5,), {"region": "ap"}, throw=True)
    assert result.get() == "report:5:ap"
    name, token = run_eagerly(tasks.async_account, (9,), throw=True).get()
    assert name == "async:9" and token >= 1
    assert run_eagerly(tasks.plain_locked, ("z",), throw=True).get() == "second:z:0"


def test_lock_name_from_every_way_of_passing_arguments() -> None:
    """The name is formatted without inspect per call when the call fits the signature
    plainly; every other call gets the name (or the TypeError) of a full bind."""
    app = make_app()

    @app.task(bind=True, base=LockedTask, lock="n:{a}:{b}:{c}", lazy=False)
    def named(self: LockedTask, a: int, b: str = "B", *, c: int = 3) -> str:
        return str(self.lease.name)

    @app.task(lazy=False)
    @locked("k:{a}:{tag}")
    def loose(a: int, **extra: Any) -> str:
        return str(asynclock.current_lease().name)

    def name(task: Any, *args: Any, **kwargs: Any) -> str:
        return str(run_eagerly(task, args, kwargs, throw=True).get())

    assert name(named, 1) == "n:1:B:3"
    assert name(named, 1, "x") == "n:1:x:3"
    assert name(named, 1, c=9) == "n:1:B:9"
    assert name(named, a=2, b="y", c=0) == "n:2:y:0"
    assert name(named, 3, b="z") == "n:3:z:3"
    assert name(loose, 4, tag="t") == "k:4:t"
    assert name(loose, a=5, tag="u", more=1) == "k:5:u"
    bad: list[tuple[tuple[Any, ...], dict[str, Any]]] = [
        ((), {}),  # a is missing
        ((1, "x", 3), {}),  # c is keyword-only
        ((1,), {"a": 1}),  # a twice
        ((1,), {"d": 4}),  # no parameter d
    ]
    for args, kwargs in bad:
        with pytest.raises(TypeError):
            name(named, *args, **kwargs)
    with pytest.raises(TypeError, match="needs argument 'tag'"):
        name(loose, 6)


def test_loss_in_a_non_main_thread_interrupts_a_python_loop() -> None:
    """The threads pool: PyThreadState_SetAsyncExc raises LeaseLost at the next bytecode."""
    app = make_app(asynclock_url="memory://")
    seen: dict[str, Any] = {}

    @app.task(bind=True, base=LockedTask, lock="loop:{n}", lazy=False)
    def spin(self: LockedTask, n: int) -> str:
        deadline = time.monotonic() + 30
        try:
            force_loss(self.lease, "sabotaged")
            while time.monotonic() < deadline:  # pure Python: interrupted between bytecodes
                pass
        except asynclock.LeaseLost as lost:
            seen["reason"] = lost.reason
            seen["thread"] = threading.current_thread() is threading.main_thread()
        return "swallowed"

    outcome: list[Any] = []
    thread = threading.Thread(target=lambda: outcome.append(spin.apply((1,))))
    thread.start()
    thread.join(30)
    assert not thread.is_alive()
    assert seen == {"reason": "sabotaged", "thread": False}
    (result,) = outcome
    assert result.state == "FAILURE"
    assert isinstance(result.result, asynclock.LeaseLost)


def _block_in(call: str) -> None:
    if call == "time.sleep":
        time.sleep(30)
    elif call == "Event.wait":
        threading.Event().wait(30)
    elif call == "socket.recv":
        left, right = socket.socketpair()
        with left, right:
            left.recv(1)
    elif call == "subprocess.run":
        subprocess.run(["sleep", "30"], check=False)
    else:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            pass


@pytest.mark.parametrize(
    "call", ["time.sleep", "Event.wait", "socket.recv", "subprocess.run", "python loop"]
)
def test_loss_on_the_main_thread_interrupts_a_blocking_call(call: str) -> None:
    """The prefork/solo path (SIGUSR2 to the main thread), here in the test's main thread."""
    app = make_app(asynclock_url="memory://")

    @app.task(bind=True, base=LockedTask, lock="block:{n}", lazy=False)
    def block(self: LockedTask, n: int) -> None:
        # Lost from another thread a little later, so (on any machine not too loaded) the
        # loss lands while the body is inside the call; the run ends within 5 s either way.
        threading.Timer(0.2, force_loss, (self.lease, "sabotaged")).start()
        _block_in(call)

    started = time.monotonic()
    result = block.apply((1,))
    assert time.monotonic() - started < 5
    assert result.state == "FAILURE"
    assert isinstance(result.result, asynclock.LeaseLost)
    assert result.result.reason == "sabotaged"


def test_async_tasks_share_one_event_loop_per_thread() -> None:
    """Module-level async clients survive across runs: one asyncio.Runner per thread."""
    app = make_app(asynclock_url="memory://")

    @app.task(base=LockedTask, lock="loop:{n}", lazy=False)
    async def which_loop(n: int) -> int:
        return id(asyncio.get_running_loop())

    first = which_loop.apply((1,), throw=True).get()
    assert which_loop.apply((2,), throw=True).get() == first


def test_default_lock_name_is_the_task_name() -> None:
    app = make_app(asynclock_url="memory://")

    @app.task(bind=True, base=LockedTask, name="jobs.nightly", lazy=False)
    def nightly(self: LockedTask) -> str:
        return str(self.lease.name)

    assert nightly.apply(throw=True).get() == "jobs.nightly"


def test_lease_outside_a_run_is_a_lookup_error() -> None:
    with pytest.raises(LookupError, match="holds no asynclock lease outside a run"):
        _ = tasks.report.lease


def test_example_celery_app() -> None:
    example = Path(__file__).resolve().parents[2] / "examples" / "celery_app.py"
    done = subprocess.run(
        [sys.executable, str(example)], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    assert "holding 'acct:7' with fencing token 1" in done.stdout
    assert "holding 'acct:7' with fencing token 2" in done.stdout
    assert "interrupted(7) ended FAILURE: LeaseLost" in done.stdout
    ledger = [line for line in done.stdout.splitlines() if line.startswith("ledger:")]
    assert ledger == [
        "ledger: account 7, token 1: first sync",
        "ledger: account 7, token 2: second sync",
    ]
    assert "lease lost" in done.stderr  # logged at WARNING, with the reason


def test_public_api_of_the_package() -> None:
    import asynclock_celery
    import asynclock_celery.testing

    assert asynclock_celery.__all__ == ("ON_BUSY", "LockedTask", "close_runtime", "locked")
    assert asynclock_celery.testing.__all__ == ("force_loss", "run_eagerly")
    for module in (asynclock_celery, asynclock_celery.testing):
        for name in module.__all__:
            assert hasattr(module, name), name
    # Integrations stand on the public asynclock API only (docs/integrations/).
    package = Path(asynclock_celery.__file__).parent
    for source in package.glob("*.py"):
        assert "asynclock._" not in source.read_text(), source.name


def test_the_celery_extra_brings_what_the_docs_redis_setup_needs() -> None:
    """Issue 21 item 8: the docs run the worker on a Redis broker and keep the locks in
    Redis. kombu's Redis transport needs celery[redis] (without it the worker died at
    start: No module named 'packaging'), the lock backend needs redis-py."""
    import tomllib

    from packaging.requirements import Requirement

    root = Path(__file__).resolve().parents[2]
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    celery_extra = [Requirement(r) for r in extras["celery"]]
    assert any(r.name == "celery" and "redis" in r.extras for r in celery_extra), celery_extra
    brings = {r.name for r in celery_extra} | {
        Requirement(r).name
        for e in (x for x in celery_extra if x.name == "asynclock")
        for extra in e.extras
        for r in extras[extra]
    }
    assert "redis" in brings, celery_extra
    docs = (root / "docs" / "integrations" / "celery.md").read_text()
    assert 'pip install "asynclock[celery]"' in docs
    assert "redis://" in docs  # the story the extra is made for


def test_wait_gives_up_after_lock_timeout_and_gets_the_lock_when_freed(tmp_path: Path) -> None:
    """on_busy="wait" (the default): a run waits for a held lock, gets it as soon as it is
    released, and fails with AcquireTimeout once lock_timeout has passed."""
    url = f"sqlite:///{tmp_path / 'locks.db'}"
    app = make_app(asynclock_url=url)

    @app.task(bind=True, base=LockedTask, lock="w:{n}", lock_ttl=5, lock_timeout=0.3, lazy=False)
    def bounded(self: LockedTask, n: int) -> int:
        return int(self.lease.token)

    @app.task(bind=True, base=LockedTask, lock="w:{n}", lock_ttl=5, lazy=False)
    def patient(self: LockedTask, n: int) -> int:
        return int(self.lease.token)

    holding, free = threading.Event(), threading.Event()

    async def hold() -> int:
        async with asynclock.connect(url) as backend:
            async with backend.lock("w:1", ttl=5) as lease:
                holding.set()
                await anyio.to_thread.run_sync(free.wait)
        return lease.token

    tokens: list[int] = []
    holder = threading.Thread(target=lambda: tokens.append(anyio.run(hold)))
    holder.start()
    try:
        assert holding.wait(30)
        result = bounded.apply((1,))
        assert result.state == "FAILURE"
        assert isinstance(result.result, asynclock.AcquireTimeout), repr(result.result)
        assert result.result.timeout == 0.3
        threading.Timer(0.2, free.set).start()  # released while `patient` waits
        token = patient.apply((1,), throw=True).get()
    finally:
        free.set()
        holder.join(30)
    assert token > tokens[0]


def test_retry_countdown_is_exponential_backoff_with_jitter() -> None:
    """on_busy="retry": retry n counts down between half and all of min(backoff * 2**n, max),
    whatever the holder's ttl (before: the holder's remaining ttl, so retries bunched)."""
    from asynclock_celery._policy import Policy

    policy = Policy(ttl=6.0, on_busy="retry", backoff=1.0, backoff_max=60.0)
    for retries, step in [(0, 1.0), (1, 2.0), (3, 8.0), (6, 60.0), (10_000, 60.0)]:
        countdowns = {policy.countdown(retries) for _ in range(200)}
        assert all(step / 2 <= c <= step for c in countdowns), (retries, countdowns)
        assert len(countdowns) > 100  # spread out, not one value for every run


def test_the_private_celery_api_locked_task_uses_is_still_there() -> None:
    """``LockedTask.__call__`` (asynclock_celery/_task.py) tells a worker's run from a
    direct call with ``celery._state.get_current_task()`` and, for a direct call, pushes
    the task on ``celery._state._task_stack`` as ``Task.__call__`` does. Both are private:
    this pins them, so a Celery release that changes them fails here, not in production."""
    from celery import _state

    assert callable(_state.get_current_task)
    assert callable(_state._task_stack.push) and callable(_state._task_stack.pop)
    app = make_app(task_always_eager=True)
    seen: list[object] = []

    @app.task(bind=True)
    def plain(self: Any) -> None:
        seen.append(_state.get_current_task() is self)

    plain()  # Celery's own direct call pushes the task where get_current_task finds it
    plain.apply()
    assert seen == [True, True]
    _state._task_stack.push(plain)
    try:
        assert _state.get_current_task() is plain
    finally:
        _state._task_stack.pop()
    assert _state.get_current_task() is None


def test_the_runs_span_carries_its_token_and_template() -> None:
    """With OpenTelemetry, the span current while a locked task runs (the one Celery's
    instrumentation opens; here the test's own) gets the lease's fencing token and the
    lock's name template (never the raw name)."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("test")
    with tracer.start_as_current_span("run report"):
        assert run_eagerly(tasks.report, (5,), {"region": "ap"}, throw=True).get() == "report:5:ap"
    app = make_app()

    @app.task(base=LockedTask, idempotent=True, idempotency_key="span:{n}", lock_ttl=5)
    def once(n: int) -> int:
        return n

    with tracer.start_as_current_span("run idempotent"):
        assert run_eagerly(once, (7,), throw=True).get() == 7
    (run, idempotent) = exporter.get_finished_spans()
    attributes = dict(run.attributes or {})
    assert attributes["asynclock.lock.name_template"] == "report:{customer_id}:{region}"
    assert isinstance(attributes["asynclock.lease.token"], int)
    assert attributes["asynclock.lease.token"] >= 1
    assert "report:5:ap" not in str(attributes)
    attributes = dict(idempotent.attributes or {})
    assert attributes["asynclock.lock.name_template"] == "span:{n}"
    assert isinstance(attributes["asynclock.lease.token"], int)
