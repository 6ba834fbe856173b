"""The local executor is told the job's GPUs: submitit otherwise exports CUDA_VISIBLE_DEVICES=''
to the agents it starts, and a local GPU job's ranks computed on the CPU (seen on an H200)."""

from __future__ import annotations

import os

import submitit

from slurmkit.cli.submit import local_gpu_parameters


def test_cpu_job_leaves_submitit_defaults() -> None:
    assert local_gpu_parameters(0, {"CUDA_VISIBLE_DEVICES": "0,1"}) == {}


def test_gpus_counted_from_zero_without_a_caller_list() -> None:
    assert local_gpu_parameters(2, {}) == {"gpus_per_node": 2}
    assert local_gpu_parameters(1, {"CUDA_VISIBLE_DEVICES": "GPU-1f2e"}) == {"gpus_per_node": 1}


def test_caller_list_is_kept_and_caps_the_count() -> None:
    assert local_gpu_parameters(1, {"CUDA_VISIBLE_DEVICES": "3,5"}) == {"gpus_per_node": 1, "visible_gpus": [3, 5]}
    assert local_gpu_parameters(4, {"CUDA_VISIBLE_DEVICES": "6"}) == {"gpus_per_node": 1, "visible_gpus": [6]}


def _visible() -> str:
    return os.environ.get("CUDA_VISIBLE_DEVICES", "unset")


def test_submitit_starts_the_agent_with_the_gpus(tmp_path) -> None:
    # A real local job: the process submitit starts sees the GPUs slurmkit named.
    ex = submitit.LocalExecutor(folder=str(tmp_path))
    ex.update_parameters(timeout_min=1, **local_gpu_parameters(1, {"CUDA_VISIBLE_DEVICES": "3,5"}))
    assert ex.submit(_visible).result() == "3"
    ex.update_parameters(gpus_per_node=0, visible_gpus=())  # what slurmkit passed before
    assert ex.submit(_visible).result() == ""
