"""FollowingBatches: training batches from a dataset that grows while it is read. The
dataset is appended to with the project's own DatasetBuilder, from a thread or between
loader steps; no Spark."""

import threading
import time

import numpy as np
import pytest

from pyspark_safetensors.dataset import DatasetBuilder, DatasetReplacedError, mark_complete
from pyspark_safetensors.torch import FollowingBatches, FollowTimeoutError
from pyspark_safetensors.torch.loader import MisalignedDatasetsError

ROWS_PER_SHARD = 50


def append(root, first, n, *, overwrite=False):
    """Commit rows ``first .. first + n`` (sample_id = row, activation = row + column / 10)."""
    with DatasetBuilder(root, batch_size=ROWS_PER_SHARD, overwrite=overwrite) as build:
        for a in range(first, first + n, ROWS_PER_SHARD):
            ids = np.arange(a, min(a + ROWS_PER_SHARD, first + n), dtype=np.int64)
            acts = (ids[:, None] + np.arange(4)[None, :] / 10).astype(np.float32)
            build.add_batch({"activation": acts, "sample_id": ids})


def follower(root, batch_size=16, **options):
    return FollowingBatches(
        root, batch_size, poll_interval_s=0.01, timeout_s=options.pop("timeout_s", 5.0), **options
    )


def ids(batches):
    return np.concatenate([b["sample_id"].numpy() for b in batches]).tolist()


def test_every_row_once_as_commits_land_from_a_thread(tmp_path):
    root = tmp_path / "acts"
    sizes = [70, 130, 10, 200, 45]

    def produce():
        first = 0
        for n in sizes:
            time.sleep(0.05)
            append(root, first, n)
            first += n
        mark_complete(root)

    writer = threading.Thread(target=produce)
    writer.start()
    loader = follower(root)
    batches = list(loader)  # waits for the first commit, then follows to the end
    writer.join()
    got = ids(batches)
    assert sorted(got) == list(range(sum(sizes)))
    assert got != sorted(got)  # shuffled within what was available
    assert all(len(b["sample_id"]) == 16 for b in batches[:-1]) and loader.finished
    first = batches[0]
    assert np.allclose(first["activation"][:, 1].numpy(), first["sample_id"].numpy() + 0.1)


def test_waits_when_consumed_and_resumes_exactly(tmp_path):
    root = tmp_path / "acts"
    append(root, 0, 100)
    loader = follower(root, timeout_s=0.2)
    it = iter(loader)
    head = [next(it) for _ in range(6)]  # 96 of the 100 rows: no full batch left
    with pytest.raises(FollowTimeoutError, match="no new rows"):
        next(it)
    state = loader.state_dict()

    append(root, 100, 150)  # it waits; a commit lands; a new process picks up from the state
    resumed = follower(root)
    resumed.load_state_dict(state)
    mark_complete(root)
    tail = list(resumed)
    assert sorted(ids(head) + ids(tail)) == list(range(250))

    # the same run uninterrupted (the same commits between the same steps) gives the same order
    again = tmp_path / "again"
    append(again, 0, 100)
    uninterrupted = follower(again, timeout_s=0.2)
    it = iter(uninterrupted)
    first = [next(it) for _ in range(6)]
    append(again, 100, 150)
    mark_complete(again)
    assert ids(first) + ids(it) == ids(head) + ids(tail)


def test_a_waiting_follower_wakes_when_a_commit_lands(tmp_path):
    root = tmp_path / "acts"
    append(root, 0, 40)
    loader = follower(root, timeout_s=10.0)
    it = iter(loader)
    assert len(ids([next(it), next(it)])) == 32
    timer = threading.Timer(0.2, append, (root, 40, 60))
    started = time.monotonic()
    timer.start()
    nxt = next(it)  # 8 rows left: it waits for the commit
    assert time.monotonic() - started >= 0.15 and len(nxt["sample_id"]) == 16
    timer.join()


def test_stops_at_the_budget(tmp_path):
    root = tmp_path / "acts"
    append(root, 0, 300)
    loader = follower(root, max_samples=100, timeout_s=0.5)
    batches = list(loader)  # not complete, yet it ends: the budget is reached
    assert sum(len(b["sample_id"]) for b in batches) == 100 and loader.finished
    assert len(set(ids(batches))) == 100


def test_stops_at_complete_after_the_last_row(tmp_path):
    root = tmp_path / "acts"
    append(root, 0, 90)
    mark_complete(root)
    loader = follower(root, timeout_s=0.5)
    batches = list(loader)
    assert [len(b["sample_id"]) for b in batches] == [16] * 5 + [10]
    assert sorted(ids(batches)) == list(range(90))
    assert list(loader) == []  # finished: a second pass yields nothing
    dropped = follower(root, drop_last=True)
    assert [len(b["sample_id"]) for b in dropped] == [16] * 5
    ahead = follower(root, lookahead=True)
    assert [ahead.finished for _ in ahead] == [False] * 5 + [True]  # known as it comes out


def test_lookahead_holds_a_batch_until_the_next_is_committed_or_the_data_ends(tmp_path):
    root = tmp_path / "acts"
    append(root, 0, 32)
    loader = follower(root, lookahead=True, timeout_s=10.0)
    it = iter(loader)
    next(it)  # the second batch is committed: the first comes out at once
    timer = threading.Timer(0.2, mark_complete, (root,))
    started = time.monotonic()
    timer.start()
    next(it)  # the third is not: it comes out once the data is known to end here
    assert time.monotonic() - started >= 0.15 and loader.finished
    assert list(it) == []
    timer.join()


def drain(loader):
    """The batches a follower yields before it would wait (its timeout is short)."""
    out = []
    with pytest.raises(FollowTimeoutError):
        for batch in loader:  # iterating again continues where the last pass stopped
            out.append(batch)
    return out


@pytest.mark.parametrize("ranks", [2, 3])
def test_ranks_see_disjoint_rows_whose_union_is_everything(tmp_path, ranks):
    root = tmp_path / "acts"
    loaders = [follower(root, dp_rank=r, dp_size=ranks, timeout_s=0.02) for r in range(ranks)]
    seen = [[] for _ in range(ranks)]
    first = 0
    for n in (60, 95, 33, 121):  # each rank reads what it can between commits
        append(root, first, n)
        first += n
        for r in range(ranks):
            seen[r] += drain(loaders[r])
    mark_complete(root)
    for r in range(ranks):
        seen[r] += list(loaders[r])
    rows = [ids(s) for s in seen]
    assert sorted(i for r in rows for i in r) == list(range(first))
    assert len({len(s) for s in seen}) == 1  # every rank takes the same number of steps
    for r in range(ranks):
        assert all(i % ranks == r for i in rows[r])


def test_a_staged_shard_is_never_read(tmp_path):
    root = tmp_path / "acts"
    append(root, 0, 32)
    build = DatasetBuilder(root, batch_size=ROWS_PER_SHARD)
    ids_staged = np.arange(32, 82, dtype=np.int64)
    build.add_batch({"activation": np.zeros((50, 4), np.float32), "sample_id": ids_staged})
    assert len(list(root.glob("part-*.safetensors"))) == 2  # on disk, in no manifest
    loader = follower(root, timeout_s=0.3)
    it = iter(loader)
    assert sorted(ids([next(it), next(it)])) == list(range(32))
    with pytest.raises(FollowTimeoutError):
        next(it)  # the staged rows are not there for it
    assert loader.view.rows == 32
    build.commit()
    mark_complete(root)
    assert sorted(ids(list(loader))) == list(range(32, 82))  # iterating again continues


def test_an_overwrite_stops_the_follower(tmp_path):
    root = tmp_path / "acts"
    append(root, 0, 64)
    loader = follower(root)
    it = iter(loader)
    assert len([next(it) for _ in range(4)]) == 4  # every committed row
    append(root, 0, 100, overwrite=True)
    with pytest.raises(DatasetReplacedError, match="overwritten"):
        next(it)


def test_row_aligned_datasets_follow_their_common_commits(tmp_path):
    x, y = tmp_path / "x", tmp_path / "y"
    append(x, 0, 100)
    append(y, 0, 50)  # the target's second shard is not committed yet
    loader = FollowingBatches(
        {"x": (x, "activation"), "y": (y, "activation")},
        10,
        poll_interval_s=0.01,
        timeout_s=0.3,
    )
    it = iter(loader)
    head = [next(it) for _ in range(5)]
    with pytest.raises(FollowTimeoutError):
        next(it)
    append(y, 50, 50)
    mark_complete(x)
    mark_complete(y)
    batches = head + list(loader)  # iterating again continues
    assert sum(len(b["x"]) for b in batches) == 100
    for b in batches:
        assert np.array_equal(b["x"].numpy(), b["y"].numpy())


def test_complete_datasets_that_are_not_row_aligned_are_refused(tmp_path):
    x, y = tmp_path / "x", tmp_path / "y"
    append(x, 0, 100)  # two shards of 50
    with DatasetBuilder(y, batch_size=100) as build:  # the same rows in one shard
        build.add_batch({"activation": np.zeros((100, 4), np.float32)})
    mark_complete(x)
    mark_complete(y)
    loader = FollowingBatches({"x": (x, "activation"), "y": (y, "activation")}, 10)
    with pytest.raises(MisalignedDatasetsError, match="not row-aligned"):
        list(loader)
