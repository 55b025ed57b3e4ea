"""The Python sink's exactly-once under fire: a streaming driver (rate source into the
sink, the Python source's and the JVM source's) is killed with SIGKILL at random points — starting, mid-batch, mid-commit — and
restarted from its checkpoint, ``KILLS`` times; then a last run ends cleanly. Every input
row must be in the dataset exactly once, and the directory must hold only what the
manifest lists. Minutes long: marked ``soak``, deselected by default (``-m soak`` runs it;
``.ci/run`` does, as a stage of its own)."""

import os
import random
import select
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from safetensors.numpy import load_file

from pyspark_safetensors.dataset import load_manifest

# no module-wide python_source mark: on Spark 3.5 the JVM sink's soak still runs
pytestmark = [pytest.mark.soak, pytest.mark.spark]

KILLS = 20
ROWS_PER_BATCH = 40
LINE_TIMEOUT = 180

DRIVER = textwrap.dedent(
    """
    import sys
    from pyspark_safetensors.spark.session import local_session

    from pyspark.sql.streaming import StreamingQueryListener

    class Progress(StreamingQueryListener):  # a line per finished micro-batch
        def onQueryStarted(self, event):
            pass

        def onQueryProgress(self, event):
            print("progress", event.progress.batchId, flush=True)

        def onQueryIdle(self, event):
            pass

        def onQueryTerminated(self, event):
            pass

    out, checkpoint, mode, implementation = sys.argv[1:5]
    spark = local_session("local[2]", **{"spark.ui.enabled": "false"})
    spark.streams.addListener(Progress())
    writer = (
        spark.readStream.format("rate-micro-batch").option("rowsPerBatch", ROWS).load()
        .selectExpr("value AS id", "array(CAST(value AS FLOAT), CAST(value AS FLOAT) / 2) AS x")
        .writeStream.format("safetensors").option("implementation", implementation)
        .option("batch_size", 16).option("checkpointLocation", checkpoint)
    )
    if mode == "forever":
        query = writer.trigger(processingTime="0 seconds").start(out)
        print("started", flush=True)
        query.awaitTermination()
    else:  # one clean run to the end of what the source has
        writer.trigger(availableNow=True).start(out).awaitTermination()
    """
).replace("ROWS", str(ROWS_PER_BATCH))


def run(script, out, checkpoint, mode, implementation, kill_after=None, after_batches=0):
    """Run the driver to its end, or kill its process group ``kill_after`` seconds after
    its query started and ``after_batches`` micro-batches finished."""
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable, "PYSPARK_DRIVER_PYTHON": sys.executable}
    proc = subprocess.Popen(
        [sys.executable, str(script), str(out), str(checkpoint), mode, implementation],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # the driver, its JVM and Python workers: one group to kill
    )
    if kill_after is None:
        proc.communicate(timeout=600)
        assert proc.returncode == 0
        return
    for _ in range(1 + after_batches):  # "started", then a line per finished batch
        ready, _, _ = select.select([proc.stdout], [], [], LINE_TIMEOUT)
        if not ready or not proc.stdout.readline():
            break  # stuck or dead: kill it anyway
    time.sleep(kill_after)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


@pytest.mark.parametrize("implementation", ["python", pytest.param("jvm", marks=pytest.mark.jvm)])
def test_sigkilled_driver_restarted_from_its_checkpoint_writes_every_row_once(
    tmp_path, implementation
):
    if implementation == "jvm":
        from pyspark_safetensors.spark.shim import shim_jar

        try:
            shim_jar()
        except FileNotFoundError as e:
            pytest.skip(str(e))
    script, out, ck = tmp_path / "driver.py", tmp_path / "ds", tmp_path / "ck"
    script.write_text(DRIVER)
    rng = random.Random(0)
    started = time.monotonic()
    for _ in range(KILLS):
        # a third of the kills in the first batch (planning, tasks, the sink's commit,
        # Spark's logs), the others in the batch after one to three finished ones
        after = 0 if rng.random() < 1 / 3 else rng.randint(1, 3)
        kill_after = rng.uniform(0.0, 4.0 if after == 0 else 1.5)
        run(script, out, ck, "forever", implementation, kill_after, after)
    run(script, out, ck, "available", implementation)
    elapsed = time.monotonic() - started

    manifest = load_manifest(out)
    ids = sorted(int(i) for s in manifest.shards for i in load_file(str(out / s.shard_path))["id"])
    assert manifest.total_samples >= ROWS_PER_BATCH
    assert ids == list(range(manifest.total_samples)), "a row lost or written twice"
    (stream,) = manifest.stream_commits
    assert (manifest.stream_commits[stream] + 1) * ROWS_PER_BATCH == manifest.total_samples
    listed = {s.shard_path for s in manifest.shards}
    shards = {p.name for p in out.glob("*.safetensors")}
    assert shards == listed, f"unlisted shards left: {sorted(shards - listed)[:3]}"
    batches = manifest.stream_commits[stream] + 1
    print(
        f"{implementation}: {KILLS} kills, {batches} batches, {manifest.total_samples} rows, "
        f"{len(listed)} shards, {elapsed:.0f} s"
    )
