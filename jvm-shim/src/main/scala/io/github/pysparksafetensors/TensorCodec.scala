package io.github.pysparksafetensors

import java.nio.{ByteBuffer, ByteOrder}

import org.apache.spark.sql.catalyst.InternalRow
import org.apache.spark.sql.catalyst.expressions.{GenericInternalRow, UnsafeArrayData}
import org.apache.spark.sql.catalyst.util.ArrayData
import org.apache.spark.unsafe.types.UTF8String

/** A bad value met by a tensor function; the message starts with the function's name. */
final class TensorFunctionException(message: String) extends IllegalArgumentException(message)

/** One of the twelve writable safetensors dtypes. */
final case class TensorDType(name: String, size: Int) {
  def isFloat: Boolean = name.startsWith("F") || name == "BF16"
  def isUnsigned: Boolean = name.startsWith("U")

  /** Smallest value of an integer dtype. */
  def min: Long = if (isUnsigned) 0L else -(1L << (size * 8 - 1))

  /** Largest value of an integer dtype, as text (U64's does not fit a Long). */
  def maxText: String = if (name == "U64") "18446744073709551615" else max.toString

  /** Largest value of an integer dtype as a Long (U64's true maximum is `maxText`). */
  def max: Long =
    if (size == 8) Long.MaxValue
    else if (isUnsigned) (1L << (size * 8)) - 1
    else (1L << (size * 8 - 1)) - 1

  /** max + 1 as a double, exact for every width: the exclusive upper bound of a float. */
  def maxPlusOne: Double = math.pow(2, if (isUnsigned) size * 8 else size * 8 - 1)
}

/** Tensor Struct bytes (`struct<data: binary, shape: array<int>, dtype: string>`), encoded
  * and decoded with the rules of the Python format core, so both give identical bytes:
  *
  *  - F16 and BF16 round to nearest even through float32, bit-identical to torch (a double
  *    is rounded to float32 first; an integer is converted to float32 first);
  *  - integer dtypes are exact: an out-of-range value, a fraction, NaN or infinity is an
  *    error naming the value, its index and the dtype;
  *  - all data is little-endian.
  *
  * Element kinds of Spark arrays are coded as in `ElementKind`.
  */
object TensorCodec {

  val Writable: Seq[TensorDType] = Seq(
    "F16" -> 2, "F32" -> 4, "F64" -> 8, "BF16" -> 2, "U8" -> 1, "I8" -> 1,
    "U16" -> 2, "I16" -> 2, "U32" -> 4, "I32" -> 4, "U64" -> 8, "I64" -> 8
  ).map { case (n, s) => TensorDType(n, s) }

  private val byName: Map[String, TensorDType] = Writable.map(d => d.name -> d).toMap

  /** The dtype named `name` (case-insensitive), or an error listing the twelve. */
  def dtype(fn: String, name: String): TensorDType =
    byName.getOrElse(
      if (name == null) "" else name.trim.toUpperCase,
      fail(s"$fn: unknown dtype '$name'; valid dtypes: ${Writable.map(_.name).mkString(", ")}")
    )

  def fail(message: String): Nothing = throw new TensorFunctionException(message)

  // ---------------------------------------------------------------- float16 / bfloat16

  /** float32 -> float16 bits, round to nearest even; NaN keeps sign and top payload bits
    * with the quiet bit set (the x86 F16C rule, which torch and the Python core follow). */
  def halfBits(f: Float): Int = {
    val x = java.lang.Float.floatToRawIntBits(f)
    val sign = (x >>> 16) & 0x8000
    val abs = x & 0x7fffffff
    if (abs > 0x7f800000) sign | 0x7e00 | ((x >>> 13) & 0x3ff)
    else if (abs >= 0x477ff000) sign | 0x7c00 // at or past the midpoint 65520: infinity
    else if (abs < 0x38800000) {
      // Subnormal result: count units of 2^-24; the scaling is exact, rint rounds to even.
      // 1024 units spill into the smallest normal, which is the right answer.
      sign | math.rint(java.lang.Float.intBitsToFloat(abs) * 16777216.0f).toInt
    } else {
      val rounded = abs + 0xfff + ((abs >>> 13) & 1)
      sign | ((rounded - 0x38000000) >>> 13) // rebias the exponent from 127 to 15
    }
  }

  /** float32 -> bfloat16 bits, round to nearest even; every NaN becomes 0xFFFF. */
  def bfloat16Bits(f: Float): Int = {
    val x = java.lang.Float.floatToRawIntBits(f)
    val rounded = (x + 0x7fff + ((x >>> 16) & 1)) >>> 16
    if ((x & 0x7fffffff) > 0x7f800000) 0xffff else rounded
  }

  def halfToFloat(h: Int): Float = {
    val sign = (h & 0x8000) << 16
    val exp = (h >>> 10) & 0x1f
    val mant = h & 0x3ff
    if (exp == 0x1f) java.lang.Float.intBitsToFloat(sign | 0x7f800000 | (mant << 13))
    else if (exp == 0) {
      val v = mant * 5.9604645e-8f // 2^-24, exact
      if (sign != 0) -v else v
    } else java.lang.Float.intBitsToFloat(sign | ((exp + 112) << 23) | (mant << 13))
  }

  def bfloat16ToFloat(b: Int): Float = java.lang.Float.intBitsToFloat(b << 16)

  /** An unsigned 64-bit value to float, rounded once (the sticky bit keeps ties honest). */
  def unsignedToFloat(l: Long): Float =
    if (l >= 0) l.toFloat else ((l >>> 1) | (l & 1)).toFloat * 2f

  def unsignedToDouble(l: Long): Double =
    if (l >= 0) l.toDouble else ((l >>> 1) | (l & 1)).toDouble * 2.0

  // ---------------------------------------------------------------- shapes

  /** The dims of a shape array (int or long elements), checked: no nulls, none negative. */
  def dims(fn: String, shape: ArrayData, longElements: Boolean): Array[Int] = {
    val n = shape.numElements()
    val out = new Array[Int](n)
    var i = 0
    while (i < n) {
      if (shape.isNullAt(i)) fail(s"$fn: shape has a null dimension at index $i")
      val d = if (longElements) shape.getLong(i) else shape.getInt(i).toLong
      if (d < 0 || d > Int.MaxValue) fail(s"$fn: shape dimension $d at index $i is out of range")
      out(i) = d.toInt
      i += 1
    }
    out
  }

  def numel(dims: Array[Int]): Long = {
    var n = 1L
    var i = 0
    while (i < dims.length) {
      n = Math.multiplyExact(n, dims(i).toLong)
      i += 1
    }
    n
  }

  private def show(dims: Array[Int]): String = dims.mkString("[", ", ", "]")

  // ---------------------------------------------------------------- encode

  /** A Spark array as a Tensor Struct row `(data, shape, dtype)`. */
  def encode(
      fn: String,
      values: ArrayData,
      elementKind: Int,
      containsNull: Boolean,
      shape: ArrayData,
      shapeIsLong: Boolean,
      dtypeName: UTF8String
  ): InternalRow = {
    val dt = dtype(fn, dtypeName.toString)
    val shapeDims = dims(fn, shape, shapeIsLong)
    val n = values.numElements()
    val want = numel(shapeDims)
    if (want != n) fail(s"$fn: shape ${show(shapeDims)} holds $want elements, the array has $n")
    if (n.toLong * dt.size > Int.MaxValue - 64)
      fail(s"$fn: $n elements of ${dt.name} exceed the 2 GB limit of a binary value")
    if (containsNull) {
      var i = 0
      while (i < n) {
        if (values.isNullAt(i)) fail(s"$fn: null element at index $i; tensors cannot hold nulls")
        i += 1
      }
    }
    val out = new Array[Byte](n * dt.size)
    val buf = ByteBuffer.wrap(out).order(ByteOrder.LITTLE_ENDIAN)
    elementKind match {
      case ElementKind.Float if dt.name != "F64" && dt.isFloat => putFloats(values.toFloatArray(), dt, buf)
      case ElementKind.Float => putDoubles(fn, values.toFloatArray().map(_.toDouble), dt, buf)
      case ElementKind.Double => putDoubles(fn, values.toDoubleArray(), dt, buf)
      case kind => putLongs(fn, ElementKind.longs(values, kind), dt, buf)
    }
    new GenericInternalRow(
      Array[Any](out, UnsafeArrayData.fromPrimitiveArray(shapeDims), UTF8String.fromString(dt.name))
    )
  }

  private def putFloats(f: Array[Float], dt: TensorDType, buf: ByteBuffer): Unit = {
    dt.name match {
      case "F32" => buf.asFloatBuffer().put(f)
      case "F16" | "BF16" =>
        // Into a short[] first: a plain array loop, then one bulk little-endian copy.
        val bits = new Array[Short](f.length)
        var i = 0
        if (dt.name == "F16") while (i < f.length) { bits(i) = halfBits(f(i)).toShort; i += 1 }
        else while (i < f.length) { bits(i) = bfloat16Bits(f(i)).toShort; i += 1 }
        buf.asShortBuffer().put(bits)
    }
  }

  private def putDoubles(fn: String, d: Array[Double], dt: TensorDType, buf: ByteBuffer): Unit = {
    if (dt.name == "F64") buf.asDoubleBuffer().put(d)
    else if (dt.isFloat) {
      val f = new Array[Float](d.length)
      var i = 0
      while (i < d.length) { f(i) = d(i).toFloat; i += 1 }
      putFloats(f, dt, buf)
    } else {
      var i = 0
      while (i < d.length) { putInteger(buf, i, dt, exactLong(fn, d(i), i, dt)); i += 1 }
    }
  }

  private def putLongs(fn: String, l: Array[Long], dt: TensorDType, buf: ByteBuffer): Unit = {
    dt.name match {
      case "F64" =>
        var i = 0
        while (i < l.length) { buf.putDouble(8 * i, l(i).toDouble); i += 1 }
      case "F32" | "F16" | "BF16" =>
        putFloats(l.map(_.toFloat), dt, buf)
      case _ =>
        var i = 0
        while (i < l.length) {
          val v = l(i)
          if (v < dt.min || (dt.name != "U64" && v > dt.max)) overflow(fn, v.toString, i, dt)
          putInteger(buf, i, dt, v)
          i += 1
        }
    }
  }

  /** A double that must be an integer within the dtype's range, as the dtype's bits. */
  private def exactLong(fn: String, d: Double, index: Int, dt: TensorDType): Long = {
    if (d.isNaN || d.isInfinite)
      fail(s"$fn: value $d at index $index is not finite; ${dt.name} holds integers only")
    if (d != math.rint(d))
      fail(s"$fn: value $d at index $index is not an integer; ${dt.name} holds integers only")
    if (d < dt.min.toDouble || d >= dt.maxPlusOne) overflow(fn, d.toString, index, dt)
    if (d >= 9.223372036854775807e18) (d - 9.223372036854775807e18).toLong | Long.MinValue
    else d.toLong
  }

  private def overflow(fn: String, value: String, index: Int, dt: TensorDType): Nothing =
    fail(s"$fn: value $value at index $index overflows ${dt.name} (range ${dt.min}..${dt.maxText})")

  private def putInteger(buf: ByteBuffer, i: Int, dt: TensorDType, v: Long): Unit = dt.size match {
    case 1 => buf.put(i, v.toByte)
    case 2 => buf.putShort(2 * i, v.toShort)
    case 4 => buf.putInt(4 * i, v.toInt)
    case 8 => buf.putLong(8 * i, v)
  }

  // ---------------------------------------------------------------- decode

  /** The checked parts of a Tensor Struct: its dtype, dims and little-endian data. */
  final case class Parts(dtype: TensorDType, dims: Array[Int], data: ByteBuffer, numel: Int)

  def parts(fn: String, struct: InternalRow, dataOrd: Int, shapeOrd: Int, dtypeOrd: Int,
      shapeIsLong: Boolean): Parts = {
    for ((ord, field) <- Seq(dataOrd -> "data", shapeOrd -> "shape", dtypeOrd -> "dtype"))
      if (struct.isNullAt(ord)) fail(s"$fn: the Tensor Struct has a null $field")
    val dt = dtype(fn, struct.getUTF8String(dtypeOrd).toString)
    val shapeDims = dims(fn, struct.getArray(shapeOrd), shapeIsLong)
    val data = struct.getBinary(dataOrd)
    val n = numel(shapeDims)
    if (n * dt.size != data.length)
      fail(s"$fn: data has ${data.length} bytes, shape ${show(shapeDims)} of ${dt.name} needs ${n * dt.size}")
    Parts(dt, shapeDims, ByteBuffer.wrap(data).order(ByteOrder.LITTLE_ENDIAN), n.toInt)
  }

  def numelOf(fn: String, struct: InternalRow, dataOrd: Int, shapeOrd: Int, dtypeOrd: Int,
      shapeIsLong: Boolean): Long =
    parts(fn, struct, dataOrd, shapeOrd, dtypeOrd, shapeIsLong).numel.toLong

  /** A Tensor Struct's values as a flat Spark array of `elementKind`: floats and doubles
    * round to nearest even, integer kinds are exact (errors as for encoding). */
  def decode(fn: String, struct: InternalRow, dataOrd: Int, shapeOrd: Int, dtypeOrd: Int,
      shapeIsLong: Boolean, elementKind: Int): ArrayData = {
    val p = parts(fn, struct, dataOrd, shapeOrd, dtypeOrd, shapeIsLong)
    val n = p.numel
    val b = p.data
    val dt = p.dtype
    elementKind match {
      case ElementKind.Float =>
        val out = new Array[Float](n)
        dt.name match {
          case "F32" => b.asFloatBuffer().get(out)
          case "F16" => var i = 0; while (i < n) { out(i) = halfToFloat(b.getShort(2 * i) & 0xffff); i += 1 }
          case "BF16" => var i = 0; while (i < n) { out(i) = bfloat16ToFloat(b.getShort(2 * i) & 0xffff); i += 1 }
          case "F64" => var i = 0; while (i < n) { out(i) = b.getDouble(8 * i).toFloat; i += 1 }
          case "U64" => var i = 0; while (i < n) { out(i) = unsignedToFloat(b.getLong(8 * i)); i += 1 }
          case _ => var i = 0; while (i < n) { out(i) = readLong(b, i, dt).toFloat; i += 1 }
        }
        UnsafeArrayData.fromPrimitiveArray(out)
      case ElementKind.Double =>
        val out = new Array[Double](n)
        var i = 0
        while (i < n) {
          out(i) =
            if (dt.isFloat) readFloat(b, i, dt)
            else if (dt.name == "U64") unsignedToDouble(b.getLong(8 * i))
            else readLong(b, i, dt).toDouble
          i += 1
        }
        UnsafeArrayData.fromPrimitiveArray(out)
      case kind =>
        val target = ElementKind.integerDType(kind)
        val out = new Array[Long](n)
        var i = 0
        while (i < n) {
          out(i) =
            if (dt.isFloat) exactLong(fn, readFloat(b, i, dt), i, target)
            else {
              val v = readLong(b, i, dt)
              if ((dt.name == "U64" && v < 0) || v < target.min || v > target.max)
                overflow(fn, if (dt.name == "U64") java.lang.Long.toUnsignedString(v) else v.toString, i, target)
              v
            }
          i += 1
        }
        ElementKind.narrow(out, kind)
    }
  }

  private def readFloat(b: ByteBuffer, i: Int, dt: TensorDType): Double = dt.name match {
    case "F16" => halfToFloat(b.getShort(2 * i) & 0xffff).toDouble
    case "BF16" => bfloat16ToFloat(b.getShort(2 * i) & 0xffff).toDouble
    case "F32" => b.getFloat(4 * i).toDouble
    case "F64" => b.getDouble(8 * i)
  }

  /** An integer dtype's element as a Long (U64: its bits). */
  private def readLong(b: ByteBuffer, i: Int, dt: TensorDType): Long = dt.name match {
    case "U8" => b.get(i) & 0xffL
    case "I8" => b.get(i).toLong
    case "U16" => b.getShort(2 * i) & 0xffffL
    case "I16" => b.getShort(2 * i).toLong
    case "U32" => b.getInt(4 * i) & 0xffffffffL
    case "I32" => b.getInt(4 * i).toLong
    case _ => b.getLong(8 * i)
  }
}

/** Element types of Spark numeric arrays, as small integers that generated code can pass. */
object ElementKind {
  final val Byte = 0
  final val Short = 1
  final val Int = 2
  final val Long = 3
  final val Float = 4
  final val Double = 5

  import org.apache.spark.sql.types._

  def of(t: DataType): Option[Int] = t match {
    case ByteType => Some(Byte)
    case ShortType => Some(Short)
    case IntegerType => Some(Int)
    case LongType => Some(Long)
    case FloatType => Some(Float)
    case DoubleType => Some(Double)
    case _ => None
  }

  def dataType(kind: Int): DataType =
    Seq(ByteType, ShortType, IntegerType, LongType, FloatType, DoubleType)(kind)

  def integerDType(kind: Int): TensorDType =
    TensorCodec.dtype("", Seq("I8", "I16", "I32", "I64")(kind))

  def longs(values: ArrayData, kind: Int): Array[scala.Long] = kind match {
    case Byte => values.toByteArray().map(_.toLong)
    case Short => values.toShortArray().map(_.toLong)
    case Int => values.toIntArray().map(_.toLong)
    case Long => values.toLongArray()
  }

  def narrow(l: Array[scala.Long], kind: Int): ArrayData = kind match {
    case Byte => UnsafeArrayData.fromPrimitiveArray(l.map(_.toByte))
    case Short => UnsafeArrayData.fromPrimitiveArray(l.map(_.toShort))
    case Int => UnsafeArrayData.fromPrimitiveArray(l.map(_.toInt))
    case Long => UnsafeArrayData.fromPrimitiveArray(l)
  }
}
