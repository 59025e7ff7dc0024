"""The one registry idiom (scheduler/registry.py), and the four registries built on it."""

import sys

import pytest

from scheduler.registry import Lazy, Registry


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
    from scheduler.vote import SYNC_POLICIES

    for registry in (ARCHITECTURES, ROUTING_POLICIES, SYNC_POLICIES, *ATTENTION_BACKENDS.values()):
        assert isinstance(registry, Registry)
    assert set(SYNC_POLICIES) == {"vote", "every_step", "deadline"}
    assert SYNC_POLICIES.get("deadline").tracks_readiness
    assert not SYNC_POLICIES.get("every_step").tracks_readiness
