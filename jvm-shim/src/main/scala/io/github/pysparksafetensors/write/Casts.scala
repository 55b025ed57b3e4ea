package io.github.pysparksafetensors.write

import io.github.pysparksafetensors.TensorCodec

/** Values into a writable dtype's little-endian bytes, with the Python format core's
  * rules: float targets round to nearest even (F64 → F16/BF16 through F32, as torch does;
  * integers through F32 too) and must keep every integer exactly; integer targets are
  * exact (an overflow, a fraction, NaN or infinity is a `CastException` naming the value). */
private[write] object Casts {
  final class CastException(message: String) extends RuntimeException(message)

  private def fail(message: String): Nothing = throw new CastException(message)

  private val TwoTo63 = 9.223372036854775808e18

  private def range(t: String): (BigInt, BigInt) = {
    val bits = DTypes.Size(t) * 8
    if (t.startsWith("U")) (BigInt(0), (BigInt(1) << bits) - 1)
    else (-(BigInt(1) << (bits - 1)), (BigInt(1) << (bits - 1)) - 1)
  }

  private def overflow(value: String, t: String): Nothing = {
    val (lo, hi) = range(t)
    fail(s"value $value overflows $t (range $lo..$hi)")
  }

  private def putInteger(out: Bytes, t: String, v: Long): Unit = DTypes.Size(t) match {
    case 1 => out.putByte(v.toByte)
    case 2 => out.putShort(v.toShort)
    case 4 => out.putInt(v.toInt)
    case _ => out.putLong(v)
  }

  /** A float value as an integer of dtype `t`, exactly, or an error. */
  private def exactInteger(d: Double, t: String): Long = {
    if (d.isNaN || d.isInfinite) fail(s"value $d is not finite; $t holds integers only")
    if (d != math.rint(d)) fail(s"value $d is not an integer; $t holds integers only")
    val (lo, hi) = range(t)
    if (d < lo.toDouble || d >= (hi + 1).toDouble) overflow(d.toString, t)
    if (d >= TwoTo63) (d - TwoTo63).toLong | Long.MinValue else d.toLong
  }

  def floats(f: Array[Float], n: Int, t: String, out: Bytes): Unit = t match {
    case "F32" => out.putFloats(f, n)
    case "F16" => var i = 0; while (i < n) { out.putShort(TensorCodec.halfBits(f(i)).toShort); i += 1 }
    case "BF16" => var i = 0; while (i < n) { out.putShort(TensorCodec.bfloat16Bits(f(i)).toShort); i += 1 }
    case "F64" => var i = 0; while (i < n) { out.putDouble(f(i).toDouble); i += 1 }
    case _ => var i = 0; while (i < n) { putInteger(out, t, exactInteger(f(i).toDouble, t)); i += 1 }
  }

  def doubles(d: Array[Double], n: Int, t: String, out: Bytes): Unit = t match {
    case "F64" => out.putDoubles(d, n)
    case "F32" | "F16" | "BF16" =>
      val f = new Array[Float](n)
      var i = 0
      while (i < n) { f(i) = d(i).toFloat; i += 1 }
      floats(f, n, t, out)
    case _ => var i = 0; while (i < n) { putInteger(out, t, exactInteger(d(i), t)); i += 1 }
  }

  /** Integers (`unsigned`: the longs hold U64 bits) into dtype `t`. */
  def longs(l: Array[Long], n: Int, unsigned: Boolean, t: String, out: Bytes): Unit = {
    def value(v: Long): BigInt = if (unsigned && v < 0) BigInt(v) + (BigInt(1) << 64) else BigInt(v)
    t match {
      case "F16" | "BF16" | "F32" | "F64" =>
        var i = 0
        while (i < n) {
          val v = l(i)
          val asFloat = if (unsigned) TensorCodec.unsignedToFloat(v) else v.toFloat
          val back: Double = t match {
            case "F64" => if (unsigned) TensorCodec.unsignedToDouble(v) else v.toDouble
            case "F32" => asFloat.toDouble
            case "F16" => TensorCodec.halfToFloat(TensorCodec.halfBits(asFloat)).toDouble
            case _ => TensorCodec.bfloat16ToFloat(TensorCodec.bfloat16Bits(asFloat)).toDouble
          }
          val kept = !back.isInfinite && (
            if (math.abs(back) < 9.007199254740992e15) back.toLong == v && !(unsigned && v < 0)
            else BigDecimal(back).toBigIntExact.contains(value(v)))
          if (!kept) fail(s"value ${value(v)} is not exactly representable in $t (it would become $back)")
          t match {
            case "F64" => out.putDouble(back)
            case "F32" => out.putFloat(asFloat)
            case "F16" => out.putShort(TensorCodec.halfBits(asFloat).toShort)
            case _ => out.putShort(TensorCodec.bfloat16Bits(asFloat).toShort)
          }
          i += 1
        }
      case _ =>
        val (lo, hi) = range(t)
        val fast = !unsigned && hi <= BigInt(Long.MaxValue)
        val (flo, fhi) = (lo.toLong, hi.min(BigInt(Long.MaxValue)).toLong)
        var i = 0
        while (i < n) {
          val v = l(i)
          if (fast) { if (v < flo || v > fhi) overflow(v.toString, t) }
          else { val b = value(v); if (b < lo || b > hi) overflow(b.toString, t) }
          putInteger(out, t, v)
          i += 1
        }
    }
  }
}

/** A growable little-endian byte buffer. */
private[write] final class Bytes(initial: Int = 1 << 16) {
  var array: Array[Byte] = new Array[Byte](math.max(initial, 16))
  var size: Int = 0
  private var view = java.nio.ByteBuffer.wrap(array).order(java.nio.ByteOrder.LITTLE_ENDIAN)

  def reserve(more: Long): Unit = {
    val need = size.toLong + more
    if (need > array.length) {
      if (need > Int.MaxValue - 16)
        throw new SafetensorsWriteException(
          "a tensor buffer would exceed 2 GB; use a smaller batch_size or target_shard_size_mb")
      val grown = math.min(math.max(need, array.length.toLong * 2), Int.MaxValue - 16L).toInt
      array = java.util.Arrays.copyOf(array, grown)
      view = java.nio.ByteBuffer.wrap(array).order(java.nio.ByteOrder.LITTLE_ENDIAN)
    }
  }
  def putByte(v: Byte): Unit = { reserve(1); array(size) = v; size += 1 }
  def putShort(v: Short): Unit = { reserve(2); view.putShort(size, v); size += 2 }
  def putInt(v: Int): Unit = { reserve(4); view.putInt(size, v); size += 4 }
  def putLong(v: Long): Unit = { reserve(8); view.putLong(size, v); size += 8 }
  def putFloat(v: Float): Unit = { reserve(4); view.putFloat(size, v); size += 4 }
  def putDouble(v: Double): Unit = { reserve(8); view.putDouble(size, v); size += 8 }
  def putFloats(f: Array[Float], n: Int): Unit = {
    reserve(4L * n); view.position(size); view.asFloatBuffer().put(f, 0, n); size += 4 * n
  }
  def putDoubles(d: Array[Double], n: Int): Unit = {
    reserve(8L * n); view.position(size); view.asDoubleBuffer().put(d, 0, n); size += 8 * n
  }
  def putBytes(b: Array[Byte], off: Int, n: Int): Unit = {
    reserve(n); System.arraycopy(b, off, array, size, n); size += n
  }
  /** `n` bytes copied from Spark's memory at (`base`, `offset`). */
  def putMemory(base: AnyRef, offset: Long, n: Int): Unit = {
    reserve(n)
    org.apache.spark.unsafe.Platform.copyMemory(
      base, offset, array, org.apache.spark.unsafe.Platform.BYTE_ARRAY_OFFSET + size, n)
    size += n
  }
  def zeros(n: Long): Unit = { reserve(n); java.util.Arrays.fill(array, size, size + n.toInt, 0.toByte); size += n.toInt }
  def truncate(n: Int): Unit = size = n
}
