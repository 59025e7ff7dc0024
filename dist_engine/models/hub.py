"""A model named by its Hugging Face hub id (``org/name``, with a revision) -> a local directory.

Resolution goes through `huggingface_hub`'s cache and `snapshot_download`, which honour
``HF_HOME`` / ``HF_HUB_CACHE`` (where the cache is), ``HF_HUB_OFFLINE`` (no network: the
cache only) and ``HF_TOKEN`` (gated repositories). The driver resolves a model before any rank
starts and pins the revision to the commit it found, so every rank loads the same files: on
the driver's host the ranks use the driver's snapshot (one download for the host), and a rank
on another host resolves the same commit into its own host's cache (`EngineConfig.
with_local_model` does both; huggingface_hub's file locks make the ranks of one host share a
download). Only the files a model needs are fetched (`MODEL_FILES`); a rank then reads only
its own tensors from them.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

# What a checkpoint directory needs: config, weights, tokenizer, chat template, generation
# defaults. Not the rest of a repository (PyTorch .bin duplicates, ONNX, images, READMEs).
MODEL_FILES = (
    "*.json",
    "*.safetensors",
    "*.jinja",
    "*.model",  # SentencePiece tokenizers
    "*.tiktoken",
    "*.txt",  # merges.txt, vocab.txt
)
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*(/[A-Za-z0-9][\w.\-]*)?$")


@dataclass(frozen=True)
class ResolvedModel:
    path: str  # a local checkpoint directory
    repo_id: str | None = None  # the hub id it came from, if any
    commit: str | None = None  # the commit it is pinned to, if any


def is_hub_id(model: str) -> bool:
    """Whether ``model`` names a hub repository rather than a directory on this host."""
    return not Path(model).expanduser().exists() and bool(_REPO_ID.match(model))


def resolve_model(model: str, revision: str | None = None) -> ResolvedModel:
    """A local directory for ``model``: the directory itself, or the cached (or downloaded)
    snapshot of hub repository ``model`` at ``revision`` (a branch, tag or commit; default
    the repository's main branch). Raises FileNotFoundError with what to do when it cannot."""
    directory = Path(model).expanduser()
    if directory.exists():
        if revision is not None:
            raise ValueError(
                f"model {model!r} is a local directory; revision {revision!r} applies to hub "
                "ids only"
            )
        return ResolvedModel(str(directory))
    if not _REPO_ID.match(model):
        raise FileNotFoundError(
            f"model directory {model!r} does not exist (and it is not a hub id like org/name)"
        )
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    where = f"hub model {model!r}" + (f" at revision {revision!r}" if revision else "")
    download = f"hf download {model}" + (f" --revision {revision}" if revision else "")
    try:
        path = snapshot_download(model, revision=revision, allow_patterns=list(MODEL_FILES))
    except LocalEntryNotFoundError:
        raise FileNotFoundError(
            f"{where} is not in the Hugging Face cache ({_cache_dir()}) and the hub cannot be "
            f"reached{' (HF_HUB_OFFLINE is set)' if _offline() else ''}: download it first "
            f"(`{download}`), or give a local directory"
        ) from None
    except GatedRepoError:
        raise FileNotFoundError(
            f"{where} is gated: accept its terms on the hub and set HF_TOKEN"
        ) from None
    except RevisionNotFoundError:
        raise FileNotFoundError(f"{where}: the repository has no such revision") from None
    except RepositoryNotFoundError:
        raise FileNotFoundError(
            f"{where} does not exist on the hub (or is private: set HF_TOKEN)"
        ) from None
    commit = Path(path).name  # a snapshot directory is named by its commit
    return ResolvedModel(str(path), repo_id=model, commit=commit)


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def _cache_dir() -> str:
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)
