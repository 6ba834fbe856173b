"""job.env / cluster.env values reach the batch script, the frozen config and every rank as the
user typed them: ``+job.env.X=false`` is ``false``, never Python's ``False``."""

from __future__ import annotations

import os

import pytest

from slurmkit.cli import submit
from slurmkit.config import compose
from slurmkit.config.compose import load_frozen, to_yaml
from slurmkit.config.envtext import keep_env_text
from tests.unit.launch.test_contract_slurm_env import agent

TYPED = ["+job.env.X=false", "+job.env.T=True", "++cluster.env.C=1.50", "+job.env.E=1e3",
         "+job.env.I=007", "+job.env.P=/a:/b"]
WANT = {"X": "false", "T": "True", "C": "1.50", "E": "1e3", "I": "007", "P": "/a:/b"}


def test_the_batch_script_exports_what_was_typed(tmp_path, capsys) -> None:
    code = submit.main(["+exp=tiny", "cluster=local_slurm", "cluster.kind=slurm", *TYPED,
                        "submit.dry_run=true", f"submit.run_root={tmp_path / 'runs'}"])
    out = capsys.readouterr()
    assert code == 0, out.err
    exports = dict(line[len("export "):].split("=", 1) for line in out.out.splitlines()
                   if line.startswith("export ") and "=" in line)
    assert {k: exports[k] for k in WANT} == WANT


def test_the_frozen_config_keeps_the_text(tmp_path) -> None:
    cfg = compose(["+exp=tiny", *TYPED])
    assert {**cfg.cluster.env, **cfg.job.env} == {**cfg.cluster.env, **WANT}
    path = tmp_path / "config.yaml"
    path.write_text(to_yaml(cfg))
    again = load_frozen(str(path))  # what a requeued job's agents load
    assert {k: {**again.cluster.env, **again.job.env}[k] for k in WANT} == WANT


def test_a_rank_gets_false_not_False(tmp_path) -> None:
    (tmp_path / "run").mkdir()
    node = agent(tmp_path, 0, ["+job.env.X=false", "++cluster.env.C=1.50"])
    env = node.rank_env(0, 0, 0, 29500, "10.0.0.7")
    assert (env["X"], env["C"]) == ("false", "1.50")


@pytest.mark.parametrize(("given", "want"), [
    ("+job.env.X=false", "+job.env.X='false'"), ("job.env.X=1", "job.env.X='1'"),
    ("++cluster.env.Y=-2.5e-3", "++cluster.env.Y='-2.5e-3'"),
    # Left alone: quoted already, not a literal, a deletion, another key, a sweep.
    ("+job.env.X='false'", "+job.env.X='false'"), ("+job.env.P=/a:/b", "+job.env.P=/a:/b"),
    ("~job.env.X", "~job.env.X"), ("job.requeue=false", "job.requeue=false"),
    ("+job.env.X=true,false", "+job.env.X=true,false"), ("+job.env.X=${oc.env:HOME}", "+job.env.X=${oc.env:HOME}"),
])
def test_keep_env_text(given: str, want: str) -> None:
    assert keep_env_text([given]) == [want]


def test_a_sweep_over_booleans_keeps_them_lowercase(tmp_path) -> None:
    from slurmkit.sweep.expand import expand

    variants = [compose(["+exp=tiny", *v]).job.env["X"] for v in expand(["+job.env.X=true,false"])]
    assert variants == ["true", "false"]
    assert not os.path.exists(tmp_path / "runs")
