"""The one registry idiom (scheduler/registry.py), and the four registries built on it."""

import sys

import pytest

from scheduler import GroupView, SamplingParams, Scheduler, SchedulerConfig, Sequence
from scheduler.registry import Lazy, Registry
from scheduler.vote import SYNC_POLICIES, AttemptPoint, PolicyState


def test_a_lazy_entry_is_imported_only_when_chosen():
    registry = Registry("thing", {"json": Lazy("json:dumps"), "plain": len})
    sys.modules.pop("json.tool", None)
    lazy = Registry("tool", {"tool": Lazy("json.tool:main")})
    assert "json.tool" not in sys.modules  # registering imports nothing
    assert callable(lazy.get("tool")) and "json.tool" in sys.modules
    assert registry.get("plain") is len
    assert registry.get("json")([1]) == "[1]"
    assert registry.names() == ("json", "plain") and "json" in registry


def test_an_unknown_name_is_refused_naming_the_setting_and_the_choices():
    registry = Registry("routing", {"round_robin": 1, "least_loaded": 2})
    with pytest.raises(ValueError, match=r"unsupported routing 'fastest'; supported: "):
        registry.get("fastest")
    with pytest.raises(ValueError, match=r"server.routing must be one of \['round_robin', "):
        registry.check("server.routing", "fastest")
    with pytest.raises(ValueError, match="unsupported routing 3"):
        registry.get(3)


def test_models_backends_and_policies_are_registries():
    from dist_engine.attention import ATTENTION_BACKENDS
    from dist_engine.models.registry import ARCHITECTURES
    from launcher.routing import ROUTING_POLICIES

    for registry in (ARCHITECTURES, ROUTING_POLICIES, SYNC_POLICIES, *ATTENTION_BACKENDS.values()):
        assert isinstance(registry, Registry)
    assert set(SYNC_POLICIES) == {"vote", "every_step", "deadline"}


def test_each_sync_policy_name_gets_its_own_policy():
    """Told apart by what they decide, not by their attributes: at decode step 5 (off vote's
    70/100 intervals, the step deadline's last vote scheduled) vote does not vote, every_step
    does, deadline's look-out vote falls due; only deadline's schedulers vote with readiness."""
    state = PolicyState(
        decode_step=5,
        group_idle=False,
        drain_step=None,
        next_vote=5,
        all_interval=70,
        any_interval=100,
        deadline=2,
    )
    points = {name: SYNC_POLICIES.get(name).point(state) for name in SYNC_POLICIES}
    assert points == {
        "vote": AttemptPoint.NONE,
        "every_step": AttemptPoint.EVERY,
        "deadline": AttemptPoint.DUE,
    }

    def first_vote(policy: str) -> GroupView:
        config = SchedulerConfig(sync_policy=policy, max_model_len=64, block_size=4, num_blocks=32)
        sched = Scheduler(config)
        sched.add_sequence(Sequence("r", [1, 2, 3], SamplingParams(max_tokens=2)))
        return GroupView.from_vector(next(sched.plan()))  # step 0 votes under every policy

    for policy, tracks_readiness in (("deadline", True), ("every_step", False), ("vote", False)):
        view = first_vote(policy)
        assert view.any_want, policy  # the head is schedulable under every policy
        assert view.all_ready is tracks_readiness, policy
        assert view.max_ready_wait == (0 if tracks_readiness else -1), policy
