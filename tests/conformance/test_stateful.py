"""A Hypothesis state machine drives a real backend and checks it against a simple model.

Model per name: the live lease (or None) and the last token handed out. Leases use a long
ttl so time never decides the outcome; loss is injected with ``force_loss``. ``holder()``,
``extend()`` and ``break_lock()`` are steps too (a break keeps tokens rising: G2).
"""

from __future__ import annotations

import uuid
from contextlib import ExitStack
from typing import Any

import anyio.from_thread
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    rule,
    run_state_machine_as_test,
)

import asynclock
import asynclock.testing
from tests.support.spec import BackendSpec

NAMES = ("a", "b", "c")


class LockMachine(RuleBasedStateMachine):
    spec: BackendSpec
    leases = Bundle("leases")

    def __init__(self) -> None:
        super().__init__()
        self.stack = ExitStack()
        self.portal = self.stack.enter_context(anyio.from_thread.start_blocking_portal())
        self.backend: asynclock.Backend = self.stack.enter_context(
            self.portal.wrap_async_context_manager(self.spec.connect())
        )
        self.prefix = uuid.uuid4().hex[:8]
        # name -> (live lease or None, server-side holder or None, last token)
        self.live: dict[str, asynclock.Lease | None] = dict.fromkeys(NAMES)
        self.server_holder: dict[str, asynclock.Lease | None] = dict.fromkeys(NAMES)
        self.last_token: dict[str, int] = dict.fromkeys(NAMES, 0)

    def teardown(self) -> None:
        self.stack.close()

    def key(self, name: str) -> str:
        return f"stateful:{self.prefix}:{name}"

    def call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        return self.portal.call(lambda: fn(*args, **kwargs))

    @rule(target=leases, name=st.sampled_from(NAMES))
    def acquire(self, name: str) -> Any:
        if self.server_holder[name] is not None:
            with pytest.raises(asynclock.LockHeld):
                self.call(self.backend.acquire, self.key(name), ttl=60.0, blocking=False)
            return None
        lease = self.call(self.backend.acquire, self.key(name), ttl=60.0, blocking=False)
        assert lease.token > self.last_token[name]
        self.last_token[name] = lease.token
        self.live[name] = self.server_holder[name] = lease
        return (name, lease)

    @rule(item=consumes(leases))
    def release(self, item: Any) -> None:
        if item is None:
            return
        name, lease = item
        expected = self.live[name] is lease
        assert self.call(lease.release) is expected
        if self.server_holder[name] is lease:
            self.server_holder[name] = None
        if self.live[name] is lease:
            self.live[name] = None

    @rule(item=leases)
    def lose(self, item: Any) -> None:
        if item is None:
            return
        name, lease = item
        asynclock.testing.force_loss(lease, "model")
        if self.live[name] is lease:
            self.live[name] = None  # still held at the server until released or expired

    @rule(name=st.sampled_from(NAMES), delta=st.integers(-1, 1))
    def validate(self, name: str, delta: int) -> None:
        token = self.last_token[name] + delta
        if token <= 0:
            return
        holder = self.server_holder[name]
        expected = holder is not None and holder.token == token
        assert self.call(self.backend.validate, self.key(name), token) is expected

    @rule(name=st.sampled_from(NAMES))
    def holder(self, name: str) -> None:
        holder = self.call(self.backend.holder, self.key(name))
        lease = self.server_holder[name]
        if lease is None:
            assert holder is None
        else:
            assert holder is not None
            assert (holder.owner, holder.token) == (lease.owner, lease.token)
        assert self.call(self.backend.locked, self.key(name)) is (lease is not None)

    @rule(item=leases)
    def extend(self, item: Any) -> None:
        if item is None:
            return
        name, lease = item
        live = self.live[name]
        if live is not None and live is lease:
            self.call(live.extend, 60.0)
        else:
            with pytest.raises(asynclock.LeaseLost):
                self.call(lease.extend, 60.0)

    @rule(name=st.sampled_from(NAMES))
    def break_lock(self, name: str) -> None:
        held = self.server_holder[name] is not None
        assert self.call(self.backend.break_lock, self.key(name)) is held
        lease = self.live[name]
        if lease is not None:
            assert lease.lost  # a holder on this backend loses it at once
        self.live[name] = self.server_holder[name] = None

    @invariant()
    def held_matches_model(self) -> None:
        held = {lease.owner for lease in self.backend.held()}
        assert held == {lease.owner for lease in self.live.values() if lease is not None}


@pytest.mark.timeout(120)
def test_lock_matches_model(spec: BackendSpec) -> None:
    machine = type(f"LockMachine_{spec.id}", (LockMachine,), {"spec": spec})
    run_state_machine_as_test(
        machine,
        settings=settings(
            max_examples=15,
            stateful_step_count=25,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )
