package io.github.pysparksafetensors.read

import java.nio.{ByteBuffer, ByteOrder}

import org.apache.spark.sql.catalyst.InternalRow
import org.apache.spark.sql.catalyst.expressions.UnsafeArrayData
import org.apache.spark.sql.catalyst.util.{ArrayData, GenericArrayData}
import org.apache.spark.unsafe.types.UTF8String

import io.github.pysparksafetensors.TensorCodec
import io.github.pysparksafetensors.core.{SafetensorsReadException, TensorInfo}

/** Stored bytes as Spark values: nested arrays of the read element type, or Tensor Structs. */
object Values {
  /** `n` elements of `dtype` at byte `off` of `buf`, widened as the Python reader widens
    * them (F16/BF16 → float with the shim's codec, unsigned → the next signed type). */
  def leaf(buf: ByteBuffer, off: Int, n: Int, dtype: String): ArrayData = {
    val b = buf.duplicate().order(ByteOrder.LITTLE_ENDIAN)
    b.position(off)
    dtype match {
      case "F32" => val a = new Array[Float](n); b.asFloatBuffer().get(a); UnsafeArrayData.fromPrimitiveArray(a)
      case "F64" => val a = new Array[Double](n); b.asDoubleBuffer().get(a); UnsafeArrayData.fromPrimitiveArray(a)
      case "F16" => val a = new Array[Float](n); var i = 0
        while (i < n) { a(i) = TensorCodec.halfToFloat(b.getShort(off + 2 * i) & 0xffff); i += 1 }
        UnsafeArrayData.fromPrimitiveArray(a)
      case "BF16" => val a = new Array[Float](n); var i = 0
        while (i < n) { a(i) = TensorCodec.bfloat16ToFloat(b.getShort(off + 2 * i) & 0xffff); i += 1 }
        UnsafeArrayData.fromPrimitiveArray(a)
      case "I8" => val a = new Array[Byte](n); b.get(a); UnsafeArrayData.fromPrimitiveArray(a)
      case "U8" => val a = new Array[Short](n); var i = 0
        while (i < n) { a(i) = (b.get(off + i) & 0xff).toShort; i += 1 }
        UnsafeArrayData.fromPrimitiveArray(a)
      case "I16" => val a = new Array[Short](n); b.asShortBuffer().get(a); UnsafeArrayData.fromPrimitiveArray(a)
      case "U16" => val a = new Array[Int](n); var i = 0
        while (i < n) { a(i) = b.getShort(off + 2 * i) & 0xffff; i += 1 }
        UnsafeArrayData.fromPrimitiveArray(a)
      case "I32" => val a = new Array[Int](n); b.asIntBuffer().get(a); UnsafeArrayData.fromPrimitiveArray(a)
      case "U32" => val a = new Array[Long](n); var i = 0
        while (i < n) { a(i) = b.getInt(off + 4 * i) & 0xffffffffL; i += 1 }
        UnsafeArrayData.fromPrimitiveArray(a)
      case "I64" | "U64" => val a = new Array[Long](n); b.asLongBuffer().get(a); UnsafeArrayData.fromPrimitiveArray(a)
      case "BOOL" => val a = new Array[Boolean](n); var i = 0
        while (i < n) { a(i) = b.get(off + i) != 0; i += 1 }
        UnsafeArrayData.fromPrimitiveArray(a)
      case other => throw new SafetensorsReadException(
        s"dtype $other has no Spark element type; read it with view=tensors or tensor_format=struct")
    }
  }

  /** A tensor of shape `dims` at byte `off` as nested arrays (rank 0: the scalar itself). */
  def nested(buf: ByteBuffer, off: Int, dims: Seq[Long], dtype: String, elemBytes: Int): Any = {
    if (dims.isEmpty) return scalar(leaf(buf, off, 1, dtype), dtype)
    if (dims.size == 1) return leaf(buf, off, dims.head.toInt, dtype)
    val inner = dims.tail.product.toInt * elemBytes
    new GenericArrayData(Array.tabulate[Any](dims.head.toInt)(i => nested(buf, off + i * inner, dims.tail, dtype, elemBytes)))
  }

  private def scalar(a: ArrayData, dtype: String): Any = dtype match {
    case "F32" | "F16" | "BF16" => a.getFloat(0)
    case "F64" => a.getDouble(0)
    case "I8" => a.getByte(0)
    case "U8" | "I16" => a.getShort(0)
    case "U16" | "I32" => a.getInt(0)
    case "BOOL" => a.getBoolean(0)
    case _ => a.getLong(0)
  }

  /** A Tensor Struct `(data, shape, dtype)` of raw bytes; a dimension over 2^31 - 1 refused. */
  def struct(buf: ByteBuffer, off: Int, len: Int, dims: Seq[Long], dtype: String, where: String): InternalRow = {
    if (dims.exists(_ > Int.MaxValue))
      throw new SafetensorsReadException(s"$where: shape ${dims.mkString("[", ", ", "]")} has a dimension above 2^31 - 1, " +
        "which the Tensor Struct's array<int> shape cannot hold; read it with view=tensors (array<long>)")
    val bytes = new Array[Byte](len)
    val b = buf.duplicate(); b.position(off); b.get(bytes)
    InternalRow(bytes, UnsafeArrayData.fromPrimitiveArray(dims.map(_.toInt).toArray), UTF8String.fromString(dtype))
  }

  def elemBytes(t: TensorInfo): Int = io.github.pysparksafetensors.core.Header.Bits(t.dtype) / 8

  def longs(dims: Seq[Long]): ArrayData = UnsafeArrayData.fromPrimitiveArray(dims.toArray)
}
