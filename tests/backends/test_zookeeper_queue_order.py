"""Where a ZooKeeper lock waiter stands in the queue (``_paths.ahead_of``): one pass over
the children, no sort (issue 45: sorting 1,000 names on every wake-up was the hand-off's
growing cost), in agreement with the sorted order for any mix of our nodes, kazoo's and
Curator's, negative sequences (a counter past 2**31) and other applications' children."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from asynclock.backends.zookeeper._paths import ahead_of, contenders

KINDS = ["{:032x}__lock__", "__rlock__", "_c_0f2a-lock-", "config_change_", "x"]


@st.composite
def children(draw: st.DrawFn) -> tuple[list[str], str]:
    seqs = draw(st.lists(st.integers(-(2**31), 2**31 - 1), unique=True, max_size=40))
    names = []
    for seq in seqs:
        kind = draw(st.sampled_from(KINDS)).format(seq & 0xFFFF)
        number = f"{seq:010d}" if seq >= 0 else f"{seq:011d}"
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
