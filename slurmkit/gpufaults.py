"""What marks a GPU or host memory fault in kernel-log text: the Xid line, the uncorrected
memory error line, and which Xids mean the node needs a person.

The pre-flight's kernel-log check reads the kernel log with these (slurmkit.health.kernel_log,
and health.bad_xids defaults to DEFAULT_BAD_XIDS), and the failure classifier reads rank output
with the same ones (slurmkit.failures.classify). A leaf module, so that neither of those two
packages imports the other for them.
"""

from __future__ import annotations

import re

# Xid codes that mean the GPU or its links need a person (NVIDIA's Xid catalogue): double-bit
# ECC (48), internal micro-controller faults (61, 62), row-remapping events and failures (63, 64),
# NVLink errors (74), fallen off the bus (79), high single-bit ECC rate (92), contained and
# uncontained ECC errors (94, 95), GSP errors (119, 120), unrecovered ECC (140). Xids from an
# application's own bugs (13, 31, 43, ...) are counted in the figures but fail nothing.
DEFAULT_BAD_XIDS = [48, 61, 62, 63, 64, 74, 79, 92, 94, 95, 119, 120, 140]
XID_RE = re.compile(r"NVRM: Xid \((?P<pci>[^)]*)\): (?P<xid>\d+)")
# Uncorrected host memory errors only: corrected machine checks are logged on healthy machines
# (a VM's boot log often has some) and would fail every node.
HW_RE = re.compile(r"EDAC \S+: \d+ UE |Uncorrected hardware memory error|\[Hardware Error\]:.*\bUncorrected\b")
