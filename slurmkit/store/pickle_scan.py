"""A walk over a pickle's opcodes, before any unpickler sees them.

The C unpickler builds tuples without a depth limit, and a tuple used as a dict key is
hashed recursively in C: a key nested a million deep (a 1 MB file) overflows the C stack,
a segfault no ``except`` catches. ``scan`` follows the stack as the unpickler would, item by
item tracking only how deep tuples nest in it (lists and dicts are unhashable, so they stop
the count), and refuses opcodes outside the small set DCP's ``.metadata`` pickles use
(protocols 2 to 5) and memo indices beyond the next one (the C unpickler sizes its memo by
the largest index it is given).
"""

from __future__ import annotations


_ALLOWED = frozenset(b"\x80\x95.(012\x94qrhj)t\x85\x86\x87]ael}sudN\x88\x89KMJG\x8a"
                     b"\x8cX\x8dc\x93R\x81b")
_PUSH = frozenset(b"N\x88\x89]}")  # push one object, no argument
_TUPLE_N = {0x85: 1, 0x86: 2, 0x87: 3}


class PickleShapeError(ValueError):
    """The pickle uses an opcode or a shape the scan does not accept (says which)."""


def scan(data: bytes, max_depth: int) -> None:
    """Refuse opcodes DCP never writes, memo indices out of order (the C unpickler sizes
    its memo by the largest index) and tuples nested deeper than ``max_depth``."""
    stack: list[int] = []  # per stack item: how deep tuples nest in it (-1: a mark)
    marks: list[int] = []
    memo: list[int] = []
    i, n = 0, len(data)
    while i < n:
        op = data[i]
        i += 1
        if op == 0x94:  # MEMOIZE
            memo.append(stack[-1])
        elif op == 0x68:  # BINGET
            stack.append(memo[data[i]])
            i += 1
        elif op == 0x6A:  # LONG_BINGET
            stack.append(memo[int.from_bytes(data[i:i + 4], "little")])
            i += 4
        elif op == 0x8C:  # SHORT_BINUNICODE
            i += 1 + data[i]
            stack.append(0)
        elif op == 0x4B or op == 0x4D or op == 0x4A:  # BININT1, BININT2, BININT
            i += 1 if op == 0x4B else 2 if op == 0x4D else 4
            stack.append(0)
        elif op == 0x29:  # EMPTY_TUPLE
            stack.append(1)
        elif op in _TUPLE_N:
            k = _TUPLE_N[op]
            _tuple(stack, len(stack) - k, max_depth)
        elif op == 0x81 or op == 0x52:  # NEWOBJ, REDUCE: callable and arguments -> result
            stack.pop()
            stack[-1] = 0
        elif op in _PUSH:
            stack.append(0)
        elif op == 0x28:  # MARK
            marks.append(len(stack))
            stack.append(-1)
        elif op == 0x75 or op == 0x65:  # SETITEMS, APPENDS
            del stack[marks.pop():]
        elif op == 0x62 or op == 0x61:  # BUILD, APPEND
            stack.pop()
        elif op == 0x93:  # STACK_GLOBAL
            del stack[-1]
        else:
            i = _rare(op, data, i, stack, marks, memo, max_depth)
            if i < 0:
                return
    raise PickleShapeError("ends before its STOP opcode")


def _tuple(stack: list[int], start: int, max_depth: int) -> None:
    depth = 1 + max(stack[start:], default=0)
    if depth > max_depth:
        raise PickleShapeError(f"nests tuples more than {max_depth} deep")
    del stack[start:]
    stack.append(depth)


def _rare(op: int, data: bytes, i: int, stack: list[int], marks: list[int],
          memo: list[int], max_depth: int) -> int:
    """The opcodes ``scan`` meets seldom; the next offset (-1 after STOP)."""
    if op not in _ALLOWED:
        raise PickleShapeError(f"uses pickle opcode {op:#04x}")
    if op == 0x2E:  # STOP
        return -1
    fixed = {0x80: 1, 0x95: 8, 0x71: 1, 0x72: 4, 0x47: 8}
    if op in (0x71, 0x72):  # BINPUT, LONG_BINPUT: only the next index (or an old one)
        k = int.from_bytes(data[i:i + fixed[op]], "little")
        if k > len(memo):
            raise PickleShapeError("stores a memo entry out of order")
        memo[k:k + 1] = [stack[-1]]
    elif op == 0x47:  # BINFLOAT
        stack.append(0)
    elif op == 0x8A:  # LONG1
        i += 1 + data[i]
        stack.append(0)
    elif op in (0x58, 0x8D):  # BINUNICODE, BINUNICODE8
        k = 4 if op == 0x58 else 8
        i += k + int.from_bytes(data[i:i + k], "little")
        stack.append(0)
    elif op == 0x63:  # GLOBAL: two text lines
        i = data.index(b"\n", data.index(b"\n", i) + 1) + 1
        stack.append(0)
    elif op == 0x74:  # TUPLE
        start = marks.pop()
        del stack[start]  # the mark
        _tuple(stack, start, max_depth)
    elif op == 0x73:  # SETITEM
        del stack[-2:]
    elif op == 0x31:  # POP_MARK
        del stack[marks.pop():]
    elif op in (0x6C, 0x64):  # LIST, DICT
        del stack[marks.pop():]
        stack.append(0)
    elif op == 0x30 and stack.pop() == -1:  # POP: an object, or the mark on top
        marks.pop()
    elif op == 0x32:  # DUP
        stack.append(stack[-1])
    return i + fixed.get(op, 0)
