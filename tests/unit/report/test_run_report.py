"""The run report over ledgers and metrics the project's own code wrote: exact figures from a
replayed ledger, and a real three-fault run from the local cluster (tests/data/report/)."""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
from typing import Any

import pytest
from omegaconf import OmegaConf
from rich.console import Console

from slurmkit.ledger.ledger import Ledger, read_ledger
from slurmkit.ledger.summary import summarize
from slurmkit.report.__main__ import main
from slurmkit.report.breakdown import LABELS, breakdown
from slurmkit.report.run import load_run
from slurmkit.report.write import write
from slurmkit.supervise.__main__ import main as supervise_main
from slurmkit.train.metrics import MetricsWriter, step_metrics

DATA = os.path.join(os.path.dirname(__file__), "..", "..", "data")
THREE_FAULTS = os.path.join(DATA, "report", "three_faults")
LEDGERS = os.path.join(DATA, "failures", "ledgers")
TOKENS = 1024  # per step (global batch x sequence length)


def ev(t: float, event: str, **fields: Any) -> dict[str, Any]:
    return {"t": t, "event": event, **fields}


def beat(t: float, step: int) -> dict[str, Any]:
    return ev(t, "heartbeat", generation=0, node="n1", steps={"0": step, "1": step})


# A crash at step 34 restored from step 20, after 5 s in the queue and 5 s of startup.
EVENTS = [
    ev(1000.0, "submitted", job_id="7"),
    ev(1005.0, "allocation_start", attempt="7-0", nodes=["n1", "n2", "n3"], spares=["n3"]),
    ev(1006.0, "ranks_started", generation=0, node="n1"),
    ev(1010.0, "train_started", step=0, generation=0),
    beat(1020.0, 10),
    ev(1030.0, "ckpt_saved", step=20, tier="nvme", seconds=0.7),
    ev(1030.5, "ckpt_durable", step=20, tier="lustre"),
    beat(1040.0, 30),
    ev(1045.0, "fault_injected", time=1045.0, rank=1, kind="sigkill", step=34),
    ev(1046.0, "state", old="running", new="stopping"),
    ev(1047.0, "failure", cls="rank_crash", rank=1, node="n1",
       evidence="returncode -9 <script>alert(1)</script>", time_of_fault=1045.5),
    ev(1047.0, "decision", action="restart", reason="r", exclude=[]),
    ev(1048.0, "ranks_started", generation=1, node="n1"),
    ev(1055.0, "ckpt_restored", step=20, tier="nvme"),
    ev(1056.0, "train_started", step=20, generation=1),
    ev(1066.0, "ckpt_saved", step=30, tier="nvme", seconds=0.5),
    ev(1076.0, "train_finished", step=40),
    ev(1077.0, "end", status="completed", exit_code=0),
]
# Metrics rank 0 wrote: steps 1..34 in generation 0, then 21..40 in generation 1; saves at 20, 30.
STEPS = [(s, 0) for s in range(1, 35)] + [(s, 1) for s in range(21, 41)]
BLOCKING = {(20, 0): 0.25, (30, 0): 0.35, (30, 1): 0.45}


def write_run(d: str, events: list[dict[str, Any]] = EVENTS, config: dict[str, Any] | None = None,
              metrics: bool = True) -> str:
    times = iter([float(e["t"]) for e in events])
    ledger = Ledger(os.path.join(d, "ledger.jsonl"), clock=lambda: next(times))
    for e in events:
        ledger.append(e["event"], **{k: v for k, v in e.items() if k not in ("t", "event")})
    if metrics:
        w = MetricsWriter(os.path.join(d, "metrics.jsonl"))
        for step, gen in STEPS:
            w.write(step_metrics(step=step, loss=10.0 - step / 10, lr=1e-3, step_time_s=0.5,
                                 tokens=TOKENS, world_size=4, flops_per_token=1e6, peak_tflops=0.0,
                                 ckpt_blocking_s=BLOCKING.get((step, gen), 0.0), generation=gen))
        w.close()
    cfg = config if config is not None else {"job": {"name": "unit", "nodes": 2},
                                             "train": {"ckpt_interval_steps": 10}}
    OmegaConf.save(OmegaConf.create(cfg), os.path.join(d, "config.yaml"))
    return d


def test_breakdown_of_a_replayed_ledger(tmp_path) -> None:
    d = load_run(write_run(str(tmp_path)))
    b = d.breakdown
    assert d.report.productive_s == 40.0  # 1010..1030 kept to step 20, 1056..1076
    assert b == {"productive": 40.0, "lost": 15.0,  # step 20 (1030) -> the fault (1045)
                 "queue": 5.0, "startup": 5.0, "detection": 1.0,  # fault -> stopping
                 "restart": 2.0, "restore": 8.0,  # stopping -> ranks, ranks -> train_started
                 "other": 1.0}  # train_finished -> end
    assert sum(b.values()) == d.report.wall_s == 77.0


@pytest.mark.parametrize("name", ["tiny_completed", "tiny_raise_restart", "tiny_raise_then_requeue"])
def test_breakdown_adds_up_on_real_ledgers(name: str) -> None:
    events = list(read_ledger(os.path.join(LEDGERS, f"{name}.jsonl")))
    r, b = summarize(events), breakdown(events)
    assert set(b) == set(LABELS) and all(v >= 0 for v in b.values())
    assert sum(b.values()) == pytest.approx(r.wall_s)
    assert b["productive"] == pytest.approx(r.productive_s)
    if r.requeues:
        assert b["queue"] > 100  # Slurm held the requeued job: that wait is queue time
    if r.failures:
        assert b["lost"] > 0 and b["restore"] > 0


def test_saves_pair_blocking_time_with_the_ledger(tmp_path) -> None:
    d = load_run(write_run(str(tmp_path)))
    # Generation 0 saved step 30 too but was killed before the commit: no ckpt_saved for it.
    assert [(s["step"], s["tier"], s["write_s"], s["blocking_s"]) for s in d.saves] == [
        (20, "nvme", 0.7, 0.25), (30, "nvme", 0.5, 0.45), (30, "", None, 0.35)]


def test_cost_from_the_gpu_hour_price(tmp_path) -> None:
    cfg = {"job": {"name": "c", "nodes": 2}, "cluster": {"gpu_hour_cost": 2.5, "gpus_per_node": 8},
           "train": {"ckpt_interval_steps": 10}}
    c = load_run(write_run(str(tmp_path), config=cfg)).cost
    assert c is not None
    allocated = (1077.0 - 1005.0) * 3 * 8 / 3600  # the whole allocation, spare node included
    assert c.gpu_hours == pytest.approx(allocated)
    assert c.total == pytest.approx(allocated * 2.5)
    assert c.useful_gpu_hours == pytest.approx(40.0 * 2 * 8 / 3600)
    assert c.useful_tokens == 40 * TOKENS
    assert c.per_useful_gpu_hour == pytest.approx(c.total / c.useful_gpu_hours)
    assert c.per_million_tokens == pytest.approx(c.total / (40 * TOKENS / 1e6))
    html = open(write(str(tmp_path))[0], encoding="utf-8").read()
    assert f"<td>cost per million useful tokens</td><td class=\"n\">{c.per_million_tokens:.4g}</td>" in html


def test_without_price_metrics_or_failures_the_report_says_so(tmp_path) -> None:
    events = [e for e in EVENTS if e["event"] not in ("failure", "fault_injected")]
    d = load_run(write_run(str(tmp_path), events=events, metrics=False))
    assert d.advice is None and d.cost is None
    text = " ".join(d.notes)
    assert "no metrics.jsonl" in text and "gpu_hour_cost is not set" in text
    html = open(write(str(tmp_path))[0], encoding="utf-8").read()
    assert "no metrics.jsonl" in html and "gpu_hour_cost is not set" in html


def test_no_failure_but_mtbf_given_still_advises(tmp_path) -> None:
    events = [e for e in EVENTS if e["event"] not in ("failure", "fault_injected")]
    d = load_run(write_run(str(tmp_path), events=events), mtbf_h=1.0)
    assert d.advice is not None and d.advice.figures.mtbf_s == 3600.0
    assert d.advice.figures.save_s == pytest.approx((0.25 + 0.35 + 0.45) / 3)
    assert d.advice.figures.step_s == 0.5


def _pngs(html: str) -> list[bytes]:
    return [base64.b64decode(m) for m in re.findall(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', html)]


def test_report_html_is_self_contained_and_escapes_the_ledger(tmp_path) -> None:
    paths = write(write_run(str(tmp_path / "run")), out=str(tmp_path / "out"))
    html = open(paths[0], encoding="utf-8").read()
    assert os.path.basename(paths[0]) == "report.html"
    names = sorted(os.path.basename(p) for p in paths[1:])
    assert names == ["advice.png", "curves.png", "goodput.png", "saves.png", "timeline.png"]
    embedded = _pngs(html)
    assert len(embedded) == 5 and all(p.startswith(b"\x89PNG\r\n\x1a\n") for p in embedded)
    assert sorted(embedded) == sorted(open(p, "rb").read() for p in paths[1:])
    assert not re.search(r"(src|href)=\"(?!data:)", html) and "http" not in html.split("<body>")[1]
    assert "<script>alert" not in html and "&lt;script&gt;alert(1)" in html
    assert re.findall(r"<script[^>]*>", html) == ['<script type="application/json" id="supervise-figures">']
    rows = re.findall(r'<tr class="failure" data-class="([a-z_]+)" data-rank="(-?\d+)"', html)
    assert rows == [("rank_crash", "1")]


def _supervise_json(run_dir: str) -> dict[str, Any]:
    console = Console(record=True, width=300)
    assert supervise_main([run_dir, "--json"], out=console) == 0
    return json.loads(console.export_text())


def _embedded(html: str) -> dict[str, Any]:
    m = re.search(r'<script type="application/json" id="supervise-figures">(.*?)</script>', html, re.S)
    assert m
    return json.loads(m.group(1))


def test_real_three_fault_run(tmp_path) -> None:
    import matplotlib.image as mpimg

    run = str(tmp_path / "run")
    shutil.copytree(THREE_FAULTS, run)
    assert main([run]) == 0
    html = open(os.path.join(run, "report.html"), encoding="utf-8").read()
    for name in ("timeline", "curves", "goodput", "saves", "advice"):
        pixels = mpimg.imread(os.path.join(run, f"{name}.png"))
        assert pixels.shape[0] > 200 and pixels.shape[1] > 600, name
        assert float(pixels[..., :3].std()) > 0.05, name  # drawn on, not an empty canvas
    rows = re.findall(r'<tr class="failure" data-class="([a-z_]+)" data-rank="(-?\d+)"', html)
    assert [c for c, _ in rows] == ["rank_crash", "hang", "node_loss"]
    assert [int(r) for _, r in rows] == [3, 1, -1]  # killed rank 3, stopped rank 1, lost node
    sup = _supervise_json(run)
    assert _embedded(html) == sup
    shown = dict(re.findall(r'data-figure="([a-z ]+)" data-value="([^"]+)"', html))
    assert float(shown["goodput"]) == sup["goodput"] and float(shown["productive"]) == sup["productive_s"]
    assert f"{sup['goodput']:.1%}" in html and f"{sup['wall_s']:.1f} s" in html
    d = load_run(run)
    assert sum(d.breakdown.values()) == pytest.approx(sup["wall_s"])
    assert d.breakdown["productive"] == pytest.approx(sup["productive_s"])
    assert len(d.saves) == 6 and all(s["blocking_s"] and s["blocking_s"] > 0 for s in d.saves)
    assert "train.ckpt_interval_steps=" in html


def test_cli_errors(tmp_path, capsys) -> None:
    assert main([str(tmp_path)]) == 2
    assert "Detected: no ledger.jsonl" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([str(tmp_path), "--mtbf-h", "-1"])


def test_sweep_side_by_side(tmp_path) -> None:
    sweep_dir = tmp_path / "tiny" / "20260101-000000-sweep"
    variants = []
    for i, lr in enumerate(["1e-3", "3e-3", "1e-2"]):
        run = sweep_dir / str(i)
        run.mkdir(parents=True)
        if i < 2:  # the third has not started: no ledger yet
            events = EVENTS if i == 0 else [e for e in EVENTS if e["event"] not in ("failure", "fault_injected")]
            write_run(str(run), events=events)
        variants.append({"index": i, "overrides": [f"train.lr={lr}"], "run_dir": str(run)})
    (sweep_dir / "sweep.json").write_text(json.dumps(
        {"kind": "sweep", "name": "tiny", "job_id": "42", "array": "0-2", "executor": "slurm",
         "common_overrides": [], "variants": variants}))
    assert main([str(sweep_dir)]) == 0
    html = (sweep_dir / "report.html").read_text(encoding="utf-8")
    for name in ["goodput.png", "loss.png", "v0-timeline.png", "v1-timeline.png", "v0-curves.png"]:
        assert (sweep_dir / name).read_bytes().startswith(b"\x89PNG"), name
    assert "0: train.lr=1e-3" in html and "1: train.lr=3e-3" in html
    assert "variant 2: train.lr=1e-2: no ledger yet" in html
    assert re.findall(r'<tr class="failure" data-class="([a-z_]+)"', html) == ["rank_crash"]  # variant 0 only
    # shared goodput and loss; per variant timeline, curves, saves, and advice where it failed
    assert len(_pngs(html)) == 2 + 4 + 3


def test_sweep_json_pointing_elsewhere_is_refused(tmp_path, capsys) -> None:
    other = write_run(str(tmp_path / "other"))
    sweep_dir = tmp_path / "s-sweep"
    sweep_dir.mkdir()
    (sweep_dir / "sweep.json").write_text(json.dumps(
        {"kind": "sweep", "name": "s", "variants": [{"index": 0, "overrides": [], "run_dir": other}]}))
    assert main([str(sweep_dir)]) == 2
    assert "Detected:" in capsys.readouterr().err
    assert not (sweep_dir / "report.html").exists()


def test_gpu_hour_cost_is_a_cluster_field_checked_on_load() -> None:
    from slurmkit.config.schema import ClusterConfig
    from slurmkit.errors import ConfigError

    assert ClusterConfig(name="site").gpu_hour_cost == 0  # unset: no cost figures
    assert ClusterConfig(name="site", gpu_hour_cost=2.5).gpu_hour_cost == 2.5
    with pytest.raises(ConfigError, match="cluster.gpu_hour_cost=-1"):
        ClusterConfig(name="site", gpu_hour_cost=-1)


def test_the_failing_ranks_last_line_is_under_its_evidence_as_text(tmp_path) -> None:
    """The ledger's failure ``line`` (what the rank said last: issue 36) is in the report's
    failure row, markup as text and control characters escaped (the ledger is untrusted)."""
    said = "ValueError: bad <b>batch</b>\x1b[31m red"
    events = [dict(e, line=said) if e["event"] == "failure" else e for e in EVENTS]
    paths = write(write_run(str(tmp_path / "run"), events), out=str(tmp_path / "out"))
    html = open(paths[0], encoding="utf-8").read()
    (row,) = re.findall(r'<tr class="failure"[^>]*>(.*?)</tr>', html, re.S)
    assert '<span class="line">said: ValueError: bad &lt;b&gt;batch&lt;/b&gt;' in row, row
    assert "\x1b" not in html and "<b>batch" not in html
