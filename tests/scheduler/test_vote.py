"""The vote, with N ranks as threads sharing an in-process MIN vote (N = 2, 4, 8).

Each rank owns a real Scheduler. A harness runs all ranks step by step and records every rank's
step kind, so the tests can check the group decisions and that all ranks always agree.
"""

import threading

import pytest
from sched_helpers import fake_token, make_seq

from scheduler import (
    AttemptPoint,
    GroupView,
    InProcessVoteGroup,
    LocalState,
    Scheduler,
    SchedulerConfig,
)
from scheduler.vote import attempt_point, group_prefills

CONFIG = dict(
    max_num_seqs=16,
    max_num_batched_tokens=256,
    max_model_len=512,
    block_size=4,
    num_blocks=512,
    prefill_attempt_interval=7,
    prefill_any_attempt_interval=10,
    sync_policy="vote",  # these tests are about the vote's ALL/ANY points
)


class Group:
    """N schedulers stepping in lock-step on threads; ``arrivals[step]`` feeds ranks."""

    def __init__(self, num_ranks, **overrides):
        self.votes = InProcessVoteGroup(num_ranks, timeout_s=20)
        config = SchedulerConfig(**{**CONFIG, **overrides})
        self.ranks = [Scheduler(config, vote=self.votes.member(r)) for r in range(num_ranks)]
        self.trace = [[] for _ in range(num_ranks)]  # per rank: (step, kind, point, nseq)
        self.finished = [dict() for _ in range(num_ranks)]

    def run(self, steps, before_step=None):
        errors = []

        def loop(rank):
            sched = self.ranks[rank]
            try:
                for step in range(steps):
                    if before_step is not None:
                        before_step(rank, step, sched)
                    out = sched.schedule()
                    tokens = [fake_token(seq) for seq in out.scheduled_seqs]
                    done = sched.process_outputs(out, tokens)
                    kind = (
                        "empty" if out.known_empty else ("prefill" if out.is_prefill else "decode")
                    )
                    self.trace[rank].append((step, kind, out.point, out.num_seqs))
                    for seq in [*done, *out.ignored_seqs]:
                        self.finished[rank][seq.request_id] = (step, seq)
            except BaseException as exc:  # reported by the main thread
                errors.append((rank, exc))
                self.votes.abort()

        threads = [threading.Thread(target=loop, args=(r,)) for r in range(len(self.ranks))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert not any(t.is_alive() for t in threads), "a rank hung"
        if errors:
            raise errors[0][1]
        kinds = [[(step, kind, point) for step, kind, point, _ in t] for t in self.trace]
        assert all(k == kinds[0] for k in kinds), "ranks disagreed on a step kind"
        return kinds[0]


def test_vote_vector_round_trip_through_min():
    states = [
        LocalState(want=True, has_running=False, has_work=True, wake_epoch=3),
        LocalState(want=False, has_running=True, has_work=True, wake_epoch=5, shutdown=True),
    ]
    reduced = [min(column) for column in zip(*(s.encode() for s in states), strict=True)]
    view = GroupView.from_vector(reduced)
    assert (view.all_want, view.any_want, view.none_running, view.none_work) == (
        False,
        True,
        False,
        False,
    )
    assert view.max_wake_epoch == 5 and view.shutdown and not view.regroup


def test_one_ranks_regroup_is_seen_by_every_rank_at_the_same_vote():
    asking = LocalState(want=False, has_running=True, has_work=True, regroup=True)
    others = LocalState(want=False, has_running=True, has_work=True)
    reduced = [min(column) for column in zip(asking.encode(), others.encode(), strict=True)]
    view = GroupView.from_vector(reduced)
    assert view.regroup and not view.shutdown


def test_attempt_points_all_any_and_any_wins():
    points = {
        step: attempt_point(step, 70, 100, group_idle=False, every_step=False)
        for step in (0, 1, 69, 70, 100, 140, 700)
    }
    assert points == {
        0: AttemptPoint.ALL,
        1: AttemptPoint.NONE,
        69: AttemptPoint.NONE,
        70: AttemptPoint.ALL,
        100: AttemptPoint.ANY,
        140: AttemptPoint.ALL,
        700: AttemptPoint.ANY,
    }
    assert attempt_point(5, 70, 100, group_idle=True, every_step=False) is AttemptPoint.IDLE
    assert attempt_point(5, 70, 100, group_idle=False, every_step=True) is AttemptPoint.EVERY
    assert attempt_point(5, 70, 100, group_idle=False, every_step=False, drain_step=5) is (
        AttemptPoint.DRAIN
    )


def test_group_decision_rules():
    def view(all_want, any_want, none_running):
        return GroupView(all_want, any_want, none_running, False, 0, False, 0)

    assert not group_prefills(AttemptPoint.ALL, view(False, True, False))
    assert group_prefills(AttemptPoint.ALL, view(True, True, False))
    assert group_prefills(AttemptPoint.ANY, view(False, True, False))
    assert group_prefills(AttemptPoint.ALL, view(False, True, True))  # nobody decoding: ANY


@pytest.mark.parametrize("num_ranks", [2, 4, 8])
def test_all_point_waits_for_every_rank_then_any_point_serves_one(num_ranks):
    group = Group(num_ranks)
    # Every rank decodes a long request; at step 2 only rank 0 gets a new prompt.
    for rank, sched in enumerate(group.ranks):
        sched.add_sequence(make_seq(f"long{rank}", 8, max_tokens=60))

    def arrive(rank, step, sched):
        if step == 2 and rank == 0:
            sched.add_sequence(make_seq("late", 8, max_tokens=3))

    kinds = group.run(40, before_step=arrive)
    prefills = [step for step, kind, _ in kinds if kind == "prefill"]
    # Step 0 prefills the long requests; ALL points at decode_step 7 fail (only rank 0 wants);
    # the ANY point at decode_step 10 (step 11) serves the late prompt.
    assert prefills == [0, 11]
    assert kinds[11][2] is AttemptPoint.ANY
    assert group.finished[0]["late"][1].finish_reason == "length"
    # Ranks without a prompt ran an empty prefill step (placeholder) alongside.
    assert all(group.trace[r][11][3] == 0 for r in range(1, num_ranks))


@pytest.mark.parametrize("num_ranks", [2, 4, 8])
def test_all_point_prefills_when_every_rank_wants(num_ranks):
    group = Group(num_ranks)
    for rank, sched in enumerate(group.ranks):
        sched.add_sequence(make_seq(f"long{rank}", 8, max_tokens=60))

    def arrive(rank, step, sched):
        if step == 3:
            sched.add_sequence(make_seq(f"new{rank}", 8, max_tokens=3))

    kinds = group.run(20, before_step=arrive)
    assert [s for s, kind, _ in kinds if kind == "prefill"] == [0, 8]
    assert kinds[8][2] is AttemptPoint.ALL


@pytest.mark.parametrize("num_ranks", [2, 4, 8])
def test_vote_two_stops_the_empty_prefill_livelock(num_ranks):
    # Rank 0 wants to prefill but its prompt can never get a state slot while its own long
    # request runs; ANY passes, vote 2 finds no rank with a batch, and the group decodes.
    group = Group(num_ranks, num_state_slots=2)
    for rank, sched in enumerate(group.ranks):
        sched.add_sequence(make_seq(f"long{rank}", 8, max_tokens=30))
    group.ranks[0].add_sequence(make_seq("blocked", 8, max_tokens=2))
    kinds = group.run(40)
    any_attempts = [step for step, _, point in kinds if point is AttemptPoint.ANY]
    assert any_attempts, "no ANY point reached"
    assert all(kinds[step][1] == "decode" for step in any_attempts if step < 30)
    assert group.finished[0]["blocked"][1].finish_reason == "length"  # served once slots free


@pytest.mark.parametrize("num_ranks", [2, 4, 8])
def test_dead_request_at_one_head_does_not_block_the_others(num_ranks):
    group = Group(num_ranks)
    for rank, sched in enumerate(group.ranks):
        sched.add_sequence(make_seq(f"long{rank}", 8, max_tokens=60))

    def arrive(rank, step, sched):
        if step == 2:
            if rank == 1:  # rank 1's head dies, with a fresh prompt behind it
                sched.add_sequence(make_seq("doomed", 4))
            sched.add_sequence(make_seq(f"new{rank}", 8, max_tokens=3))
            if rank == 1:
                sched.abort("doomed")

    kinds = group.run(20, before_step=arrive)
    # The ALL point at decode_step 7 passes: rank 1 swept its dead head on the decode path.
    assert [s for s, kind, _ in kinds if kind == "prefill"] == [0, 8]


@pytest.mark.parametrize("num_ranks", [2, 4, 8])
def test_no_rank_decoding_means_prefill_at_once(num_ranks):
    group = Group(num_ranks)

    def arrive(rank, step, sched):
        if rank == num_ranks - 1 and step in (3, 9):
            sched.add_sequence(make_seq(f"r{step}", 5, max_tokens=2))

    kinds = group.run(14, before_step=arrive)
    # Idle steps are known-empty (no forward anywhere); a request starts the step it arrives.
    assert kinds[0][1] == "empty" and kinds[2][1] == "empty"
    assert kinds[3][1] == "prefill" and kinds[9][1] == "prefill"


@pytest.mark.parametrize("num_ranks", [2, 4])
def test_every_step_policy_prefills_whenever_any_rank_wants(num_ranks):
    group = Group(num_ranks, sync_policy="every_step")
    group.ranks[0].add_sequence(make_seq("a", 8, max_tokens=30))

    def arrive(rank, step, sched):
        if rank == 1 and step == 4:
            sched.add_sequence(make_seq("b", 8, max_tokens=3))

    kinds = group.run(10, before_step=arrive)
    assert [s for s, kind, _ in kinds if kind == "prefill"] == [0, 4]
    assert all(point is AttemptPoint.EVERY for _, _, point in kinds)


@pytest.mark.parametrize("num_ranks", [2, 4, 8])
def test_random_traffic_keeps_every_rank_in_step(num_ranks):
    import random

    group = Group(num_ranks, num_blocks=64, prefill_watermark=0.8)
    rng = random.Random(num_ranks)
    plan = {
        (rng.randrange(num_ranks), rng.randrange(150)): (rng.randint(1, 40), rng.randint(1, 20))
        for _ in range(40)
    }

    def arrive(rank, step, sched):
        if (rank, step) in plan:
            length, max_tokens = plan[(rank, step)]
            sched.add_sequence(make_seq(f"r{rank}-{step}", length, max_tokens=max_tokens))

    group.run(400, before_step=arrive)  # asserts identical kinds on every rank
    finished = {rid for rank in group.finished for rid in rank}
    assert finished == {f"r{rank}-{step}" for rank, step in plan}
