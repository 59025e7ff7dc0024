"""The ``deadline`` step policy: its decision rules, its vote schedule, and its bound.

The bound: a head of waiting that stays *ready* (schedulable, under the watermark or mid-chunk,
a free sequence slot, its blocks and state slot free now) sits out at most
``prefill_deadline_steps`` decode steps; the step after that is a prefill step that starts it.
The property test checks it over random traffic on 4 thread-ranks with its own notion of
"ready", built from the scheduler's public pieces, not from the policy's bookkeeping.
"""

import threading

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from sched_helpers import fake_token, make_seq

from scheduler import (
    AllocStatus,
    AttemptPoint,
    GroupView,
    InProcessVoteGroup,
    LocalState,
    Scheduler,
    SchedulerConfig,
)
from scheduler.vote import deadline_next_vote, deadline_point, deadline_prefills

DEADLINE = 4
CONFIG = dict(
    max_num_seqs=16,
    max_num_batched_tokens=256,
    max_model_len=512,
    block_size=4,
    num_blocks=512,
    sync_policy="deadline",
    prefill_deadline_steps=DEADLINE,
)


def view(**fields) -> GroupView:
    base = dict(
        all_want=False,
        any_want=False,
        none_running=False,
        none_work=False,
        max_wake_epoch=0,
        shutdown=False,
        max_remaining_tokens=10,
    )
    return GroupView(**{**base, **fields})


# -- the rules, as pure functions -------------------------------------------------------------
def test_vector_carries_readiness_wait_and_backlog_through_min():
    states = [
        LocalState(want=True, has_running=True, has_work=True, ready=True, ready_wait=2),
        LocalState(want=True, has_running=True, has_work=True, ready=True, ready_wait=5),
        LocalState(want=False, has_running=True, has_work=True, backlog=False),
    ]
    reduced = [min(column) for column in zip(*(s.encode() for s in states), strict=True)]
    got = GroupView.from_vector(reduced)
    assert (got.all_ready, got.max_ready_wait, got.any_backlog) == (False, 5, False)
    backlog = LocalState(True, True, True, ready=True, ready_wait=0, backlog=True)
    reduced = [min(c) for c in zip(states[0].encode(), backlog.encode(), strict=True)]
    got = GroupView.from_vector(reduced)
    assert (got.all_ready, got.max_ready_wait, got.any_backlog) == (True, 2, True)
    none_ready = GroupView.from_vector(LocalState(False, False, False).encode())
    assert none_ready.max_ready_wait == -1 and not none_ready.all_ready


def test_attempt_points():
    def point(decode_step, **kw):
        args = dict(group_idle=False, next_vote=6, drain_step=None) | kw
        return deadline_point(decode_step, **args)

    assert point(0) is AttemptPoint.FOLLOW  # the step after a prefill step
    assert point(6) is AttemptPoint.DUE
    assert point(3) is AttemptPoint.NONE and point(7) is AttemptPoint.NONE
    assert point(3, drain_step=3) is AttemptPoint.DRAIN
    assert point(6, drain_step=6) is AttemptPoint.DUE
    assert point(3, group_idle=True) is AttemptPoint.IDLE


def test_decision_rules():
    due, follow = AttemptPoint.DUE, AttemptPoint.FOLLOW
    # Nobody decoding: any ready head suffices, at once.
    assert deadline_prefills(due, view(none_running=True, max_ready_wait=0), DEADLINE)
    assert not deadline_prefills(due, view(none_running=True, max_ready_wait=-1), DEADLINE)
    # Decoding: only a head that is due ...
    assert not deadline_prefills(due, view(max_ready_wait=DEADLINE - 1), DEADLINE)
    assert deadline_prefills(due, view(max_ready_wait=DEADLINE), DEADLINE)
    # ... or every rank ready (no placeholder rank in the prefill step) ...
    assert deadline_prefills(due, view(max_ready_wait=0, all_ready=True), DEADLINE)
    # ... or, right after a prefill step, a backlog that was queued before it.
    assert deadline_prefills(follow, view(max_ready_wait=0, any_backlog=True), DEADLINE)
    assert not deadline_prefills(follow, view(max_ready_wait=1), DEADLINE)
    assert not deadline_prefills(due, view(max_ready_wait=1, any_backlog=True), DEADLINE)


def test_next_vote_is_when_the_oldest_ready_head_falls_due():
    assert deadline_next_vote(3, view(max_ready_wait=-1), DEADLINE) == 3 + DEADLINE
    assert deadline_next_vote(3, view(max_ready_wait=1), DEADLINE) == 3 + DEADLINE - 1
    assert deadline_next_vote(3, view(max_ready_wait=DEADLINE - 1), DEADLINE) == 4
    # Already due but the group decoded (vote 2 found no batch): look again next step.
    assert deadline_next_vote(3, view(max_ready_wait=DEADLINE + 2), DEADLINE) == 4


@pytest.mark.parametrize("deadline", [0, DEADLINE])
def test_a_lone_late_prompt_sits_out_exactly_the_deadline(deadline):
    """Two ranks decoding long requests; a prompt arrives on rank 1 well after the last
    prefill step, with nothing else to batch it with: it sits out the deadline, no more and
    no less (at 0 it starts at the first step after it is ready)."""
    group = Group(2, prefill_deadline_steps=deadline)
    for rank in range(2):
        group.ranks[rank].add_sequence(make_seq(f"long{rank}", 8, max_tokens=60))
    late = make_seq("late", 8, max_tokens=4)
    started = {}

    def before_step(rank, step, sched):
        if rank == 1 and step == 20:
            sched.add_sequence(late)

    def check_step(rank, sched, after):
        if after is not None and rank == 1:
            out = after[1]
            if late in out.scheduled_seqs and "at" not in started:
                started["at"] = sched.step_index - 1
        return None

    group.run(40, before_step=before_step, check_step=check_step)
    waited = started["at"] - 20
    assert waited == deadline, waited


def test_deadline_zero_votes_every_step_and_prefills_any_ready_head():
    # Nothing ready: the next vote is the next step, never the step just decided on (which
    # has passed, so no later step would vote again).
    assert deadline_next_vote(3, view(max_ready_wait=-1), 0) == 4
    assert deadline_next_vote(3, view(max_ready_wait=0), 0) == 4
    assert deadline_prefills(AttemptPoint.DUE, view(max_ready_wait=0), 0)
    assert not deadline_prefills(AttemptPoint.DUE, view(max_ready_wait=-1), 0)


def test_a_rank_alone_or_a_pair_defaults_to_no_deadline_and_larger_groups_to_two_steps():
    assert SchedulerConfig().prefill_deadline_steps is None
    assert SchedulerConfig().deadline_steps == 2
    assert SchedulerConfig().for_group(3).deadline_steps == 2
    assert SchedulerConfig().for_group(64).deadline_steps == 2
    for ranks in (1, 2):
        small = SchedulerConfig().for_group(ranks)
        assert small.prefill_deadline_steps == 0 and small.deadline_steps == 0
    # The mixed-step cap widens for a rank alone only.
    assert SchedulerConfig().for_group(2).mixed_prompt_tokens is None
    # A value the user set is kept, alone or not.
    assert SchedulerConfig(prefill_deadline_steps=3).for_group(1).deadline_steps == 3
    assert SchedulerConfig(prefill_deadline_steps=3).for_group(2).deadline_steps == 3
    assert SchedulerConfig(prefill_deadline_steps=0).for_group(4).deadline_steps == 0


def test_policy_and_deadline_are_checked_and_group_agreed():
    with pytest.raises(ValueError, match="prefill_deadline_steps must be an int >= 0"):
        SchedulerConfig(prefill_deadline_steps=-1)
    with pytest.raises(ValueError, match="sync_policy must be one of"):
        SchedulerConfig(sync_policy="deadlines")
    agreed = SchedulerConfig(sync_policy="deadline", prefill_deadline_steps=5).group_agreed()
    assert agreed["sync_policy"] == "deadline" and agreed["prefill_deadline_steps"] == 5


# -- groups of schedulers on threads ----------------------------------------------------------
class Group:
    """N schedulers stepping in lock-step on threads, sharing an in-process MIN vote."""

    def __init__(self, num_ranks, rank_overrides=None, **overrides):
        self.votes = InProcessVoteGroup(num_ranks, timeout_s=20)
        rank_overrides = rank_overrides or {}
        self.ranks = [
            Scheduler(
                SchedulerConfig(**{**CONFIG, **overrides, **rank_overrides.get(r, {})}),
                vote=self.votes.member(r),
            )
            for r in range(num_ranks)
        ]
        self.trace = [[] for _ in range(num_ranks)]  # (step, kind, point, scheduled ids)
        self.finished = [{} for _ in range(num_ranks)]

    def run(self, steps, before_step=None, check_step=None):
        errors = []

        def loop(rank):
            sched = self.ranks[rank]
            try:
                for step in range(steps):
                    if before_step is not None:
                        before_step(rank, step, sched)
                    state = check_step(rank, sched, None) if check_step else None
                    out = sched.schedule()
                    if check_step is not None:
                        check_step(rank, sched, (state, out))
                    done = sched.process_outputs(out, [fake_token(s) for s in out.scheduled_seqs])
                    kind = out.kind.value
                    ids = [s.request_id for s in out.scheduled_seqs]
                    self.trace[rank].append((step, kind, out.point, ids))
                    for seq in [*done, *out.ignored_seqs]:
                        assert seq.request_id not in self.finished[rank], "reported twice"
                        self.finished[rank][seq.request_id] = (step, seq)
            except BaseException as exc:  # reported by the main thread
                errors.append(exc)
                self.votes.abort()

        threads = [threading.Thread(target=loop, args=(r,)) for r in range(len(self.ranks))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert not any(t.is_alive() for t in threads), "a rank hung"
        if errors:
            raise errors[0]
        kinds = [[(step, kind, point) for step, kind, point, _ in t] for t in self.trace]
        assert all(k == kinds[0] for k in kinds), "ranks disagreed on a step kind"
        return kinds[0]

    def prefills(self, rank, request_id):
        return [
            step
            for step, kind, _, ids in self.trace[rank]
            if kind == "prefill" and request_id in ids
        ]


@pytest.mark.parametrize("num_ranks", [2, 4])
def test_late_prompt_waits_exactly_the_deadline_and_votes_are_sparse(num_ranks):
    group = Group(num_ranks)
    for rank, sched in enumerate(group.ranks):
        sched.add_sequence(make_seq(f"long{rank}", 8, max_tokens=60))

    def arrive(rank, step, sched):
        if step == 10 and rank == num_ranks - 1:
            sched.add_sequence(make_seq("late", 8, max_tokens=3))

    kinds = group.run(40, before_step=arrive)
    # Ready from step 10, it sits out DEADLINE decode steps (10 .. 13): its prefill step is 14.
    assert group.prefills(num_ranks - 1, "late") == [10 + DEADLINE]
    assert [s for s, kind, _ in kinds if kind == "prefill"] == [0, 10 + DEADLINE]
    # Votes: step 0, the FOLLOW vote after each prefill step, and one look-out vote every
    # DEADLINE steps while nothing is ready; never a collective on the steps between.
    votes = [s for s, _, point in kinds if point is not AttemptPoint.NONE]
    assert votes == [0, 1, 5, 9, 13, 14, 15, 19, 23, 27, 31, 35, 39]
    assert kinds[14][2] is AttemptPoint.DUE and kinds[15][2] is AttemptPoint.FOLLOW
    assert group.votes.num_collectives == len(votes) + 2  # + vote 2 of the two prefill steps


def test_a_rank_alone_prefills_a_late_prompt_at_the_next_step():
    # prefill_deadline_steps as a rank alone resolves it: the prompt that arrives at step 10
    # is in the prefill (mixed) step 10 itself, where a group's deadline makes it sit out
    # DEADLINE decode steps (the test above); the vote to see it costs no collective alone.
    group = Group(1, prefill_deadline_steps=SchedulerConfig().for_group(1).deadline_steps)
    group.ranks[0].add_sequence(make_seq("long", 8, max_tokens=30))

    def arrive(rank, step, sched):
        if step == 10:
            sched.add_sequence(make_seq("late", 8, max_tokens=3))

    kinds = group.run(20, before_step=arrive)
    assert group.prefills(0, "late") == [10]
    assert [s for s, kind, _ in kinds if kind == "prefill"] == [0, 10]
    assert all(point is not AttemptPoint.NONE for _, _, point in kinds)  # a vote every step


@pytest.mark.parametrize("num_ranks", [2, 4])
def test_every_rank_ready_prefills_before_the_deadline(num_ranks):
    group = Group(num_ranks)
    for rank, sched in enumerate(group.ranks):
        sched.add_sequence(make_seq(f"long{rank}", 8, max_tokens=60))

    def arrive(rank, step, sched):
        if step == 3:
            sched.add_sequence(make_seq(f"new{rank}", 8, max_tokens=3))

    kinds = group.run(12, before_step=arrive)
    # The look-out vote at step 5 (decode step 4) finds every rank ready: prefill there,
    # one step before the deadline would have forced it.
    assert [s for s, kind, _ in kinds if kind == "prefill"] == [0, 5]


@pytest.mark.parametrize("num_ranks", [2, 4])
def test_idle_group_prefills_on_arrival(num_ranks):
    group = Group(num_ranks)

    def arrive(rank, step, sched):
        if rank == 0 and step in (3, 9):
            sched.add_sequence(make_seq(f"r{step}", 5, max_tokens=2))

    kinds = group.run(14, before_step=arrive)
    assert kinds[2][1] == "empty" and kinds[3][1] == "prefill" and kinds[9][1] == "prefill"


def test_burst_is_served_in_one_run_of_prompt_steps():
    # Rank 0 queues more prompt tokens than one step holds: after the first prefill step the
    # FOLLOW vote sees the backlog and goes on, so decoding sequences see one gap, not two.
    group = Group(2, max_num_batched_tokens=64)
    for rank, sched in enumerate(group.ranks):
        sched.add_sequence(make_seq(f"long{rank}", 8, max_tokens=40))

    def arrive(rank, step, sched):
        if step == 2 and rank == 0:
            for i in range(3):
                sched.add_sequence(make_seq(f"b{i}", 40, max_tokens=3))

    kinds = group.run(20, before_step=arrive)
    prefills = [s for s, kind, _ in kinds if kind == "prefill"]
    assert prefills == [0, 2 + DEADLINE, 3 + DEADLINE]
    assert kinds[3 + DEADLINE][2] is AttemptPoint.FOLLOW


def test_chunked_prompt_goes_on_at_once_once_due():
    # A prompt of 3 chunks admitted at its deadline keeps its wait: each next chunk is due at
    # the FOLLOW vote, so the chunks run back to back instead of a deadline apart.
    group = Group(2, max_num_batched_tokens=16)
    for rank, sched in enumerate(group.ranks):
        sched.add_sequence(make_seq(f"long{rank}", 8, max_tokens=40))

    def arrive(rank, step, sched):
        if step == 2 and rank == 1:
            sched.add_sequence(make_seq("chunked", 40, max_tokens=2))

    group.run(20, before_step=arrive)
    start = 2 + DEADLINE
    assert group.prefills(1, "chunked") == [start, start + 1, start + 2]


def test_head_waiting_for_a_slot_starts_its_clock_when_the_slot_frees():
    # Rank 1 may run one sequence: its head is not ready while "first" runs, so no deadline
    # runs out; once "first" ends the head is ready and waits the deadline from there.
    group = Group(2, rank_overrides={1: {"max_num_seqs": 1}})
    group.ranks[0].add_sequence(make_seq("busy", 8, max_tokens=40))
    group.ranks[1].add_sequence(make_seq("first", 8, max_tokens=12))
    group.ranks[1].add_sequence(make_seq("second", 8, max_tokens=3))
    group.run(30)
    first_done = group.finished[1]["first"][0]  # its last token's step
    assert group.prefills(1, "second") == [first_done + 1 + DEADLINE]


def test_head_larger_than_the_pool_is_ended_even_on_an_idle_group():
    group = Group(2, rank_overrides={1: {"num_blocks": 8}})
    group.ranks[1].add_sequence(make_seq("huge", 40, max_tokens=2))  # 10 blocks > 7 usable
    kinds = group.run(3)
    assert group.finished[1]["huge"][1].finish_reason == "prompt_length_exceeded"
    assert all(kind == "empty" for _, kind, _ in kinds)


# -- the bound, over random traffic -----------------------------------------------------------
def ready_head(sched: Scheduler):
    """The head a prefill would start with now, by the bound's definition (not the policy's
    bookkeeping): the first queued sequence that is neither ended nor doomed to be ended. In
    mixed steps it must fit beside the blocks the running sequences' next tokens take."""
    config = sched.config
    running = sum(not seq.is_finished for seq in sched.running)
    for seq in sched.waiting:
        if seq.is_finished:
            continue
        if not seq.schedulable or running >= config.max_num_seqs:
            return None
        if seq.block_table:  # mid-chunk: holds its blocks, the watermark does not apply
            return seq
        if sched.kv.usage() > config.prefill_watermark:
            return None
        reserve = sched.decode_block_demand() if config.mixed else 0
        status = sched.kv.plan_admission(seq, reserve).status
        if status is AllocStatus.NEVER:
            continue  # ended by the next schedule()
        return seq if status is AllocStatus.OK else None
    return None


traffic = st.lists(
    st.tuples(
        st.integers(0, 3),  # rank
        st.integers(1, 40),  # prompt length
        st.integers(1, 12),  # max_tokens
        st.integers(0, 60),  # arrival step
        st.one_of(st.none(), st.integers(0, 80)),  # abort step
        st.booleans(),  # schedulable at arrival (released 15 steps later)
    ),
    min_size=1,
    max_size=24,
)
pools = st.fixed_dictionaries(
    {
        "num_blocks": st.integers(12, 64),
        "max_num_seqs": st.integers(1, 6),
        "max_num_batched_tokens": st.sampled_from([8, 16, 32, 64]),
        "chunked_prefill": st.just(True),
        "num_state_slots": st.sampled_from([0, 3]),
        "stop_preempted_request": st.booleans(),
        "prefill_watermark": st.sampled_from([0.6, 0.9, 1.0]),
        "prefill_deadline_steps": st.integers(0, 6),
        "mixed_steps": st.booleans(),
        "mixed_prompt_tokens": st.sampled_from([4, 8, 64]),
    }
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(plan=traffic, pool=pools, rank_pool=st.integers(0, 3))
def test_no_ready_head_waits_past_the_deadline(plan, pool, rank_pool):
    # One rank gets a smaller pool, so ranks differ in when they can admit.
    small = {rank_pool: {"num_blocks": max(12, pool["num_blocks"] // 2)}}
    group = Group(4, rank_overrides=small, block_size=4, max_model_len=64, **pool)
    deadline = pool["prefill_deadline_steps"]
    watch = [{"seq": None, "sat_out": 0} for _ in range(4)]
    violations = []

    def before_step(rank, step, sched):
        for index, (r, length, max_tokens, arrival, abort, schedulable) in enumerate(plan):
            if r != rank:
                continue
            rid = f"q{index}"
            if arrival == step:
                sched.add_sequence(
                    make_seq(rid, length, max_tokens=max_tokens, schedulable=schedulable)
                )
            if arrival + 15 == step and sched.get_sequence(rid) is not None:
                sched.set_schedulable(rid)
            if abort == step:
                sched.abort(rid)

    def check_step(rank, sched, after):
        mine = watch[rank]
        if after is None:  # before schedule(): who is ready now, and since when
            head = ready_head(sched)
            if head is not mine["seq"]:
                mine["seq"], mine["sat_out"] = head, 0
            return head
        head, out = after
        if head is None:
            return None
        if mine["sat_out"] >= deadline and head not in out.scheduled_seqs:
            violations.append((rank, sched.step_index - 1, head.request_id, mine["sat_out"]))
        if not out.is_prefill:
            mine["sat_out"] += 1
        return None

    group.run(140, before_step=before_step, check_step=check_step)
    assert not violations, f"ready heads waited past the deadline: {violations[:5]}"
    for sched in group.ranks:
        sched.check_integrity()


# -- readiness is the assembly's own dry run ---------------------------------------------------
@settings(max_examples=300, deadline=None)
@given(
    num_blocks=st.integers(4, 40),
    max_num_seqs=st.integers(1, 6),
    prompts=st.lists(st.integers(1, 60), min_size=1, max_size=8),
    num_running_steps=st.integers(0, 12),
    mixed=st.booleans(),
    sum_k=st.sampled_from([None, 64, 128]),
    watermark=st.sampled_from([0.5, 0.8, 1.0]),
)
# Two states (found by a search) where the head fits only without the blocks the decode
# tokens of a mixed step take first: readiness must set them aside.
@example(28, 3, [41, 53, 60], 8, True, None, 1.0)
@example(22, 2, [19, 56, 58, 20, 40, 8], 6, True, None, 1.0)
# A sequence that ended at max_model_len in the last step, not yet swept from running.
@example(20, 3, [1, 48, 57], 12, True, None, 0.5)
def test_a_ready_head_is_the_first_sequence_its_assembly_takes(
    num_blocks, max_num_seqs, prompts, num_running_steps, mixed, sum_k, watermark
):
    """Whatever the pool, slots, running sequences and limits, a head `_ready_head` finds is
    the first sequence the real assembly takes (mixed steps: after the decode tokens)."""
    import copy

    from scheduler.prefill import assemble_prefill

    config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=64,
        max_model_len=60,
        block_size=4,
        num_blocks=num_blocks,
        sync_policy="deadline",
        mixed_steps=mixed,
        prefill_max_sum_seqlen_k=sum_k,
        prefill_watermark=watermark,
    )
    sched = Scheduler(config)
    for index, length in enumerate(prompts):
        sched.add_sequence(make_seq(f"r{index}", length, max_tokens=50))
    for _ in range(num_running_steps):  # some prompts start and decode, holding blocks
        outputs = sched.schedule()
        sched.process_outputs(outputs, [fake_token(seq) for seq in outputs.scheduled_seqs])
    # As `schedule` runs it: after the sweep that drops the sequences the last step ended
    # (without it, a decode below would still count one that ended at max_model_len).
    if sched._needs_sweep:
        sched._sweep()
    ready = sched._ready_head()
    if ready is None:
        return
    trial = copy.deepcopy(sched)
    if mixed and trial.running:
        trial._decode(known_empty=False)  # a mixed step's decode tokens take their blocks first
    batch = assemble_prefill(
        trial.waiting, len(trial.running), trial.kv, trial.config, trial._terminate
    )
    assert batch.seqs and batch.seqs[0].request_id == ready.request_id
