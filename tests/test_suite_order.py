"""tests/_suite_order.py, the order run_suite's xdist processes take the
modules in: the longest first, each module whole and in its own order."""

from __future__ import annotations

import types

import _suite_order as order


class _Item:
    def __init__(self, nodeid: str, slow: bool = False):
        self.nodeid = nodeid
        self._slow = slow

    def get_closest_marker(self, name):
        return object() if (name == "slow" and self._slow) else None


def test_longest_module_first_each_module_whole_and_in_order(monkeypatch):
    monkeypatch.setattr(order, "MODULE_SECONDS", {"tests/listed.py": 500})
    items = [
        _Item("tests/many_fast.py::a"),
        _Item("tests/many_fast.py::b"),
        _Item("tests/many_fast.py::c"),
        _Item("tests/one_slow.py::x", slow=True),
        _Item("tests/listed.py::p"),
        _Item("tests/listed.py::q"),
        _Item("tests/one_fast.py::z"),
    ]
    order.pytest_collection_modifyitems(None, items)
    # 500 s (the table), then 1 slow test, 3 fast tests, 1 fast test.
    assert [i.nodeid for i in items] == [
        "tests/listed.py::p",
        "tests/listed.py::q",
        "tests/one_slow.py::x",
        "tests/many_fast.py::a",
        "tests/many_fast.py::b",
        "tests/many_fast.py::c",
        "tests/one_fast.py::z",
    ]


def test_xdist_reordering_by_test_count_is_switched_off():
    config = types.SimpleNamespace(
        option=types.SimpleNamespace(loadscopereorder=True)
    )
    order.pytest_configure(config)
    assert config.option.loadscopereorder is False
    # Without pytest-xdist (or before 3.6) there is nothing to switch off.
    bare = types.SimpleNamespace(option=types.SimpleNamespace())
    order.pytest_configure(bare)
    assert not hasattr(bare.option, "loadscopereorder")


def test_every_listed_module_exists():
    import os

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for module in order.MODULE_SECONDS:
        assert os.path.exists(os.path.join(root, module)), module
