"""The campaign's invariants on hand-made ledgers: a healthy run passes every check, and each
broken run fails exactly the check that names what broke."""

from __future__ import annotations

from dataclasses import replace

from testkit.chaos.invariants import Injected, RunFacts, lost_per_fault, verdict

REF = "a" * 64
T0 = 1_000_000.0


def ev(dt: float, event: str, **fields) -> dict:
    return {"t": T0 + dt, "event": event, **fields}


def good_ledger() -> list[dict]:
    """A rank SIGKILLed at step 10 (interval 4), restarted from step 8, then a node lost at
    step 22 and the job requeued without it, resumed from 20, completed at 32."""
    return [
        ev(0, "submitted", job_id="5"),
        ev(1, "allocation_start", job_id="5", nodes=["node1", "node2"], train_nodes=["node1", "node2"]),
        ev(2, "ranks_started", generation=0, node="node1"),
        ev(2.1, "ranks_started", generation=0, node="node2"),
        ev(5, "train_started", step=0, generation=0),
        ev(7, "heartbeat", generation=0, node="node1", steps={"0": 3, "1": 3}),
        ev(8, "ckpt_saved", step=4, tier="nvme"),
        ev(12, "ckpt_saved", step=8, tier="nvme"),
        ev(14, "fault_injected", kind="rank_sigkill", step=10),
        ev(15, "failure", generation=0, cls="rank_crash", rank=3, node="node2"),
        ev(15.1, "decision", generation=0, action="restart"),
        ev(16, "ranks_started", generation=1, node="node1"),
        ev(16.1, "ranks_started", generation=1, node="node2"),
        ev(20, "train_started", step=8, generation=1),
        ev(24, "ckpt_saved", step=12, tier="nvme"),
        ev(32, "ckpt_saved", step=20, tier="nvme"),
        ev(34, "fault_injected", kind="node_loss", node="node2", step=22),
        ev(40, "failure", generation=1, cls="node_loss", rank=-1, node="node2"),
        ev(40.1, "decision", generation=1, action="requeue", exclude=["node2"]),
        ev(40.2, "exclusion", nodes=["node2"], how="requeue"),
        ev(40.3, "requeue", job_id="5", reason="node loss", exclude=["node2"]),
        ev(50, "allocation_start", job_id="5", nodes=["node1", "node3"], train_nodes=["node1", "node3"]),
        ev(51, "ranks_started", generation=0, node="node1"),
        ev(55, "train_started", step=20, generation=0),
        ev(60, "ckpt_saved", step=24, tier="nvme"),
        ev(69, "ckpt_saved", step=32, tier="nvme", promote_to=["lustre"]),
        ev(69.5, "ckpt_durable", step=32, tier="lustre"),
        ev(70, "train_finished", step=32, generation=0),
        ev(71, "end", status="completed", exit_code=0, generation=0),
    ]


def good_facts(**changes) -> RunFacts:
    facts = RunFacts(
        events=good_ledger(), interval=4, steps=32, reference_sha=REF, job_state="COMPLETED",
        final={"step": 32, "param_sha256": REF},
        injected=[Injected("rank_sigkill", "after_save", T0 + 14, 10, ("node2",), (3,)),
                  Injected("node_loss", "after_save", T0 + 34, 22, ("node2",))],
        killed_nodes=frozenset({"node2"}), shared_steps=(24, 28, 32))
    return replace(facts, **changes)


def failing(facts: RunFacts) -> set[str]:
    return {c.name for c in verdict(facts).checks if not c.ok}


def drop(events: list[dict], name: str, **match) -> list[dict]:
    return [e for e in events if not (e["event"] == name and all(e.get(k) == v for k, v in match.items()))]


def test_a_healthy_run_passes_every_check() -> None:
    v = verdict(good_facts())
    assert v.ok, [(c.name, c.detail) for c in v.checks if not c.ok]
    assert v.get("lost_steps").value == 2
    assert v.get("healthy_excluded").value == 0
    assert 0.0 < v.get("goodput").value <= 1.0


def test_a_stop_with_93_does_not_complete() -> None:
    events = good_ledger()[:-5] + [ev(70, "end", status="stopped", exit_code=93, reason="crash loop")]
    assert "completes" in failing(good_facts(events=events, job_state="FAILED", final=None))
    assert "bit_exact" in failing(good_facts(events=events, job_state="FAILED", final=None))


def test_completed_but_short_of_the_last_step_does_not_complete() -> None:
    assert failing(good_facts(final={"step": 28, "param_sha256": REF})) == {"completes"}


def test_different_parameters_are_not_bit_exact() -> None:
    assert failing(good_facts(final={"step": 32, "param_sha256": "b" * 64})) == {"bit_exact"}


def test_resuming_from_an_older_checkpoint_loses_too_many_steps() -> None:
    events = [dict(e, step=0) if e["event"] == "train_started" and e["t"] == T0 + 20 else e
              for e in good_ledger()]
    assert failing(good_facts(events=events)) == {"lost_steps"}
    (first, at_risk, resumed), _ = lost_per_fault(good_facts(events=events))
    assert (at_risk, resumed) == (10, 0)


def test_a_fault_in_a_restart_risks_the_checkpoint_being_restored() -> None:
    """No step at the fault: the newest checkpoint before it is what must not be lost."""
    restarting = Injected("rank_sigkill", "during_restart", T0 + 16.5, None, ("node1",), (0,), "restarting")
    events = good_ledger()
    facts = good_facts(events=events, injected=[*good_facts().injected[:1], restarting,
                                                  good_facts().injected[1]])
    events.insert(12, ev(16.6, "failure", generation=1, cls="rank_crash", rank=0, node="node1"))
    events.insert(13, ev(16.7, "decision", generation=1, action="restart"))
    events.insert(14, ev(17, "ranks_started", generation=2, node="node1"))
    assert [r for _, r, _ in lost_per_fault(facts)][1] == 8
    assert verdict(facts).ok
    worse = [dict(e, step=4) if e["event"] == "train_started" and e["t"] == T0 + 20 else e for e in events]
    assert "lost_steps" in failing(replace(facts, events=worse))


def test_training_that_never_resumes_after_a_fault_fails_lost_steps() -> None:
    late = Injected("rank_sigkill", "after_save", T0 + 65, 26, ("node1",), (1,))
    assert "lost_steps" in failing(good_facts(injected=[*good_facts().injected, late]))


def test_excluding_a_node_the_campaign_did_not_kill_is_a_healthy_exclusion() -> None:
    facts = good_facts(killed_nodes=frozenset())
    assert failing(facts) == {"healthy_excluded"}
    assert verdict(facts).get("healthy_excluded").value == 1


def test_two_suspect_failures_on_a_node_justify_its_exclusion() -> None:
    events = good_ledger()
    for e in events:
        if e["event"] == "failure":
            e["cls"], e["node"] = "hang", "node2"
    assert "healthy_excluded" not in failing(good_facts(events=events, killed_nodes=frozenset()))


def test_processes_left_after_the_end_fail() -> None:
    facts = good_facts(leftover=["pid 77 on node2 state T: python -m slurmkit.train"])
    assert failing(facts) == {"no_leftover_processes"}


def test_a_failure_without_a_decision_is_inconsistent() -> None:
    events = drop(good_ledger(), "decision", action="restart")
    assert "ledger_consistent" in failing(good_facts(events=events))


def test_a_restart_decision_without_the_next_generation_is_inconsistent() -> None:
    events = drop(good_ledger(), "ranks_started", generation=1)
    assert "ledger_consistent" in failing(good_facts(events=events))


def test_a_requeue_decision_without_a_new_allocation_is_inconsistent() -> None:
    events = [e for e in good_ledger() if not (e["event"] == "allocation_start" and e["t"] > T0 + 40)]
    assert "ledger_consistent" in failing(good_facts(events=events))
    assert "ledger_consistent" in failing(good_facts(events=drop(good_ledger(), "requeue")))


def slurm_handled_node_loss() -> list[dict]:
    """The node loss of good_ledger handled by Slurm alone (its NODE_FAIL requeue; the agents
    died before deciding), as the next allocation's agent records it (slurmkit.supervise.exits.previous)."""
    events = [e for e in good_ledger() if not (T0 + 40 <= e["t"] < T0 + 50)]
    at = next(i for i, e in enumerate(events) if e["event"] == "allocation_start" and e["t"] > T0 + 40)
    events[at:at] = [ev(49.8, "previous_attempt", attempt="5-0", handled_by="slurm", outcome="NODE_FAIL"),
                     ev(49.9, "failure", cls="node_loss", node="node2"),
                     ev(49.95, "decision", action="requeue", reason="by Slurm (NODE_FAIL)", exclude=["node2"])]
    return events


def test_a_requeue_slurm_made_itself_is_consistent_once_the_next_allocation_starts() -> None:
    # Seen in the 50-seed campaign (seed 5): node 0 lost, Slurm's NODE_FAIL requeue recovered.
    assert "ledger_consistent" not in failing(good_facts(events=slurm_handled_node_loss()))
    never = [e for e in slurm_handled_node_loss() if not (e["event"] == "allocation_start" and e["t"] > T0 + 40)]
    assert "ledger_consistent" in failing(good_facts(events=never))


def test_a_time_limit_checkpoint_without_a_requeue_is_inconsistent() -> None:
    events = good_ledger()
    events.insert(-1, ev(70.5, "checkpointed_on_signal", generation=0, signal="time_limit", step=32))
    assert "ledger_consistent" in failing(good_facts(events=events))


def test_a_fault_nobody_noticed_is_inconsistent() -> None:
    quiet = Injected("rank_sigstop", "after_save", T0 + 66, 26, ("node1",), (1,))
    facts = good_facts(injected=[*good_facts().injected, quiet])
    assert "ledger_consistent" in failing(facts)
    assert "never noticed" in verdict(facts).get("ledger_consistent").detail


def test_a_failure_no_fault_explains_is_inconsistent() -> None:
    facts = good_facts(injected=good_facts().injected[:1])
    assert "follows no injected fault" in verdict(facts).get("ledger_consistent").detail


def test_two_faults_at_once_may_explain_two_failures() -> None:
    both = Injected("two_at_once", "after_save", T0 + 14, 10, ("node1", "node2"), (0, 3))
    events = good_ledger()
    events.insert(10, ev(15.05, "failure", generation=0, cls="rank_crash", rank=0, node="node1"))
    events.insert(11, ev(15.07, "decision", generation=0, action="restart"))
    facts = good_facts(events=events, injected=[both, good_facts().injected[1]])
    assert "follows no injected fault" not in verdict(facts).get("ledger_consistent").detail
    one = replace(facts, injected=[replace(both, kind="rank_sigkill"), good_facts().injected[1]])
    assert "follows no injected fault" in verdict(one).get("ledger_consistent").detail


def test_a_requeue_that_lands_on_the_excluded_node_breaks_the_exclusion() -> None:
    """Seen on the local cluster: the release helper could not set ExcNodeList (the job was
    no longer pending) and the requeued job started on the node it had excluded."""
    events = [dict(e, nodes=["node1", "node2"]) if e["event"] == "allocation_start" and e["t"] > T0 + 40 else e
              for e in good_ledger()]
    assert failing(good_facts(events=events)) == {"exclusions_honoured"}


def test_a_replaced_node_that_starts_ranks_again_breaks_the_exclusion() -> None:
    events = good_ledger()
    events.insert(12, ev(15.2, "exclusion", nodes=["node2"], how="spare"))
    assert "exclusions_honoured" in failing(good_facts(events=events))


def test_a_node_another_job_killed_is_interference_not_a_bug() -> None:
    """The shared machine: another test's kill-node took node2; the campaign injected nothing
    there. Its loss is reported as external, not as unexplained or as a healthy exclusion."""
    facts = good_facts(injected=good_facts().injected[:1], killed_nodes=frozenset())
    assert failing(facts) == {"healthy_excluded", "ledger_consistent"}
    external = replace(facts, external_down=frozenset({"node2"}))
    assert verdict(external).ok
    assert verdict(external).get("external").value == 1


def test_a_final_step_never_made_durable_breaks_the_tier_promise() -> None:
    assert failing(good_facts(events=drop(good_ledger(), "ckpt_durable"))) == {"tiers_hold_final"}
    assert failing(good_facts(shared_steps=(24, 28))) == {"tiers_hold_final"}
    assert verdict(good_facts()).get("tiers_hold_final").value == 32


def test_a_killed_agent_is_no_node_loss_for_the_repeat_rule() -> None:
    """Seen in seed 1: an NCCL error on node2, then node2's agent SIGKILLed; node 0 called it a
    node loss and excluded node2. Slurm had node2 up: one suspect failure, a healthy node."""
    events = good_ledger()
    for e in events:
        if e["event"] == "failure" and e["cls"] == "rank_crash":
            e["cls"], e["node"] = "nccl_error", "node2"
    agent = [Injected("nccl_abort", "after_save", T0 + 14, 10, ("node2",), (3,)),
             Injected("agent_sigkill", "after_save", T0 + 34, 22, ("node2",))]
    facts = good_facts(events=events, injected=agent, killed_nodes=frozenset())
    assert failing(facts) == {"healthy_excluded"}
    assert "healthy node(s) ['node2']" in verdict(facts).get("healthy_excluded").detail


def test_the_repeat_rule_counts_within_one_allocation() -> None:
    events = good_ledger()
    for e in events:
        if e["event"] == "failure":
            e["cls"], e["node"] = "hang", "node2"
    events.insert(16, ev(30, "allocation_start", job_id="5", nodes=["node1", "node2"]))  # between the two
    assert "healthy_excluded" in failing(good_facts(events=events, killed_nodes=frozenset()))


def tier_fault_ledger(*, kind: str, saved_elsewhere: bool = True, reason: str = "disk_full",
                      durable_after: bool = True) -> tuple[list[dict], Injected]:
    """A run with one tier fault at step 14 (t=+50) and no restart: the save of step 16 meets
    it; the nvme_full case falls back to the shared tier, the S3 case's promotion is pending
    until the server is back."""
    base = [e for e in good_ledger() if float(e["t"]) - T0 < 30]  # the rank kill and its restart
    fault = Injected(kind, "after_save", T0 + 50, 14, ("node1",) if kind == "nvme_full" else ())
    events = base + [ev(50, "fault_injected", kind=kind, step=14)]
    if kind == "nvme_full":
        events += [ev(53, "ckpt_failed", step=16, tier="nvme", phase="save", reason=reason, rank=r)
                   for r in range(4)]
        if saved_elsewhere:
            events.append(ev(53.5, "ckpt_saved", step=16, tier="lustre", promote_to=["lustre"]))
    else:
        events += [ev(53, "ckpt_saved", step=16, tier="nvme", promote_to=["lustre", "object"]),
                   ev(60, "ckpt_failed", step=16, tier="object", phase="promote", pending=True,
                      reason="io_error")]
        if durable_after:
            events.append(ev(70, "ckpt_durable", step=20, tier="object"))
    events += [ev(69, "ckpt_saved", step=32, tier="nvme", promote_to=["lustre"]),
               ev(69.5, "ckpt_durable", step=32, tier="lustre"),
               ev(70, "train_finished", step=32, generation=1),
               ev(71, "end", status="completed", exit_code=0, generation=1)]
    return events, fault


def tier_facts(events: list[dict], fault: Injected) -> RunFacts:
    return good_facts(events=events, injected=[Injected("rank_sigkill", "after_save", T0 + 14, 10, ("node2",), (3,)),
                                               fault],
                      killed_nodes=frozenset(), filled_nodes=frozenset(fault.nodes))


def test_a_full_nvme_tier_whose_save_went_to_the_shared_tier_keeps_every_invariant() -> None:
    facts = tier_facts(*tier_fault_ledger(kind="nvme_full"))
    v = verdict(facts)
    assert v.ok, [(c.name, c.detail) for c in v.checks if not c.ok]
    # training never stopped for it: nothing lost, though no train_started follows the fault
    (_, (fault, at_risk, resumed)) = lost_per_fault(facts)
    assert fault.kind == "nvme_full" and at_risk == resumed == 14


def test_a_full_nvme_tier_that_costs_the_save_fails_tier_faults() -> None:
    facts = tier_facts(*tier_fault_ledger(kind="nvme_full", saved_elsewhere=False))
    assert failing(facts) == {"tier_faults"}
    assert "step 16 was committed on no other tier" in verdict(facts).get("tier_faults").detail


def test_a_full_disk_reported_as_another_error_fails_tier_faults() -> None:
    facts = tier_facts(*tier_fault_ledger(kind="nvme_full", reason="io_error"))
    assert "does not say disk_full" in verdict(facts).get("tier_faults").detail


def test_a_fill_that_no_save_met_was_not_noticed() -> None:
    events, fault = tier_fault_ledger(kind="nvme_full")
    events = drop(drop(events, "ckpt_failed"), "ckpt_saved", step=16)
    assert failing(tier_facts(events, fault)) == {"tier_faults", "ledger_consistent"}


def test_a_node_whose_nvme_the_campaign_filled_may_be_moved() -> None:
    events, fault = tier_fault_ledger(kind="nvme_full", saved_elsewhere=False)
    events += [ev(54, "failure", generation=1, cls="preflight", node="node1"),
               ev(54.1, "decision", generation=1, action="replace_node", exclude=["node1"]),
               ev(54.2, "exclusion", nodes=["node1"], how="spare"),
               ev(55, "ranks_started", generation=2, node="node3"),
               ev(56, "train_started", step=12, generation=2)]
    facts = tier_facts(events, fault)
    assert verdict(facts).get("healthy_excluded").ok
    assert verdict(facts).get("tier_faults").ok  # moved, not committed elsewhere: still kept
    assert not verdict(replace(facts, filled_nodes=frozenset())).get("healthy_excluded").ok


def test_an_s3_outage_the_object_tier_recovers_from_keeps_every_invariant() -> None:
    facts = tier_facts(*tier_fault_ledger(kind="s3_down_during_promotion"))
    v = verdict(facts)
    assert v.ok, [(c.name, c.detail) for c in v.checks if not c.ok]


def test_an_object_tier_left_behind_after_an_outage_fails_tier_faults() -> None:
    facts = tier_facts(*tier_fault_ledger(kind="s3_down_during_promotion", durable_after=False))
    assert failing(facts) == {"tier_faults"}
    assert "no step >= 16" in verdict(facts).get("tier_faults").detail


def test_an_outage_no_promotion_met_is_not_noticed() -> None:
    events, fault = tier_fault_ledger(kind="s3_down_during_promotion")
    assert failing(tier_facts(drop(events, "ckpt_failed"), fault)) == {"tier_faults", "ledger_consistent"}


def test_a_failure_after_a_tier_fault_counts_its_lost_steps() -> None:
    """A full disk that did crash training is judged like any fault: from where it resumed."""
    events, fault = tier_fault_ledger(kind="nvme_full")
    events += [ev(54, "failure", generation=1, cls="rank_crash", rank=0, node="node1"),
               ev(54.1, "decision", generation=1, action="restart"),
               ev(55, "ranks_started", generation=2, node="node1"),
               ev(56, "train_started", step=8, generation=2)]
    facts = tier_facts(events, fault)
    assert not verdict(facts).get("lost_steps").ok  # 14 - 8 = 6 > interval 4


def test_a_killed_agent_relaunched_in_the_allocation_keeps_every_invariant() -> None:
    """Issue 11's relaunch (c37f6d7): node 0 starts the lost agent again inside the allocation
    and restarts the ranks; no requeue, no exclusion, the node keeps its slot."""
    events = [e for e in good_ledger() if float(e["t"]) - T0 < 30] + [
        ev(34, "fault_injected", kind="agent_sigkill", node="node2", step=22),
        ev(36, "failure", generation=1, cls="node_loss", rank=-1, node="node2"),
        ev(38, "agent_relaunched", node="node2", node_rank=1, generation=2, relaunch=1),
        ev(38.5, "decision", generation=1, action="restart", exclude=[]),
        ev(39, "ranks_started", generation=2, node="node1"),
        ev(39.1, "ranks_started", generation=2, node="node2"),
        ev(42, "train_started", step=20, generation=2),
        ev(69, "ckpt_saved", step=32, tier="nvme", promote_to=["lustre"]),
        ev(69.5, "ckpt_durable", step=32, tier="lustre"),
        ev(70, "train_finished", step=32, generation=2),
        ev(71, "end", status="completed", exit_code=0, generation=2)]
    events = [e for e in events if not (e["event"] == "ckpt_saved" and e["step"] == 12)] + [
        ev(32, "ckpt_saved", step=20, tier="nvme")]
    facts = good_facts(events=events, killed_nodes=frozenset(),
                       injected=[Injected("rank_sigkill", "after_save", T0 + 14, 10, ("node2",), (3,)),
                                 Injected("agent_sigkill", "after_save", T0 + 34, 22, ("node2",))])
    v = verdict(facts)
    assert v.ok, [(c.name, c.detail) for c in v.checks if not c.ok]
    assert v.get("healthy_excluded").value == 0


def test_an_outage_failure_without_its_step_stands_for_the_newest_save_before_it() -> None:
    """Seen in seed 5: the promoter's round failed unexpectedly (an OSError from the stopping
    server) and reported ``ckpt_failed`` without a step; the newest save then was step 16."""
    events, fault = tier_fault_ledger(kind="s3_down_during_promotion")
    for e in events:
        if e["event"] == "ckpt_failed":
            del e["step"]
    assert verdict(tier_facts(events, fault)).ok
    late = [e for e in events if not (e["event"] == "ckpt_durable" and e.get("tier") == "object")] + [
        ev(70, "ckpt_durable", step=12, tier="object")]
    assert "no step >= 16" in verdict(tier_facts(late, fault)).get("tier_faults").detail
