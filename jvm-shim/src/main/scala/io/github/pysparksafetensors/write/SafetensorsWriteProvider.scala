package io.github.pysparksafetensors.write

import java.util

import org.apache.spark.sql.connector.catalog.{SupportsWrite, Table, TableCapability, TableProvider}
import org.apache.spark.sql.connector.expressions.Transform
import org.apache.spark.sql.connector.write.{LogicalWriteInfo, WriteBuilder}
import org.apache.spark.sql.types.StructType
import org.apache.spark.sql.util.CaseInsensitiveStringMap

/** The JVM writer by its class name, for writes only:
  * `df.write.format("io.github.pysparksafetensors.write.SafetensorsWriteProvider")`
  * with `mode("append")` or `mode("overwrite")` and the writer's options. It registers no
  * short name; datasets it writes are read with `spark.read.format("safetensors")`. */
class SafetensorsWriteProvider extends TableProvider {
  override def inferSchema(options: CaseInsensitiveStringMap): StructType =
    throw new UnsupportedOperationException(
      "SafetensorsWriteProvider only writes; read datasets with spark.read.format(\"safetensors\")")

  override def supportsExternalMetadata(): Boolean = true

  override def getTable(schema: StructType, partitioning: Array[Transform],
      properties: util.Map[String, String]): Table = {
    if (partitioning.nonEmpty)
      throw new SafetensorsWriteException(
        "a safetensors dataset has no partition columns: drop partitionBy and write with save(path)")
    new SafetensorsWriteTable(schema)
  }
}

/** A dataset as a write target: batch writes, append, and overwrite by truncation. */
final class SafetensorsWriteTable(tableSchema: StructType) extends Table with SupportsWrite {
  override def name(): String = "safetensors"
  override def schema(): StructType = tableSchema
  override def capabilities(): util.Set[TableCapability] =
    util.EnumSet.of(TableCapability.BATCH_WRITE, TableCapability.TRUNCATE)
  override def newWriteBuilder(info: LogicalWriteInfo): WriteBuilder = new SafetensorsWriteBuilder(info)
}
