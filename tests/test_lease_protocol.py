"""The lease protocol (asynclock/_core/lease.py's table): each field of a Lease has one
writer. Reads the package and the integrations and fails on a write anywhere else."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: Field -> the modules allowed to write it.
OWNERS = {
    "_released": {"asynclock/_core/session.py"},
    "_deadline": {"asynclock/_core/session.py"},
    "_grantor": {"asynclock/_core/session.py"},
    "_keeper": {"asynclock/_core/session.py"},
    # The holder's scope and task: context.py, for every kind of hold (new_lease: None).
    "_scope": {"asynclock/_core/context.py", "asynclock/_core/session.py"},
    "_task": {"asynclock/_core/context.py", "asynclock/_core/session.py"},
}
#: Public fields, written only by the session (checked where the receiver is a lease).
PUBLIC = {"name", "owner", "token", "ttl", "acquired_at", "hard_deadline", "lost"}


def writes(path: Path) -> list[tuple[str, str, int]]:
    """(receiver, field, line) of every attribute assignment in ``path`` not on ``self``."""
    found: list[tuple[str, str, int]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        while targets:
            target = targets.pop()
            if isinstance(target, ast.Tuple | ast.List | ast.Starred):
                targets.extend(
                    target.elts if not isinstance(target, ast.Starred) else [target.value]
                )
            elif isinstance(target, ast.Attribute):
                receiver = ast.unparse(target.value)
                if receiver != "self":
                    found.append((receiver, target.attr, target.lineno))
    return found


def test_every_lease_field_is_written_only_by_its_owner() -> None:
    stray: list[str] = []
    files = [
        *ROOT.joinpath("asynclock").rglob("*.py"),
        *ROOT.joinpath("integrations").rglob("*.py"),
    ]
    assert len(files) > 100
    for path in files:
        module = str(path.relative_to(ROOT))
        for receiver, field, line in writes(path):
            owners = OWNERS.get(field)
            if owners is not None and module not in owners:
                stray.append(f"{module}:{line}: {receiver}.{field} (owner: {sorted(owners)})")
            elif (
                field in PUBLIC
                and "lease" in receiver.lower()
                and module != "asynclock/_core/session.py"
            ):
                stray.append(f"{module}:{line}: {receiver}.{field} (owner: the session)")
    assert not stray, "lease fields written outside their owner:\n" + "\n".join(stray)


def test_the_check_sees_a_stray_write(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text("def f(lease):\n    lease._released = True\n    self_x = 1\n")
    assert ("lease", "_released", 2) in writes(sample)


def private_reads(path: Path) -> list[tuple[str, str, int]]:
    """(receiver, field, line) of every read of a private attribute of something named
    like a backend (``backend._acq``, ``self.backend._session``) in ``path``."""
    found: list[tuple[str, str, int]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_"):
            receiver = ast.unparse(node.value)
            last = receiver.rsplit(".", 1)[-1]
            if "backend" in last.lower() and not node.attr.startswith("__"):
                found.append((receiver, node.attr, node.lineno))
    return found


#: The Backend's private methods that are doors for asynclock's own packages (testing's
#: force_loss waits a renewal round; the stats endpoint checks the backend is open and
#: starts its server in the backend's task group).
DOORS = {"_next_renewal_round", "_ready", "_start_background"}


def test_nothing_outside_the_core_reaches_into_a_backend() -> None:
    """The Backend's session and acquisition are the core's: the thread bridge, the stats
    endpoint, OTel, testing and the integrations go through its methods (or, for the
    thread bridge, ``_core.backend.thread_grants``), never its private members."""
    stray: list[str] = []
    files = [
        *ROOT.joinpath("asynclock").rglob("*.py"),
        *ROOT.joinpath("integrations").rglob("*.py"),
    ]
    for path in files:
        module = str(path.relative_to(ROOT))
        if module.startswith("asynclock/_core/"):
            continue
        for receiver, field, line in private_reads(path):
            if field not in DOORS:
                stray.append(f"{module}:{line}: {receiver}.{field}")
    assert not stray, "a backend's private members read outside the core:\n" + "\n".join(stray)


def test_the_reach_in_check_sees_one(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text("def f(backend, x):\n    return backend._acq, x._acq, x.backend._session\n")
    assert private_reads(sample) == [("backend", "_acq", 2), ("x.backend", "_session", 2)]
