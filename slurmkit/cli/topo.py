"""``python -m slurmkit.topo show|plan``: what this node looks like and how ranks get pinned.

Examples:
    python -m slurmkit.topo show
    python -m slurmkit.topology.fake dgx_h100 /tmp/h100
    python -m slurmkit.topo plan --sysfs-root /tmp/h100 --local-size 8 --json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Mapping

from rich.console import Console

from slurmkit.errors import ConfigError
from slurmkit.topology import TopologyConfig, discover, plan_node, rank_env
from slurmkit.topology.present import show_plans, show_topology


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m slurmkit.topo", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("show", "plan"):
        p = sub.add_parser(name)
        p.add_argument("--sysfs-root", default="/", help="root holding sys/ and proc/ (default /)")
        p.add_argument("--proc-root", default=None, help="default: <sysfs-root>/proc")
    plan = sub.choices["plan"]
    plan.add_argument("--local-size", type=int, default=None, help="ranks on this node (default: GPUs, or 1)")
    plan.add_argument("--json", action="store_true", help="one JSON object per rank, in a list")
    for name in ("gpu_order", "cpu_mode", "mem_mode", "nic_mode"):  # the schema's choices and defaults
        plan.add_argument(f"--{name.replace('_', '-')}", choices=TopologyConfig.CHOICES[name],
                          default=getattr(TopologyConfig, name))
    plan.add_argument("--nic-exclude", action="append", default=[], help="fnmatch pattern, repeatable")
    return parser


def main(argv: list[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    args = _parser().parse_args(argv)
    env = dict(os.environ if environ is None else environ)
    console = Console()
    try:
        topo = discover(args.sysfs_root, args.proc_root, nccl_topo_file=env.get("NCCL_TOPO_FILE"))
        if args.command == "show":
            show_topology(topo, console)
            return 0
        local_size = max(1, len(topo.gpus)) if args.local_size is None else args.local_size
        cfg = TopologyConfig(
            gpu_order=args.gpu_order,
            cpu_mode=args.cpu_mode,
            mem_mode=args.mem_mode,
            nic_mode=args.nic_mode,
            nic_exclude=list(args.nic_exclude),
        )
        # A fake tree describes another machine: this shell's Slurm variables do not apply.
        plan_env = env if args.sysfs_root == "/" else {}
        plans = plan_node(topo, local_size, cfg, plan_env)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    envs = [rank_env(p, plans, {}, cfg) for p in plans]
    if args.json:
        out = [{**p.to_dict(), "env": e} for p, e in zip(plans, envs)]
        print(json.dumps(out, indent=2, sort_keys=True))
    else:
        show_plans(plans, envs, console)
    return 0


if __name__ == "__main__":
    sys.exit(main())
