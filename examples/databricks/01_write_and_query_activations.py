# Databricks notebook source
# MAGIC %md
# MAGIC # Activations to a safetensors dataset, queried in SQL
# MAGIC
# MAGIC Writes a DataFrame of activations (one row per token: `sample_id`, `token_pos` and a
# MAGIC `float` vector) as a safetensors dataset, queries it in SQL and reads it back.
# MAGIC `02_train_sae` then trains a sparse autoencoder on it.
# MAGIC
# MAGIC Runs as it is on serverless and on standard-access clusters (Databricks Runtime 15.4
# MAGIC LTS and newer), where `format("safetensors")` is the package's Python data source,
# MAGIC and on a cluster with the shim jar of its Spark line as a cluster library (plus
# MAGIC `spark.sql.extensions=io.github.pysparksafetensors.SafetensorsExtensions`), where the
# MAGIC JVM source answers and the dataset can also be a catalog table.

# COMMAND ----------

# MAGIC %pip install pyspark-safetensors

# COMMAND ----------

# MAGIC %md
# MAGIC The output directory: a Unity Catalog Volume path, which the driver and the workers
# MAGIC share. Change it in the widget above the notebook.

# COMMAND ----------

dbutils.widgets.text("root", "/Volumes/main/default/pyspark_safetensors", "Output directory")
root = dbutils.widgets.get("root").rstrip("/")
acts_path = f"{root}/acts"
print(acts_path)

# COMMAND ----------

# MAGIC %md
# MAGIC `register` makes `format("safetensors")` known to this session (the session looked
# MAGIC for data sources before `%pip` installed the package) and checks that Spark's Python
# MAGIC workers import the package. It says which implementation answers: `jvm` with the
# MAGIC jar, `python` without it, `auto` on a Spark Connect session (the server decides).

# COMMAND ----------

import pyspark_safetensors

implementation = pyspark_safetensors.register(spark)
print(f"format('safetensors') is answered by the {implementation} source")

# COMMAND ----------

# MAGIC %md
# MAGIC ## Write
# MAGIC
# MAGIC Stand-in activations: 256 texts of 16 tokens, 32 dimensions each. A model's real
# MAGIC ones come the same way, as an `array<float>` column (the package's extraction job
# MAGIC writes them from a transformer inside Spark: `docs/extract.md`). Every 1,024 rows of
# MAGIC a partition become one shard; `mode("overwrite")` (or `"append"`) is required.

# COMMAND ----------

from pyspark.sql import functions as F

d_model, tokens_per_text, texts = 32, 16, 256
activations = spark.range(texts * tokens_per_text, numPartitions=2).select(
    (F.col("id") / tokens_per_text).cast("long").alias("sample_id"),
    (F.col("id") % tokens_per_text).cast("int").alias("token_pos"),
    F.array(*[F.randn(seed=i).cast("float") for i in range(d_model)]).alias("activation"),
)
(
    activations.write.format("safetensors")
    .option("batch_size", 1024)
    .option("metadata", '{"hook_point": "stand-in", "model": "none"}')
    .mode("overwrite")
    .save(acts_path)
)

# COMMAND ----------

# MAGIC %md
# MAGIC ## A table to query in SQL
# MAGIC
# MAGIC With the jar, the JVM source makes a catalog table over the dataset (where the
# MAGIC catalog takes tables of other providers: a Hive metastore does, Unity Catalog does
# MAGIC not). The Python source cannot be a catalog table (Spark hands a Python data source
# MAGIC no table location), so everywhere else the dataset is a temporary view. Either way
# MAGIC the SQL below reads `acts`.

# COMMAND ----------

catalog_table = None
if implementation == "jvm":
    try:
        spark.sql("DROP TABLE IF EXISTS safetensors_acts")
        spark.sql(f"CREATE TABLE safetensors_acts USING safetensors LOCATION '{acts_path}'")
        catalog_table = "safetensors_acts"
    except Exception as error:  # a catalog that takes no safetensors tables
        print(f"no catalog table here ({str(error).strip().splitlines()[0]})")
if catalog_table:
    spark.table(catalog_table).createOrReplaceTempView("acts")
else:
    spark.read.format("safetensors").load(acts_path).createOrReplaceTempView("acts")
print(f"acts reads {catalog_table or acts_path}")

# COMMAND ----------

# MAGIC %sql
# MAGIC SELECT count(*) AS tokens, count(DISTINCT sample_id) AS texts, max(size(activation)) AS d_model
# MAGIC FROM acts

# COMMAND ----------

# MAGIC %sql
# MAGIC CREATE OR REPLACE TEMPORARY VIEW token_norms AS
# MAGIC SELECT sample_id, token_pos,
# MAGIC        sqrt(aggregate(activation, 0D, (total, x) -> total + x * x)) AS norm
# MAGIC FROM acts;
# MAGIC
# MAGIC SELECT token_pos, round(avg(norm), 3) AS mean_norm, count(*) AS tokens
# MAGIC FROM token_norms
# MAGIC GROUP BY token_pos
# MAGIC ORDER BY token_pos
# MAGIC LIMIT 4

# COMMAND ----------

# MAGIC %md
# MAGIC ## Read back
# MAGIC
# MAGIC One row per token, the columns as written; the manifest gives the schema.

# COMMAND ----------

back = spark.read.format("safetensors").load(acts_path)
back.printSchema()
first = back.where("sample_id = 3 AND token_pos = 0").first()
print(first.sample_id, first.token_pos, first.activation[:4])
assert back.count() == texts * tokens_per_text
