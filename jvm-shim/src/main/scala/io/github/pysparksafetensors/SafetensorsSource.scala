package io.github.pysparksafetensors

import java.util

import org.apache.spark.sql.SparkSession
import org.apache.spark.sql.connector.catalog.{SupportsRead, SupportsWrite, Table, TableCapability, TableProvider}
import org.apache.spark.sql.connector.expressions.Transform
import org.apache.spark.sql.connector.read.ScanBuilder
import org.apache.spark.sql.connector.write.{LogicalWriteInfo, WriteBuilder}
import org.apache.spark.sql.sources.DataSourceRegister
import org.apache.spark.sql.types.StructType
import org.apache.spark.sql.util.CaseInsensitiveStringMap

import io.github.pysparksafetensors.read.{ReadPlan, SafetensorsScanBuilder}
import io.github.pysparksafetensors.write.{SafetensorsWriteBuilder, SafetensorsWriteException}

/** The `safetensors` data source on the JVM: the twin of the Python source's reader (views
  * `rows`, `kv`, `tensors`, `files`, the same options, schemas and checks) and writer.
  * Reachable by class name, `format("io.github.pysparksafetensors.SafetensorsSource")`;
  * the short name stays with the Python source unless the jar registers this class. */
class SafetensorsSource extends TableProvider with DataSourceRegister {
  override def shortName(): String = "safetensors"

  override def inferSchema(options: CaseInsensitiveStringMap): StructType = SafetensorsSource.plan(options).schema

  override def supportsExternalMetadata(): Boolean = true

  override def getTable(schema: StructType, partitioning: Array[Transform],
      properties: util.Map[String, String]): Table = {
    if (partitioning.nonEmpty)
      throw new SafetensorsWriteException(
        "a safetensors dataset has no partition columns: drop partitionBy and write with save(path)")
    new SafetensorsTable(schema)
  }
}

object SafetensorsSource {
  def plan(options: CaseInsensitiveStringMap): ReadPlan =
    ReadPlan.plan(options, SparkSession.active.sessionState.newHadoopConfWithOptions(
      scala.jdk.CollectionConverters.MapHasAsScala(options.asCaseSensitiveMap()).asScala.toMap))
}

/** A dataset (or safetensors files) as a table: batch reads, appends, overwrite by truncation.
  * A read plans itself from the scan's options; a schema given by the user names some of
  * the data's columns with their types. */
final class SafetensorsTable(tableSchema: StructType) extends Table with SupportsRead with SupportsWrite {
  override def name(): String = "safetensors"
  override def schema(): StructType = tableSchema
  override def capabilities(): util.Set[TableCapability] =
    util.EnumSet.of(TableCapability.BATCH_READ, TableCapability.BATCH_WRITE, TableCapability.TRUNCATE)

  override def newScanBuilder(options: CaseInsensitiveStringMap): ScanBuilder = {
    val plan = SafetensorsSource.plan(options)
    new SafetensorsScanBuilder(if (plan.schema.catalogString == tableSchema.catalogString) plan
      else ReadPlan.withSchema(plan, tableSchema))
  }

  override def newWriteBuilder(info: LogicalWriteInfo): WriteBuilder = new SafetensorsWriteBuilder(info)
}
