"""Hub ids through huggingface_hub's cache: a pre-filled cache directory stands for the hub
(there is no network here), laid out as huggingface_hub lays it out."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from dist_engine.engine.config import EngineConfig
from dist_engine.engine.engine import DPEngine
from dist_engine.models.hub import is_hub_id, resolve_model
from scheduler import SamplingParams

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def hub_cache(model_dir, tmp_path, monkeypatch) -> Path:
    """HF_HOME with `org/tiny` cached at COMMIT (refs/main and tag v1 point to it), offline."""
    home = tmp_path / "hf"
    repo = home / "hub" / "models--org--tiny"
    shutil.copytree(model_dir, repo / "snapshots" / COMMIT)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    (repo / "refs" / "v1").write_text(COMMIT)
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return repo


def test_a_hub_id_resolves_to_its_cached_snapshot_pinned_to_the_commit(hub_cache):
    for revision in (None, "main", "v1", COMMIT):
        resolved = resolve_model("org/tiny", revision)
        assert Path(resolved.path) == hub_cache / "snapshots" / COMMIT
        assert (resolved.repo_id, resolved.commit) == ("org/tiny", COMMIT)
    assert (Path(resolved.path) / "config.json").is_file()


def test_a_directory_is_itself(model_dir):
    assert resolve_model(model_dir).path == model_dir and not is_hub_id(model_dir)
    assert is_hub_id("org/name") and is_hub_id("gpt2") and not is_hub_id("/no/such/dir")
    with pytest.raises(ValueError, match="applies to hub ids only"):
        resolve_model(model_dir, revision="main")


@pytest.mark.usefixtures("hub_cache")
def test_offline_errors_say_what_is_missing_and_what_to_do():
    with pytest.raises(FileNotFoundError, match=r"hub model 'org/other' is not in the Hugging"):
        resolve_model("org/other")
    with pytest.raises(FileNotFoundError, match=r"at revision 'v2' is not in .*HF_HUB_OFFLINE"):
        resolve_model("org/tiny", "v2")
    with pytest.raises(FileNotFoundError, match="hf download org/other"):
        resolve_model("org/other")
    with pytest.raises(FileNotFoundError, match="not a hub id"):
        resolve_model("/no/such/dir")


# -- what the driver records, and a rank on another host ----------------------------------------
def test_the_driver_pins_a_hub_id_to_its_snapshot_and_commit(hub_cache, model_dir):
    config = EngineConfig(model="org/tiny", revision="v1").with_local_model()
    snapshot = str(hub_cache / "snapshots" / COMMIT)
    assert (config.model, config.revision, config.hub_id) == (snapshot, COMMIT, "org/tiny")
    assert config.with_local_model() is config  # on the driver's host: nothing more to do
    assert EngineConfig(model="org/tiny").with_local_model() == config  # main is that commit
    directory = EngineConfig(model=model_dir)
    assert directory.with_local_model() is directory
    with pytest.raises(ValueError, match="applies to hub ids only"):
        EngineConfig(model=model_dir, revision="main").with_local_model()
    with pytest.raises(FileNotFoundError, match=r"'org/tiny' at revision 'v2' is not in"):
        EngineConfig(model="org/tiny", revision="v2").with_local_model()
    with pytest.raises(ValueError, match="revision must be a non-empty string or null"):
        EngineConfig(model="org/tiny", revision="")


def _greedy(config: EngineConfig) -> tuple[str, list[int]]:
    """The model directory a single-rank engine loaded, and its greedy tokens for a prompt."""
    outputs = []
    engine = DPEngine(config, on_output=outputs.append)
    engine.submit("r", [5, 9, 13, 17], SamplingParams(max_tokens=6, ignore_eos=True))
    while not any(output.finished for output in outputs):
        engine.step()
    return engine.config.model, outputs[-1].output_token_ids


def test_a_rank_on_another_host_loads_the_same_commit_from_its_own_cache(
    hub_cache, model_dir, tmp_path, monkeypatch
):
    """The driver's snapshot directory does not exist on the rank's host: the rank resolves
    the recorded hub id at the pinned commit into its own host's cache, and runs alike."""
    driver = EngineConfig(model="org/tiny").with_local_model()
    other_home = tmp_path / "other-host-hf"
    shutil.copytree(hub_cache.parent.parent, other_home)  # that host's pre-filled cache
    shutil.rmtree(hub_cache)  # ... which is all that host has
    monkeypatch.setenv("HF_HOME", str(other_home))
    import huggingface_hub.constants as constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(other_home / "hub"))
    loaded, tokens = _greedy(driver)
    assert loaded == str(other_home / "hub" / "models--org--tiny" / "snapshots" / COMMIT)
    assert not Path(driver.model).exists()
    assert tokens == _greedy(EngineConfig(model=model_dir))[1]
