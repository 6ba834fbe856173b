"""The buddy layout and the spare's fetch plan, as pure functions (the transfers themselves
run over real gloo in tests/integration/test_store_buddy.py)."""

from __future__ import annotations

from slurmkit.store.buddy import Ring, _plain_name
from slurmkit.store.recovery import choose_step, plan_files, plan_metadata


def test_ring_by_slot_sends_to_the_next_nodes_and_caps_replicas_at_the_other_nodes() -> None:
    r = Ring(rank=5, world_size=8, local_world=2, replicas=2)  # 4 nodes, rank 5 on slot 2
    assert (r.slot, r.slots, r.copies) == (2, 4, 2)
    assert r.targets() == [7, 1] and r.sources() == [3, 1]
    assert r.holder_slots(5) == [2, 3, 0] and r.held_slots() == [2, 1, 0]
    assert Ring(0, 4, 2, 5).copies == 1  # two nodes: one other node to copy to
    assert not Ring(0, 4, 4, 1).enabled  # one node
    assert not Ring(0, 4, 0, 1).enabled  # layout unknown
    assert not Ring(0, 6, 4, 1).enabled  # uneven nodes


def test_pairs_are_sorted_so_every_rank_makes_its_groups_in_one_global_order() -> None:
    assert Ring(0, 6, 2, 1).ring_pairs() == [(0, 2), (0, 4)]
    assert Ring(2, 4, 2, 1).ring_pairs() == [(0, 2)]  # two nodes: one pair both ways


def test_a_spare_gets_the_manifest_and_its_files_from_the_surviving_buddy() -> None:
    ring = Ring(0, 4, 2, 1)
    full = {"20": {"slots": [0, 1], "meta": True}, "16": {"slots": [0, 1], "meta": True}}
    reports: list[dict] = [full, full, {}, {}]  # slot 1 is a spare with an empty NVMe
    assert choose_step(reports, ring) == 20
    assert plan_metadata(ring, reports, 20) == [
        (0, 2, "manifest.json"), (0, 2, ".metadata"), (1, 3, "manifest.json"),
        (1, 3, ".metadata")]
    needs = [[], [], [["__0_0.distcp", 0], ["__2_0.distcp", 2]],
             [["__0_0.distcp", 0], ["__3_0.distcp", 3]]]
    # one fetch per node and file: rank 3 does not fetch what rank 2 already fetches
    assert plan_files(ring, reports, 20, needs) == [
        (0, 2, "__0_0.distcp"), (0, 2, "__2_0.distcp"), (1, 3, "__3_0.distcp")]


def test_no_step_is_chosen_when_a_slot_is_complete_on_no_live_node() -> None:
    ring = Ring(0, 6, 2, 1)
    part = {"20": {"slots": [0, 2], "meta": True}}  # slot 1's files lived on slots 1 and 2
    assert choose_step([part, part, {}, {}, {}, {}], ring) is None


def test_a_peer_cannot_name_a_file_outside_the_step_directory() -> None:
    assert _plain_name("__0_0.distcp") and _plain_name(".metadata")
    for bad in ("../x", "a/b", "..", ".", "", "x\0y"):
        assert not _plain_name(bad), bad
