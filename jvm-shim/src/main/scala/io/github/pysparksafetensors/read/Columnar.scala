package io.github.pysparksafetensors.read

import java.nio.ByteBuffer

import org.apache.spark.sql.connector.read.PartitionReader
import org.apache.spark.sql.execution.vectorized.{OnHeapColumnVector, WritableColumnVector}
import org.apache.spark.sql.types.{ArrayType, StructType}
import org.apache.spark.sql.vectorized.{ColumnVector, ColumnarBatch}

import io.github.pysparksafetensors.TensorCodec
import io.github.pysparksafetensors.core.{SafetensorsReadException, TensorInfo}

/** The `rows` view as columnar batches when every selected column is a vector (rank 1) of
  * a dtype the vectors take in bulk: each batch's values are copied from the mapped (or
  * ranged-read) bytes with one little-endian put per column, F16/BF16 widened first. */
object Columnar {
  val BatchRows = 4096
  val Bulk = Set("F32", "F64", "I32", "I64", "F16", "BF16")

  def supports(plan: ReadPlan, required: StructType): Boolean =
    plan.view == "rows" && plan.options.tensorFormat == "array" && required.nonEmpty &&
      required.forall(f => f.dataType match {
        case ArrayType(_: ArrayType, _) => false
        case ArrayType(_, _) => plan.sources.forall(_.manifest.exists(m =>
          m.schema.toMap.get(f.name).exists(c => Bulk(c.dtype) && c.sampleShape.size == 1)))
        case _ => false
      })
}

final class RowsColumnarReader(plan: ReadPlan, p: ShardPart, required: StructType) extends PartitionReader[ColumnarBatch] {
  private val n = (p.rowStop - p.rowStart).toInt
  private var at = 0
  private val vectors: Array[OnHeapColumnVector] = OnHeapColumnVector.allocateColumns(Columnar.BatchRows, required)
  private var batch: ColumnarBatch = _

  private lazy val cols: Array[(TensorInfo, ByteBuffer, Int)] = {
    val (header, file) = Readers.checkedHeader(plan, p.source, p.shard)
    val src = plan.sources(p.source)
    val shardName = src.manifest.get.shards(p.shard).path
    required.fieldNames.map { name =>
      val t = header.get(name).getOrElse(throw new SafetensorsReadException(s"file '$file': no tensor '$name'"))
      val rowBytes = ((t.end - t.begin) / math.max(1L, t.rows)).toInt
      (t, src.storage.slice(shardName, t.begin + p.rowStart * rowBytes, n.toLong * rowBytes), rowBytes)
    }
  }

  override def next(): Boolean = {
    if (at >= n) return false
    val k = math.min(Columnar.BatchRows, n - at)
    var c = 0
    while (c < cols.length) { fill(vectors(c), cols(c), k); c += 1 }
    batch = new ColumnarBatch(vectors.toArray[ColumnVector], k)
    at += k
    true
  }

  private def fill(v: WritableColumnVector, col: (TensorInfo, ByteBuffer, Int), k: Int): Unit = {
    val (t, buf, rowBytes) = col
    val len = t.shape(1).toInt
    v.reset()
    val child = v.arrayData()
    child.reset()
    child.reserve(k * len)
    var r = 0
    while (r < k) { v.putArray(r, r * len, len); r += 1 }
    val bytes = new Array[Byte](k * rowBytes)
    val b = buf.duplicate(); b.position(at * rowBytes); b.get(bytes)
    t.dtype match {
      case "F32" => child.putFloatsLittleEndian(0, k * len, bytes, 0)
      case "F64" => child.putDoublesLittleEndian(0, k * len, bytes, 0)
      case "I32" => child.putIntsLittleEndian(0, k * len, bytes, 0)
      case "I64" => child.putLongsLittleEndian(0, k * len, bytes, 0)
      case "F16" | "BF16" =>
        val half = t.dtype == "F16"
        val out = new Array[Float](k * len)
        var i = 0
        while (i < out.length) {
          val bits = (bytes(2 * i) & 0xff) | ((bytes(2 * i + 1) & 0xff) << 8)
          out(i) = if (half) TensorCodec.halfToFloat(bits) else TensorCodec.bfloat16ToFloat(bits)
          i += 1
        }
        child.putFloats(0, out.length, out, 0)
    }
  }

  override def get(): ColumnarBatch = batch
  override def close(): Unit = vectors.foreach(_.close())
}
