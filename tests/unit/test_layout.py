"""One resolved layout, frozen at submit beside config.yaml: every consumer agrees with it, and a
damaged or foreign layout.json is refused with Detected/Requirement/Fix."""

from __future__ import annotations

import json
import os

import pytest
from rich.console import Console

from slurmkit.cli import submit
from slurmkit.config import compose
from slurmkit.layout import (
    LAYOUT_NAME,
    Layout,
    LayoutError,
    load_layout,
    read_layout,
    resolve_layout,
    write_layout,
)
from slurmkit.render import build_jobspec
from slurmkit.train.planner import hardware_of

SHAPES = [
    # (overrides, nodes, train nodes, ranks per node, gpus per node)
    # The case that used to disagree: a CPU job on an 8-GPU cluster (the agent said 8 ranks).
    (["+exp=tiny", "cluster=dgx_h100", "job.gpus_per_node=0", "job.ranks_per_node=null"], 2, 2, 1, 0),
    (["+exp=tiny", "cluster=local_slurm", "job.gpus_per_node=0", "job.ranks_per_node=null"], 2, 2, 1, 0),
    (["+exp=tiny", "cluster=local_slurm"], 2, 2, 2, 0),
    (["+exp=tiny", "cluster=local_slurm", "job.gpus_per_node=null", "job.ranks_per_node=null"], 2, 2, 4, 4),
    (["+exp=tiny", "cluster=local_slurm", "job.gpus_per_node=2", "job.ranks_per_node=null",
      "supervisor.spare_nodes=1"], 3, 2, 2, 2),
    (["+exp=llama70b", "cluster=dgx_h100"], 8, 8, 8, 8),
    (["+exp=tiny", "cluster=dgx_h100", "job.gpus_per_node=4", "job.ranks_per_node=8"], 2, 2, 8, 4),
]


@pytest.mark.parametrize("overrides, nodes, train, ranks, gpus", SHAPES)
def test_the_job_the_planner_and_the_layout_agree(overrides, nodes, train, ranks, gpus, tmp_path) -> None:
    cfg = compose(overrides)
    lay = resolve_layout(cfg)
    assert (lay.nodes, lay.train_nodes, lay.ranks_per_node, lay.gpus_per_node) == (nodes, train, ranks, gpus)
    assert lay.world_size == train * ranks and lay.spare_nodes == nodes - train
    spec = build_jobspec(cfg, str(tmp_path))
    assert (spec.nodes, spec.train_nodes, spec.ranks_per_node, spec.gpus_per_node) == (nodes, train, ranks, gpus)
    assert spec.world_size == lay.world_size and spec.no_kill == (lay.spare_nodes > 0)
    hw = hardware_of(cfg, host_mem_gb=64.0)
    assert (hw.nodes, hw.per_node, hw.on_gpu) == (train, ranks, gpus > 0)
    # What the node agent reads: the frozen file, equal to what submit resolved.
    submit.freeze(cfg, str(tmp_path))
    assert load_layout(str(tmp_path), cfg) == read_layout(str(tmp_path))
    assert read_layout(str(tmp_path)).to_dict() | {"config_sha256": ""} == lay.to_dict()


def test_impossible_layouts_are_config_errors() -> None:
    from slurmkit.errors import ConfigError

    with pytest.raises(ConfigError, match="at most 8 GPUs per node"):
        resolve_layout(compose(["+exp=tiny", "cluster=dgx_h100", "job.gpus_per_node=16"]))
    with pytest.raises(ConfigError, match="job.ranks_per_node=6 with 4 GPUs"):
        resolve_layout(compose(["+exp=tiny", "cluster=local_slurm", "job.gpus_per_node=4",
                                "job.ranks_per_node=6"]))


def test_submit_freezes_the_layout_beside_the_config(tmp_path) -> None:
    out = Console(file=open(os.devnull, "w"))
    code = submit.run(["+exp=tiny", "cluster=dgx_h100", "job.gpus_per_node=0", "job.ranks_per_node=null",
                       "submit.emit=sbatch", f"submit.run_root={tmp_path}"], os.environ, out, out)
    assert code == 0
    (run_dir,) = list((tmp_path / "tiny").iterdir())
    names = sorted(os.listdir(run_dir))
    assert LAYOUT_NAME in names and "config.yaml" in names and not [n for n in names if ".tmp" in n]
    data = json.loads((run_dir / LAYOUT_NAME).read_text())
    assert data == {"version": 1, "nodes": 2, "train_nodes": 2, "spare_nodes": 0, "ranks_per_node": 1,
                    "gpus_per_node": 0, "world_size": 2, "config_sha256": data["config_sha256"]}
    assert "#SBATCH --nodes=2" in (run_dir / "job.sbatch").read_text()
    assert read_layout(str(run_dir)).world_size == 2


# ------------------------------------------------------------------ untrusted on the shared FS
@pytest.fixture()
def frozen(tmp_path) -> str:
    run_dir = str(tmp_path / "run")
    submit.freeze(compose(["+exp=tiny", "cluster=local_slurm"]), run_dir)
    return run_dir


def rewrite(run_dir: str, change) -> None:
    path = os.path.join(run_dir, LAYOUT_NAME)
    with open(path) as f:
        data = json.load(f)
    change(data)
    with open(path, "w") as f:
        json.dump(data, f)


@pytest.mark.parametrize("change, fragment", [
    (lambda d: d.update(ranks_per_node="2"), "ranks_per_node='2', not a non-negative integer"),
    (lambda d: d.update(ranks_per_node=True), "ranks_per_node=True"),
    (lambda d: d.update(nodes=2.0), "nodes=2.0"),
    (lambda d: d.update(spare_nodes=-1), "spare_nodes=-1"),
    (lambda d: d.update(ranks_per_node=0, world_size=0), "ranks_per_node=0 (at least 1 each)"),
    (lambda d: d.update(world_size=64), "world_size=64 but train_nodes x ranks_per_node = 4"),
    (lambda d: d.update(nodes=3), "nodes=3 but train_nodes + spare_nodes = 2"),
    (lambda d: d.update(version=2), "version 2"),
    (lambda d: d.update(master_addr="evil"), "unknown keys ['master_addr']"),
    (lambda d: d.pop("train_nodes"), "missing keys ['train_nodes']"),
    (lambda d: d.update(config_sha256="x" * 64), "not a sha256 hex digest"),
])
def test_a_damaged_layout_is_refused(frozen: str, change, fragment: str) -> None:
    rewrite(frozen, change)
    with pytest.raises(LayoutError) as err:
        read_layout(frozen)
    text = str(err.value)
    assert fragment in text and text.startswith("Detected: ") and "Requirement:" in text and "Fix:" in text


@pytest.mark.parametrize("content, fragment", [
    (b"", "not JSON"), (b"\xff\xfe{", "not JSON"), (b"[1, 2]", "a JSON list"),
    (b"{" + b" " * (70 * 1024) + b"}", "over 65536 bytes"),
])
def test_a_layout_that_is_not_a_layout_is_refused(frozen: str, content: bytes, fragment: str) -> None:
    with open(os.path.join(frozen, LAYOUT_NAME), "wb") as f:
        f.write(content)
    with pytest.raises(LayoutError, match=fragment):
        read_layout(frozen)


def test_a_layout_frozen_with_another_config_is_refused(frozen: str) -> None:
    with open(os.path.join(frozen, "config.yaml"), "a") as f:
        f.write("# edited by hand\n")
    with pytest.raises(LayoutError, match="frozen with another config.yaml"):
        read_layout(frozen)


def test_a_missing_layout(frozen: str) -> None:
    cfg = compose(["+exp=tiny", "cluster=local_slurm"])
    os.remove(os.path.join(frozen, LAYOUT_NAME))
    with pytest.raises(LayoutError, match="cannot be read"):
        read_layout(frozen)
    # A run directory from before layouts were frozen (a requeued older job): same resolution.
    assert load_layout(frozen, cfg) == resolve_layout(cfg)


def test_write_layout_replaces_atomically_and_binds_the_config(frozen: str) -> None:
    lay = read_layout(frozen)
    again = write_layout(frozen, Layout(4, 3, 1, 2, 0))
    assert again == os.path.join(frozen, LAYOUT_NAME) and [n for n in os.listdir(frozen) if ".tmp" in n] == []
    moved = read_layout(frozen)
    assert (moved.nodes, moved.world_size, moved.config_sha256) == (4, 6, lay.config_sha256)


def test_the_report_prices_the_gpus_the_layout_says(tmp_path) -> None:
    """The report was a fourth place with its own rule (job.gpus_per_node=0 read as "all 8")."""
    from slurmkit.report.run import load_run
    from tests.unit.report.test_run_report import write_run

    cfg = {"job": {"name": "c", "nodes": 2, "gpus_per_node": 0},
           "cluster": {"gpu_hour_cost": 2.5, "gpus_per_node": 8}, "train": {"ckpt_interval_steps": 10}}
    data = load_run(write_run(str(tmp_path), config=cfg))
    assert data.cost is None and any("a CPU job" in n for n in data.notes)
    write_layout(str(tmp_path), Layout(nodes=3, train_nodes=2, spare_nodes=1, ranks_per_node=4, gpus_per_node=4))
    cost = load_run(str(tmp_path)).cost
    assert cost is not None and cost.gpus_per_node == 4
    assert cost.useful_gpu_hours == pytest.approx(40.0 * 2 * 4 / 3600)
    with open(os.path.join(tmp_path, LAYOUT_NAME), "w") as f:
        f.write("{not json")
    damaged = load_run(str(tmp_path))
    assert damaged.cost is None and any(f"{LAYOUT_NAME} not used" in n for n in damaged.notes)
