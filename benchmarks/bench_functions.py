"""``arr_to_st`` throughput: the JVM shim's Catalyst expression against the Arrow-UDF
fallback, on a cached DataFrame of 1,000,000 rows x 256 float32 (local[2], warm, median).
Each case encodes every row and sums the encoded byte lengths (so every struct is built and
read; nothing is written); throughput is input float32 bytes per second.
"""

from __future__ import annotations

from benchmarks.common import median_seconds, table

ROWS, DIM, PARTS, REPEAT = 1_000_000, 256, 2, 5


def run() -> str:
    from pyspark.sql import functions as F

    from pyspark_safetensors.functions import SHIM_EXTENSIONS, arr_to_st, shim_jar, st_to_array
    from pyspark_safetensors.spark.session import local_session

    spark = local_session(
        "local[2]",
        **{
            "spark.ui.showConsoleProgress": "false",
            "spark.jars": str(shim_jar()),
            "spark.sql.extensions": SHIM_EXTENSIONS,
        },
    )
    df = spark.range(ROWS, numPartitions=PARTS).select(
        F.transform(
            F.array_repeat(F.lit(0.0), DIM), lambda x, i: (F.rand(7) + i).cast("float")
        ).alias("x")
    )
    df = df.cache()
    df.count()
    mb = ROWS * DIM * 4 / 1e6

    structs = df.select(arr_to_st("x", [DIM], "F16", jvm=True).alias("t")).cache()
    structs.count()

    def total_bytes(column):
        return lambda: df.select(F.sum(F.length(column.getField("data")))).collect()

    def total_values(column):
        return lambda: structs.select(F.sum(F.size(column))).collect()

    cases = {
        "scan only (sum of array sizes, no function)": lambda: df.select(
            F.sum(F.size("x"))
        ).collect()
    }
    for dtype in ("F32", "F16", "BF16"):
        for jvm, how in ((True, "JVM shim (SQL expression)"), (False, "Arrow UDF fallback")):
            cases[f"arr_to_st {dtype}, {how}"] = total_bytes(arr_to_st("x", [DIM], dtype, jvm=jvm))
    for jvm, how in ((True, "JVM shim (SQL expression)"), (False, "Arrow UDF fallback")):
        cases[f"st_to_array F16 → float, {how}"] = total_values(st_to_array("t", jvm=jvm))
    rows = []
    for name, fn in cases.items():
        seconds = median_seconds(fn, repeat=REPEAT, warmup=2)
        rows.append([name, f"{seconds:.2f}", f"{mb / seconds:,.0f}"])
        print(rows[-1], flush=True)
    spark.stop()
    return table(["case (1,000,000 × 256 float32)", "seconds", "MB/s of float32 input"], rows)


if __name__ == "__main__":
    print(run())
