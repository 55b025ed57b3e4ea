"""Expected attributions over many prompts' graphs (``graphs.global_weights.
expected_attributions``): one Spark job over a graph job's output (local session, two
tasks, each reading its prompts' adjacencies and node tables itself; the pairs summed by
Spark; parquet partitioned by target layer written through the storage layer), at two
prompt counts, each in a fresh session, with each Python worker's peak resident memory;
against a plain loop in one process over the same graphs (each prompt's pairs by the
same numpy kernel, ``prompt_pairs``, summed into a dict; nothing written).

    python -m benchmarks global_weights
    GLOBAL_PROMPTS=100,1000 GLOBAL_MAX_FEATURES=256 python -m benchmarks global_weights

The graphs are made first by the graph job (``bench_graphs``' model, CLT and prompts: a
CLT demo run's where there is one, else the tiny toy Llama and a random CLT), untimed,
at partial attribution's ``max_feature_nodes`` ``GLOBAL_MAX_FEATURES`` (default 256),
one graph job per prompt count.
"""

from __future__ import annotations

import os
import resource
import tempfile
import time
from pathlib import Path

from .common import table, worker_peak_rss

MAX_FEATURES = int(os.environ.get("GLOBAL_MAX_FEATURES", 256))


def _graphs(root: Path, counts: list[int]) -> tuple[dict[int, Path], str]:
    """A graph job's output per prompt count (untimed)."""
    from pyspark_safetensors.graphs.job import GraphsConfig, run_graphs
    from pyspark_safetensors.spark.session import local_session

    from .bench_graphs import _inputs

    model, clt, prompts, _, source = _inputs(root, max(counts))
    spark = local_session("local[2]", quick_jit=True)
    out = {}
    try:
        for n in counts:
            out[n] = root / f"graphs-{n}"
            config = GraphsConfig(str(model), (str(clt),), str(out[n]), partitions=2, threads=1,
                                  max_feature_nodes=MAX_FEATURES, browser=False)  # fmt: skip
            run_graphs(
                spark, config, spark.createDataFrame([(p,) for p in prompts[:n]], "prompt string")
            )
    finally:
        spark.stop()
    return out, source


def _job(graphs: Path, out: Path) -> tuple[float, float, dict]:
    """One fresh local[2] session's job: seconds, worker peak RSS (MB), summary."""
    from pyspark_safetensors.graphs.global_weights import expected_attributions
    from pyspark_safetensors.spark.session import local_session

    spark = local_session("local[2]")
    try:
        started = time.perf_counter()
        summary = expected_attributions(spark, str(graphs), str(out), partitions=2)
        seconds = time.perf_counter() - started
        return seconds, worker_peak_rss(spark), summary
    finally:
        spark.stop()


def _loop(graphs: Path) -> tuple[float, int, int]:
    """The plain loop: seconds, pairs, rows of per-prompt pairs summed."""
    import numpy as np
    import pyarrow.parquet as pq

    from pyspark_safetensors.graphs.global_weights import prompt_pairs
    from pyspark_safetensors.torch import open_dataset

    started = time.perf_counter()
    prompts = pq.read_table(graphs / "graphs.parquet").to_pylist()
    adjacency = open_dataset(str(graphs / "adjacency"))
    sums: dict[tuple, list] = {}
    rows = 0
    for p in prompts:
        if p["status"] != "ok":
            continue
        pid, n = p["prompt_id"], p["n_nodes"]
        nodes = pq.read_table(graphs / "nodes" / f"prompt_id={pid}" / "part-0.parquet")
        a = np.asarray(adjacency[f"p{pid}"]["adjacency"], np.float32).reshape(n, n)
        t = prompt_pairs(nodes, a)
        rows += t.num_rows
        cols = [t.column(c).to_pylist() for c in t.column_names]
        for tl, tj, sl, sj, s, w in zip(*cols, strict=True):
            entry = sums.get((tl, tj, sl, sj))
            if entry is None:
                sums[(tl, tj, sl, sj)] = [s, 1, w]
            else:
                entry[0] += s
                entry[1] += 1
                entry[2] += w
    return time.perf_counter() - started, len(sums), rows


def run() -> str:
    counts = [int(n) for n in os.environ.get("GLOBAL_PROMPTS", "100,1000").split(",")]
    env = [f"{k}={os.environ[k]}" for k in ("GLOBAL_PROMPTS", "GLOBAL_MAX_FEATURES")
           if k in os.environ]  # fmt: skip
    command = " ".join([*env, "python -m benchmarks global_weights"])
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        graphs, source = _graphs(root, counts)
        jobs = {n: _job(graphs[n], root / f"global-{n}") for n in counts}
        largest = max(counts)
        loop_seconds, loop_pairs, loop_rows = _loop(graphs[largest])
        loop_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    load = f"{load:.2f} before, {os.getloadavg()[0]:.2f} after"
    rows = [[f"loop, one process (dict of pairs; its peak RSS {loop_rss:,.0f} MB)", largest,
             f"{loop_seconds:.1f}", f"{1e3 * loop_seconds / largest:.1f}", "", f"{loop_pairs:,}"]]  # fmt: skip
    for n, (seconds, rss, summary) in jobs.items():
        rows.append(["Spark job, local[2], 2 tasks, written", n, f"{seconds:.1f}",
                     f"{1e3 * seconds / n:.1f}", f"{rss:,.0f}", f"{summary['pairs']:,}"])  # fmt: skip
    spark_s = jobs[largest][0]
    same = "the same pairs" if jobs[largest][2]["pairs"] == loop_pairs else "DIFFERENT pair counts"
    rss = [r for _, r, _ in jobs.values()]
    memory = (
        "a worker's peak memory stays flat in prompts"
        if max(rss) <= 1.1 * min(rss)
        else f"a worker's peak memory grows from {min(rss):,.0f} to {max(rss):,.0f} MB"
    )
    header = ["run", "prompts", "seconds", "ms per prompt", "worker peak RSS (MB)", "pairs"]
    return (
        f"## Expected attributions: {largest:,} prompts' graphs, {source}\n\n"
        + table(header, rows)
        + f"\n\nAt {largest:,} prompts the Spark job takes {spark_s / loop_seconds:.2f}x the "
        f"loop's time and finds {same} ({loop_rows:,} per-prompt pair rows summed); {memory} "
        f"({', '.join(f'{r:,.0f}' for r in rss)} MB at {', '.join(f'{n:,}' for n in counts)} "
        "prompts), while the loop's dict holds every pair in one process. Graphs made first "
        f"by the graph job at max_feature_nodes {MAX_FEATURES or 'all'}, untimed; the Spark "
        "jobs' seconds include starting the workers and writing the parquet through the "
        f"storage layer, the RSS job runs after. Load average (1 min) {load}. Command: "
        f"`{command}`.\n\n" + BEHIND
    )


BEHIND = (
    "Where this is behind: the loop is a plain dict of pairs, not the fastest one process "
    "can do (the per-prompt rows concatenated and summed by one numpy or pandas group-by "
    "would be faster, and is not measured here); the memory measured is the Python "
    "workers', not the JVM's, which holds the partial sums and the shuffle (Spark spills "
    "them, unmeasured here); at 100 prompts the job's seconds are mostly the session's "
    "workers starting; and making the graphs costs more than aggregating them (about "
    "41 s for 1,000 graphs, bench:graphs)."
)
