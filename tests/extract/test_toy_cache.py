"""The toy models' shared cache (``PYSPARK_SAFETENSORS_TOY_CACHE``): a model asked for by
several processes at once is trained once, by one of them, and every one gets its bytes."""

import threading
import time

from pyspark_safetensors.extract.toy_lm import CACHE_ENV, cached_toy


def _trainer(calls: list):
    def train(directory):
        calls.append(directory)
        time.sleep(0.5)  # long enough that the others ask while it trains
        (directory / "model.safetensors").write_bytes(b"weights %d" % len(calls))

    return train


def test_asked_for_at_once_it_is_trained_once_and_copied_to_each_root(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    calls, finals = [], [tmp_path / f"root{i}" / "toy-x" for i in range(3)]
    # each thread opens the lock file itself: flock locks of separate opens exclude
    # each other as those of separate processes do
    threads = [
        threading.Thread(target=cached_toy, args=(final, "toy-x-0123", _trainer(calls)))
        for final in finals
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and calls[0].parent == tmp_path / "cache"
    for final in finals:
        assert (final / "model.safetensors").read_bytes() == b"weights 1"
    (cached,) = [p for p in (tmp_path / "cache").iterdir() if p.is_dir()]
    assert cached.name.startswith("toy-x-0123-threads")
    # a later process copies it too; another key trains its own
    assert cached_toy(tmp_path / "later" / "toy-x", "toy-x-0123", _trainer(calls)).is_dir()
    cached_toy(tmp_path / "other" / "toy-y", "toy-y-4567", _trainer(calls))
    assert len(calls) == 2 and (tmp_path / "other" / "toy-y" / "model.safetensors").is_file()


def test_without_the_variable_each_root_trains_its_own(tmp_path, monkeypatch):
    monkeypatch.delenv(CACHE_ENV, raising=False)
    calls = []
    for root in ("a", "b"):
        final = cached_toy(tmp_path / root / "toy-x", "toy-x-0123", _trainer(calls))
        assert (final / "model.safetensors").is_file()
    assert [c.parent for c in calls] == [tmp_path / "a", tmp_path / "b"]  # staged in place
