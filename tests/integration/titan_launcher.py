"""Run an unmodified torchtitan 0.3.0 ``torchtitan.train`` on a CPU-only torch (2.13), for tests.

    python titan_launcher.py <torchtitan.train args...>      # under torchrun, like
    python -m torchtitan.train <torchtitan.train args...>

It changes no file on disk: it patches a few names in memory, then runs the ``torchtitan.train``
module as ``__main__`` (``runpy.run_module(..., alter_sys=True)``: ``sys.argv[0]`` becomes the
module's path, as under ``-m``). On a machine with an accelerator, patches 1 and 2 do nothing
(torch's own detection answers first) and patch 3 only when torch lacks the function. Each patch
answers one line that otherwise stops the run:

1. Device type and module, seen by torchtitan only.
   ``torchtitan/tools/utils.py:55`` ``device_type = _get_available_device_type() or "cuda"``: with
   no accelerator torchtitan picks "cuda" and ``trainer.py:301`` ``device_module.set_device(...)``
   fails (``torch.cuda`` unavailable). With "cpu", ``torch.cpu`` still lacks what
   ``components/metrics.py:42-50,62,92`` (``DeviceMemoryMonitor``) calls: ``get_device_name``,
   ``get_device_properties(...).total_memory``, ``reset_peak_memory_stats``, ``empty_cache``,
   ``memory_stats``; and its ``current_device()`` returns the string "cpu", which
   ``distributed/utils.py:586`` passes as ``barrier(device_ids=[...])`` (integers only:
   ``TypeError`` in ``distributed_c10d.py`` ``opts.device_ids = device_ids``).
   The patch: while ``torchtitan.tools.utils`` is first imported (and only then), torch's
   ``_get_available_device_type`` answers "cpu" and ``_get_device_module("cpu")`` answers
   ``_CpuDeviceModule``, which forwards to ``torch.cpu`` and adds those calls (memory figures:
   the process's peak RSS and the machine's RAM; ``current_device()`` is 0, as CUDA's would be).
   torch's own modules that bind these functions (DCP's ``filesystem.py``, ``DataParallel``) are
   imported before the window, so they keep the originals.
2. FlexAttention on CPU (the eager path, no Inductor).
   The llama3 models use ``attn_backend="flex"``. ``torch/nn/attention/flex_attention.py:2079``
   (``_validate_device``, torch 2.13) raises ``NotImplementedError("FlexAttention does not support backward on
   CPU ...")`` when q/k/v require grad; and ``torchtitan/models/common/attention.py:277``
   ``FlexAttention._compiled_flex_attn`` is ``torch.compile(flex_attention, options={max_autotune,
   coordinate_descent_tuning, ...})`` (Inductor; the CPU check fires under it too). The patch drops
   that one CPU check (other devices keep it) and sets ``_compiled_flex_attn`` to the uncompiled
   ``flex_attention``, whose eager path (dynamo "eager" backend around the HOP, unfused math) has
   a CPU backward. Same maths, materialised scores: fine at debug sizes. Likewise
   ``attention.py:622`` ``_compiled_create_block_mask = torch.compile(create_block_mask)``, called
   by every step's ``get_attention_masks``, becomes the eager ``create_block_mask`` (same
   ``BlockMask``): compiled, it runs Inductor's CPU C++ codegen, which needs gcc and Python headers
   on the machine and a few CPU-seconds per rank at each start. The ``varlen`` backend
   (``llama3_debugmodel_varlen_attn``) calls a CUDA-only kernel and stays unsupported here.
3. ``torch.distributed.set_timeout``.
   ``torchtitan/distributed/utils.py:595`` (``set_pg_timeouts``, called by ``trainer.py:1062``
   after step 1) calls ``torch.distributed.set_timeout(timeout, group)``, which torch 2.13 does not
   have (``AttributeError``; a GPU run hits it too). The patch aliases it to torch's
   ``distributed_c10d._set_pg_timeout(timeout, group)``, same signature, when it is missing.

Not patches: the launcher sets ``HF_HUB_OFFLINE=1`` and ``HF_DATASETS_OFFLINE=1`` unless set, so
nothing is fetched. Flags a CPU run still needs: ``--parallelism.spmd-backend partial_dtensor
--parallelism.data-parallel-replicate-degree N --parallelism.data-parallel-shard-degree 1`` (the
default spmd_types + FSDP path fails in ``fully_shard``, and FSDP over gloo lacks ``PREMUL_SUM``);
assets from ``titan_assets.write_assets``.
"""

from __future__ import annotations

import os
import resource
import runpy
import sys
import types

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import torch  # noqa: E402
import torch._utils  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint.filesystem  # noqa: E402,F401  (binds the originals first)
import torch.nn.attention.flex_attention as _flex  # noqa: E402
import torch.nn.parallel.data_parallel  # noqa: E402,F401  (binds the originals first)
from torch.distributed import distributed_c10d as _c10d  # noqa: E402


class _CpuDeviceModule(types.ModuleType):
    """``torch.cpu`` plus the CUDA-style calls torchtitan makes on its device module (patch 1)."""

    def __init__(self) -> None:
        super().__init__("torchtitan_cpu_device_module")

    def __getattr__(self, name):
        return getattr(torch.cpu, name)

    @staticmethod
    def current_device() -> int:
        return 0

    @staticmethod
    def get_device_name(device=None) -> str:
        return "CPU"

    @staticmethod
    def get_device_properties(device=None):
        return types.SimpleNamespace(
            name="CPU", total_memory=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        )

    @staticmethod
    def reset_peak_memory_stats(device=None) -> None:
        pass

    @staticmethod
    def empty_cache() -> None:
        pass

    @staticmethod
    def memory_stats(device=None) -> dict:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return {"active_bytes.all.peak": peak, "reserved_bytes.all.peak": peak,
                "num_alloc_retries": 0, "num_ooms": 0}


def _patch_device() -> None:
    """Patch 1: torchtitan.tools.utils sees "cpu" and _CpuDeviceModule when no accelerator."""
    if "torchtitan.tools.utils" in sys.modules:
        raise RuntimeError("torchtitan.tools.utils was imported before the device patch")
    orig_type, orig_module = torch._utils._get_available_device_type, torch._utils._get_device_module
    cpu_module = _CpuDeviceModule()
    torch._utils._get_available_device_type = lambda: orig_type() or "cpu"
    torch._utils._get_device_module = lambda t=None: cpu_module if t == "cpu" else orig_module(t)
    try:
        import torchtitan.tools.utils as titan_utils
    finally:
        torch._utils._get_available_device_type, torch._utils._get_device_module = orig_type, orig_module
    if orig_type() is None:
        assert titan_utils.device_type == "cpu" and titan_utils.device_module is cpu_module


def _patch_flex_attention() -> None:
    """Patch 2: allow FlexAttention's eager backward on CPU."""
    orig_validate = _flex._validate_device

    def _validate_device(query, key, value):
        if query.device.type != "cpu":
            orig_validate(query, key, value)

    _flex._validate_device = _validate_device
    import torchtitan.models.common.attention as titan_attention

    titan_attention.FlexAttention._compiled_flex_attn = _flex.flex_attention
    titan_attention._compiled_create_block_mask = _flex.create_block_mask


def _no_accelerator() -> bool:
    """Patches 1 and 2 act only then; on a GPU torchtitan runs as shipped."""
    return torch._utils._get_available_device_type() is None


def _patch_set_timeout() -> None:
    """Patch 3: torch.distributed.set_timeout for torch versions without it."""
    if not hasattr(dist, "set_timeout"):
        dist.set_timeout = _c10d._set_pg_timeout


def main(argv: list[str]) -> None:
    _patch_device()
    if _no_accelerator():
        _patch_flex_attention()
    _patch_set_timeout()
    sys.argv = ["torchtitan.train"] + argv
    runpy.run_module("torchtitan.train", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
