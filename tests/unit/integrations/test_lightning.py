"""slurmkit's Lightning callback, in a real ``Trainer`` built by an unmodified program.

Lightning finds the callback through the entry point slurmkit's installed metadata declares
(``lightning.pytorch.callbacks_factory``); nothing here adds it by hand. The rank's environment
is the one the node agent gives (run directory, heartbeat file, event spool), pointed at a
temporary directory, and what the program reports is read back from the same files the agent
reads: the beat, the progress marker and the spool.
"""

from __future__ import annotations

import json
import os
from importlib.metadata import entry_points

import pytest

import lightning as L  # the dev extras install it (tools/setup)
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from slurmkit import contract
from slurmkit.integrations import lightning as skl
from slurmkit.userapi import marker_path


class Tiny(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def validation_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):  # noqa: ANN201
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _data() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, generator=g)
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)


def _fit(tmp_path, max_steps: int, ckpt_path: str | None = None) -> L.Trainer:
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=max_steps, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, val_check_interval=4,
                        callbacks=[ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), every_n_train_steps=2,
                                                   save_top_k=-1)])
    trainer.fit(Tiny(), _data(), _data(), ckpt_path=ckpt_path)
    return trainer


@pytest.fixture
def rank_env(tmp_path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    env = {contract.RUN_DIR: str(tmp_path / "run"), contract.HEARTBEAT_FILE: str(tmp_path / "shm" / "rank0.json"),
           "SLURMKIT_EVENTS_FILE": str(tmp_path / "shm" / "events.jsonl"), contract.RANK: "0",
           contract.GENERATION: "2", contract.NODE: "n0", contract.PROGRAM: "torchrun"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return env


def _spool(env: dict[str, str]) -> list[dict]:
    with open(env["SLURMKIT_EVENTS_FILE"]) as f:
        return [json.loads(line) for line in f]


def _ours(trainer: L.Trainer) -> list:
    return [c for c in trainer.callbacks if type(c).__module__ == skl.__name__]


def test_the_entry_point_is_declared_where_lightning_looks() -> None:
    found = {e.value for e in entry_points(group="lightning.pytorch.callbacks_factory")}
    assert "slurmkit.integrations.lightning:callbacks" in found, found
    found = {e.value for e in entry_points(group="pytorch_lightning.callbacks_factory")}
    assert "slurmkit.integrations.lightning:pl_callbacks" in found, found


def test_a_trainer_in_a_rank_reports_its_steps_loss_length_start_and_saves(tmp_path, rank_env) -> None:
    trainer = _fit(tmp_path, 6)
    assert len(_ours(trainer)) == 1, trainer.callbacks
    with open(rank_env[contract.HEARTBEAT_FILE]) as f:
        beat = json.load(f)
    assert beat["step"] == 6 and beat["total_steps"] == 6 and beat["generation"] == 2, beat
    assert isinstance(beat["metrics"]["loss"], float), beat
    events = _spool(rank_env)
    starts = [e for e in events if e["event"] == "train_started"]
    assert [(e["step"], e["by"], e["generation"]) for e in starts] == [(0, "userapi", 2)], events
    saved = [(e["step"], e["tier"], os.path.basename(e["uri"])) for e in events if e["event"] == "ckpt_saved"]
    assert saved == [(2, "user", "epoch=0-step=2.ckpt"), (4, "user", "epoch=0-step=4.ckpt"),
                     (6, "user", "epoch=0-step=6.ckpt")], events
    with open(marker_path(rank_env[contract.RUN_DIR])) as f:
        marker = json.load(f)
    assert marker["step"] == 6 and os.path.isfile(marker["path"]), marker


def test_a_resumed_fit_starts_from_its_checkpoints_step_and_does_not_count_it_again(tmp_path, rank_env) -> None:
    _fit(tmp_path, 4)
    first = len(_spool(rank_env))
    _fit(tmp_path, 8, ckpt_path=str(tmp_path / "ckpt" / "epoch=0-step=4.ckpt"))
    events = _spool(rank_env)[first:]
    assert [e["step"] for e in events if e["event"] == "train_started"] == [4], events
    assert [e["step"] for e in events if e["event"] == "ckpt_saved"] == [6, 8], events


@pytest.mark.parametrize("unset, program", [(contract.RUN_DIR, "lightning"), (contract.HEARTBEAT_FILE, "lightning"),
                                            (None, "none")])
def test_outside_slurmkit_or_with_job_program_none_nothing_is_added(tmp_path, rank_env, monkeypatch,
                                                                     unset: str | None, program: str) -> None:
    if unset:
        monkeypatch.delenv(unset)
    monkeypatch.setenv(contract.PROGRAM, program)
    trainer = _fit(tmp_path, 2)
    assert _ours(trainer) == [] and not os.path.exists(rank_env["SLURMKIT_EVENTS_FILE"])


def test_a_report_that_fails_is_said_once_and_training_goes_on(tmp_path, rank_env, monkeypatch, capfd) -> None:
    (tmp_path / "shm").mkdir()
    os.chmod(tmp_path / "shm", 0o500)  # no beat can be written (as root: a file where the dir should be)
    if os.access(tmp_path / "shm", os.W_OK):
        os.chmod(tmp_path / "shm", 0o700)
        os.rmdir(tmp_path / "shm")
        (tmp_path / "shm").write_text("not a directory")
    trainer = _fit(tmp_path, 4)
    assert trainer.global_step == 4
    err = capfd.readouterr().err
    assert err.count("slurmkit:") >= 1 and "Traceback" not in err, err


@pytest.mark.parametrize("outputs, want", [(torch.tensor(2.5), 2.5), ({"loss": torch.tensor(1.0)}, 1.0),
                                           (None, None), ({"other": 1}, None), (torch.ones(3), None),
                                           (torch.tensor(float("nan")), None), ("abc", None)])
def test_the_loss_training_step_returned(outputs: object, want: float | None) -> None:
    assert skl.loss_of(outputs) == want
