"""The sessions' Python workers fork from this package's daemon, which imported pandas and
pyarrow before forking them."""

from pathlib import Path

import pytest

from pyspark_safetensors.spark.daemon import preload

pytestmark = pytest.mark.spark


def test_workers_fork_from_a_daemon_holding_pandas_and_pyarrow(spark):
    def parent(batches):
        import gc
        import os

        import pyarrow as pa

        for _ in batches:
            pass
        ppid = os.getppid()
        command = Path(f"/proc/{ppid}/cmdline").read_text().split("\0")
        libraries = {
            Path(line.split()[-1]).name
            for line in Path(f"/proc/{ppid}/maps").read_text().splitlines()
            if "/" in line
        }
        yield pa.RecordBatch.from_pydict(
            {
                "command": [command],
                "libraries": [sorted(libraries)],
                "frozen": [gc.get_freeze_count()],
            }
        )

    row = (
        spark.range(1, numPartitions=1)
        .mapInArrow(parent, "command array<string>, libraries array<string>, frozen long")
        .first()
    )
    assert row.command[1:3] == ["-m", "pyspark_safetensors.spark.daemon"], row.command
    # native libraries of pandas and pyarrow, mapped by the daemon before any fork
    assert any(name.startswith("libarrow.so") for name in row.libraries), row.libraries
    assert any(name.startswith("hashtable.cpython") for name in row.libraries), row.libraries
    # the daemon froze what it imported: the collection Spark runs after each task skips it
    assert row.frozen > 10_000, row.frozen


def test_a_module_that_cannot_be_preloaded_is_left_to_the_workers():
    assert preload(("json", "pyspark_safetensors_no_such_module")) == [
        "pyspark_safetensors_no_such_module"
    ]
