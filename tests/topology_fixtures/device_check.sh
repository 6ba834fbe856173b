#!/usr/bin/env bash
# Check topology discovery and pinning on a real GPU node; everything lands in $OUT (or ./out).
# Usage (repository root): bash tests/topology_fixtures/device_check.sh
set -u
OUT=${OUT:-./out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD
PY=$(command -v python3 || command -v python)
{
  echo "== python"; $PY --version; $PY -c "import rich" 2>&1 && echo rich-ok
  echo "== nvidia-smi"; nvidia-smi --query-gpu=index,pci.bus_id,uuid --format=csv,noheader 2>&1
  nvidia-smi topo -m 2>&1
  echo "== proc"; for f in /proc/driver/nvidia/gpus/*/information; do echo "$f"; cat "$f"; done 2>&1
  grep -E "Cpus_allowed_list|Mems_allowed_list" /proc/self/status
  echo "== sysfs"; ls /sys/devices/system/node/ 2>&1; cat /sys/devices/system/node/node*/cpulist 2>&1
  for d in /proc/driver/nvidia/gpus/*; do b=$(basename "$d"); realpath "/sys/bus/pci/devices/$b"; cat "/sys/bus/pci/devices/$b/numa_node"; done 2>&1
  ls -l /sys/class/infiniband/ 2>&1; ls -l /sys/class/net/ 2>&1
  echo "== discover + plan"
  $PY - <<'PYEOF' 2>&1
import json, os
from slurmkit.topology import discover, plan_node, rank_env, TopologyConfig
t = discover("/")
print("gpus", [(g.index, g.bdf, g.uuid, g.minor, g.numa_node, g.pci_path) for g in t.gpus])
print("nics", [(n.name, n.kind, n.bdf, n.numa_node, n.driver, n.ports) for n in t.nics])
print("nodes", [(n.id, len(n.cpus), n.mem_total_kb) for n in t.nodes], "allowed", len(t.allowed_cpus), t.notes)
for size in (1, 2, 4):
    plans = plan_node(t, size, TopologyConfig())
    for p in plans:
        print(size, p.local_rank, p.gpus, p.cpus[:4], len(p.cpus), p.mem_nodes, p.nics, p.warnings)
    print(json.dumps(rank_env(plans[0], plans, {}, TopologyConfig()), sort_keys=True))
PYEOF
  echo "== CLI"; $PY -m slurmkit.topo show 2>&1 | head -60; $PY -m slurmkit.topo plan --local-size 2 2>&1 | head -30
  echo "== pin wrapper + CUDA visibility"
  $PY - <<'PYEOF' 2>&1
import os, subprocess, sys
from slurmkit.topology import discover, plan_node, rank_env, pin_command, TopologyConfig
t = discover("/")
plans = plan_node(t, 2, TopologyConfig())
for p in plans:
    env = {**os.environ, **rank_env(p, plans, {}, TopologyConfig())}
    out = subprocess.run(pin_command(p, ["grep", "Cpus_allowed_list", "/proc/self/status"], verify="fail"), env=env, capture_output=True, text=True)
    print("rank", p.local_rank, "plan", p.cpus[:3], "...", out.stdout.strip(), out.stderr.strip()[-300:])
    import shutil
    if shutil.which("nvidia-smi"):
        q = subprocess.run(["nvidia-smi", "--query-gpu=pci.bus_id", "--format=csv,noheader"], env=env, capture_output=True, text=True)
        print("  CUDA_VISIBLE_DEVICES", env.get("CUDA_VISIBLE_DEVICES"), "plan gpus", p.gpus, "nvidia-smi", q.stdout.strip())
    code = "import torch;print(torch.cuda.device_count(), torch.cuda.get_device_properties(0).pci_bus_id if torch.cuda.device_count() else None)"
    tq = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    print("  torch sees", tq.stdout.strip(), tq.stderr.strip()[-200:])
PYEOF
} > "$OUT/device_check.txt" 2>&1
tail -c 11000 "$OUT/device_check.txt"
