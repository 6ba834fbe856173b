"""``python -m slurmkit.topology.fake NAME OUTDIR``: write a fake machine's sysfs/procfs tree."""

from __future__ import annotations

import argparse
import sys

from .builder import write_tree
from .machines import MACHINES


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m slurmkit.topology.fake")
    parser.add_argument("machine", choices=sorted(MACHINES))
    parser.add_argument("out_dir", help="directory that receives sys/ and proc/")
    args = parser.parse_args(argv)
    write_tree(MACHINES[args.machine](), args.out_dir)
    print(f"wrote {args.machine} to {args.out_dir} (use --sysfs-root {args.out_dir})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
