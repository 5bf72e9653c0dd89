"""Where a ZooKeeper lock waiter stands in the queue (``_paths.ahead_of``): one pass over
the children, no sort (issue 45: sorting 1,000 names on every wake-up was the hand-off's
growing cost), in agreement with the sorted order for any mix of our nodes, kazoo's and
Curator's, negative sequences (a counter past 2**31) and other applications' children."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from asynclock.backends.zookeeper._paths import ahead_of, contenders, sequence

KINDS = ["{:032x}__lock__", "__rlock__", "_c_0f2a-lock-", "config_change_", "x"]


@st.composite
def children(draw: st.DrawFn) -> tuple[list[str], str]:
    seqs = draw(st.lists(st.integers(-(2**31), 2**31 - 1), unique=True, max_size=40))
    names = []
    for seq in seqs:
        kind = draw(st.sampled_from(KINDS)).format(seq & 0xFFFF)
        number = f"{seq:010d}"  # as ZooKeeper writes it (Java's %010d: the sign counts)
        names.append(kind + number if kind != "x" else f"plain{seq}")
    mine_seq = draw(st.integers(0, 2**31 - 1).filter(lambda s: s not in seqs))
    return names, f"{0:032x}__lock__{mine_seq:010d}"


@given(children())
def test_ahead_of_agrees_with_the_sorted_queue(case: tuple[list[str], str]) -> None:
    listed, mine = case
    order = contenders([*listed, mine])
    index = order.index(mine)
    count, nearest, first = ahead_of([*listed, mine], mine)
    assert count == index
    assert nearest == (order[index - 1] if index else None)
    assert first == (order[0] if index else None)


def test_a_node_that_is_not_a_contender_is_first() -> None:
    assert ahead_of(["a__lock__0000000001"], "plain") == (0, None, None)


def test_curators_prefix_is_not_a_sign() -> None:
    """Curator's nodes are ``_c_<id>-lock-<ten digits>``: the dash before the digits was
    read as a minus, so Curator's contender 3 stood ahead of our 2 here while Curator
    (rightly) put ours first: each would wait for the other's node for ever."""
    curator, ours = "_c_0f2a-lock-0000000003", f"{0:032x}__lock__0000000002"
    assert sequence(curator) == 3
    assert ahead_of([curator, ours], ours) == (0, None, None)
    assert ahead_of([curator, ours], curator) == (1, ours, ours)
    assert contenders([curator, ours]) == [ours, curator]


def test_negative_sequences_as_zookeeper_writes_them() -> None:
    assert sequence("x__lock__-000000001") == -1
    assert sequence("x__lock__-1234567890") == -1234567890
    assert sequence("_c_0f2a-lock--000000007") == -7
    assert sequence("_c_0f2a-lock--2147483648") == -2147483648
    assert sequence("_c_0f2a-lock-2147483647") == 2147483647
    assert sequence("plain-123") is None
    assert sequence("\u0661" * 10) is None  # Arabic-Indic digits are not ZooKeeper's
