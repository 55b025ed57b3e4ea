"""Write and read throughput to an S3 server on loopback (moto) next to a local path, same
data, same process; the commit's share of the write (it must not copy shard bytes).

The writer is driven the way Spark drives it (plan, task attempts, one commit) but in this
process, so the phases can be timed apart: tasks (encode, checksum, write or upload every
shard), then the driver's commit (index, manifest put, reclaim). Reads: ``open_dataset``
(verification) plus every shard's whole tensors, in memory (local pages are copied out of
the mapping, so both sides touch every byte).

    python -m benchmarks storage
"""

from __future__ import annotations

import os
import tempfile
import time
import uuid

import numpy as np
import pyarrow as pa

ROWS_PER_TASK = 16_384
TASKS = 4
HIDDEN = 256
BATCH = 8192
REPEATS = 3


def _batches(task: int):
    rng = np.random.default_rng(task)
    values = rng.standard_normal((ROWS_PER_TASK, HIDDEN), dtype=np.float32)
    vec = pa.FixedSizeListArray.from_arrays(pa.array(values.reshape(-1)), HIDDEN)
    vec = vec.cast(pa.list_(pa.float32()))
    ids = pa.array(np.arange(task * ROWS_PER_TASK, (task + 1) * ROWS_PER_TASK))
    return [pa.record_batch([ids, vec], names=["id", "vec"])]


def _write(path: str, data, storage: dict) -> tuple[float, float]:
    from pyspark.sql.types import ArrayType, FloatType, LongType, StructField, StructType

    from pyspark_safetensors.spark.source import SafetensorsDataSource

    schema = StructType([StructField("id", LongType()), StructField("vec", ArrayType(FloatType()))])
    opts = {"path": path, "batch_size": str(BATCH), **storage}
    writer = SafetensorsDataSource(opts).writer(schema, True)
    start = time.perf_counter()
    messages = [writer.write(iter(batches)) for batches in data]
    tasks = time.perf_counter() - start
    start = time.perf_counter()
    writer.commit(messages)
    return tasks, time.perf_counter() - start


def _read(path: str, storage: dict) -> float:
    from pyspark_safetensors.torch import open_dataset

    start = time.perf_counter()
    ds = open_dataset(path, storage_options=storage or None)
    total = 0
    for shard in range(len(ds.paths)):
        for column in ("vec", "id"):
            # in memory as an array: a copy of the mapped pages locally, the fetched bytes remotely
            total += np.array(ds.shard_view(shard, column), copy=True).nbytes
    elapsed = time.perf_counter() - start
    assert total == TASKS * ROWS_PER_TASK * (HIDDEN * 4 + 8)
    return elapsed


def run() -> str:
    import pyarrow.fs as pafs
    from moto.server import ThreadedMotoServer

    for k, v in {
        "AWS_ACCESS_KEY_ID": "bench",
        "AWS_SECRET_ACCESS_KEY": "bench",
        "AWS_REGION": "us-east-1",
        "AWS_EC2_METADATA_DISABLED": "true",
    }.items():
        os.environ.setdefault(k, v)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        endpoint = f"http://{host}:{port}"
        bucket = f"bench-{uuid.uuid4().hex[:8]}"
        pafs.S3FileSystem(
            endpoint_override=f"{host}:{port}", scheme="http", allow_bucket_creation=True
        ).create_dir(bucket)
        data = [_batches(t) for t in range(TASKS)]
        mb = TASKS * ROWS_PER_TASK * (HIDDEN * 4 + 8) / 1e6
        with tempfile.TemporaryDirectory() as tmp:
            targets = {
                "local path": (os.path.join(tmp, "acts"), {}),
                "S3 (moto, loopback)": (f"s3://{bucket}/acts", {"endpoint_url": endpoint}),
            }
            best: dict[str, list[float]] = {name: [1e9, 1e9, 1e9] for name in targets}
            for _ in range(REPEATS):  # targets in turn, so drifts touch both alike
                for name, (path, storage) in targets.items():
                    tasks, commit = _write(path, data, storage)
                    read = _read(path, storage)
                    b = best[name]
                    if tasks + commit < b[0] + b[1]:
                        b[0], b[1] = tasks, commit
                    b[2] = min(b[2], read)
    finally:
        server.stop()
    local_w = sum(best["local path"][:2])
    local_r = best["local path"][2]
    lines = [
        f"Storage: {mb:.0f} MB ({TASKS} tasks x {ROWS_PER_TASK:,} rows x {HIDDEN} F32, "
        f"{BATCH:,}-row shards, crc32c on), best of {REPEATS}, writer driven in-process "
        "(`python -m benchmarks storage`).",
        "",
        "| target | write (tasks + commit) | write MB/s | commit | commit share | read (verify + all shards) | read MB/s | write vs local | read vs local |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, (tasks, commit, read) in best.items():
        write = tasks + commit
        lines.append(
            f"| {name} | {write:.3f} s | {mb / write:,.0f} | {commit * 1e3:.1f} ms | "
            f"{commit / write:.1%} | {read:.3f} s | {mb / read:,.0f} | "
            f"{write / local_w:.2f}x | {read / local_r:.2f}x |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    print(run())
