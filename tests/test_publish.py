"""dataset.publish: outputs appear whole, and an old output is never lost first."""

import os

import pytest

from pyspark_safetensors.dataset.publish import publish, publishing, staging_path


def test_directory_replaces_old_only_when_new_is_in_place(tmp_path):
    final = tmp_path / "out"
    final.mkdir()
    (final / "old.txt").write_text("old")
    with publishing(final) as tmp:
        (tmp / "new.txt").write_text("new")
        assert (final / "old.txt").read_text() == "old"  # still there while building
    assert sorted(p.name for p in final.iterdir()) == ["new.txt"]
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no staging or aside left


def test_failure_leaves_old_output_and_nothing_beside_it(tmp_path):
    final = tmp_path / "out"
    final.mkdir()
    (final / "old.txt").write_text("old")
    with pytest.raises(RuntimeError), publishing(final) as tmp:
        (tmp / "partial.txt").write_text("x")
        raise RuntimeError("boom")
    assert (final / "old.txt").read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_failed_move_restores_the_old_directory(tmp_path, monkeypatch):
    final = tmp_path / "out"
    final.mkdir()
    (final / "old.txt").write_text("old")
    staged = staging_path(final)
    staged.mkdir()
    real = os.replace
    calls = []

    def flaky(src, dst):
        calls.append((src, dst))
        if len(calls) == 2:  # the move of the new output into place
            raise OSError("disk gone")
        return real(src, dst)

    monkeypatch.setattr(os, "replace", flaky)
    with pytest.raises(OSError, match="disk gone"):
        publish(staged, final)
    assert (final / "old.txt").read_text() == "old"


def test_file_publish_is_a_replace(tmp_path):
    final = tmp_path / "a.json"
    final.write_text("1")
    with publishing(final, directory=False) as tmp:
        tmp.write_text("2")
    assert final.read_text() == "2"
    assert [p.name for p in tmp_path.iterdir()] == ["a.json"]
