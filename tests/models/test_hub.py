"""Hub ids through huggingface_hub's cache: a pre-filled cache directory stands for the hub
(there is no network here), laid out as huggingface_hub lays it out."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from dist_engine.models.hub import is_hub_id, resolve_model

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
