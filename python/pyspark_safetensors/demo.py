"""The main job, end to end on an embedded local Spark.

Today it runs the stages that exist: a text corpus that ships with Python
(``pydoc_data.topics``) split into passages, per-token features computed in Spark, written
as a token-level batch dataset (F16) and a sample-level KV dataset, then verified against
the manifest and read back with the reference ``safetensors`` library.
"""

from __future__ import annotations

import shutil
from pathlib import Path


def demo_passages(max_chars: int = 400) -> list[tuple[str, str]]:
    """(topic, passage) pairs from Python's own documentation topics."""
    from pydoc_data.topics import topics

    out = []
    for topic in sorted(topics):
        text = topics[topic]
        for i in range(0, len(text), max_chars):
            chunk = text[i : i + max_chars].strip()
            if chunk:
                out.append((f"{topic}#{i // max_chars}", chunk))
    return out


def run_demo(out: Path, rows: int = 50_000) -> None:
    from pyspark.sql import functions as F

    from .dataset import verify_dataset
    from .spark.session import local_session

    out = Path(out)
    if out.exists():
        shutil.rmtree(out)
    spark = local_session("local[*]")
    passages = demo_passages()
    print(f"corpus: {len(passages):,} passages from pydoc_data.topics")
    df = spark.createDataFrame(passages, "key string, text string").repartition(2)
    # Token-level rows: one per character position, a 64-dim feature of its byte and
    # neighbours (a stand-in for transformer activations until the extractor runs here).
    tokens = (
        df.select("key", F.posexplode(F.split("text", "")).alias("token_pos", "ch"))
        .where(F.length("ch") > 0)
        .limit(rows)
        .select(
            F.transform(
                F.sequence(F.lit(0), F.lit(63)),
                lambda j: F.sin(F.ascii("ch").cast("float") * (j + 1) / 64.0).cast("float"),
            ).alias("activation"),
            F.col("token_pos").cast("int").alias("token_pos"),
        )
    )
    tokens.write.format("safetensors").option("batch_size", 4096).option(
        "dtype", '{"activation": "F16"}'
    ).option(
        "metadata", '{"source": "pydoc_data.topics", "hook_point": "demo.char_features"}'
    ).mode("overwrite").save(str(out / "tokens"))
    tokens_manifest = verify_dataset(out / "tokens", checksums=True)
    print(
        f"token dataset: {tokens_manifest.total_samples:,} samples, {len(tokens_manifest.shards)} shards, "
        f"{tokens_manifest.total_bytes / 1e6:.1f} MB, verified"
    )

    samples = df.select(
        "key",
        F.transform(
            F.sequence(F.lit(0), F.lit(31)), lambda j: (F.length("text") * (j + 1)).cast("float")
        ).alias("features"),
    )
    samples.write.format("safetensors").option("name_col", "key").mode("overwrite").save(
        str(out / "samples")
    )
    m = verify_dataset(out / "samples", checksums=True)
    print(
        f"KV dataset: {m.total_samples:,} keys, {len(m.shards)} shards, index {m.index_file}, verified"
    )

    from safetensors.numpy import load_file

    first = out / "tokens" / tokens_manifest.shards[0].shard_path
    tensors = load_file(first)
    print(
        f"reference library reads {first.name}: "
        + ", ".join(f"{k} {v.dtype}{list(v.shape)}" for k, v in tensors.items())
    )
    spark.stop()
