"""Fake sysfs/procfs trees of real machines, for tests and for trying the planner anywhere."""

from .builder import write_tree
from .machines import MACHINES
from .spec import FakeCpu, FakeEth, FakeGpu, FakeIb, FakeMachine, FakeNode, FakePci, FakePort

__all__ = [
    "MACHINES",
    "FakeCpu",
    "FakeEth",
    "FakeGpu",
    "FakeIb",
    "FakeMachine",
    "FakeNode",
    "FakePci",
    "FakePort",
    "write_tree",
]
