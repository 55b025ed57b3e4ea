package io.github.pysparksafetensors.write

import java.io.OutputStream
import java.nio.charset.StandardCharsets.UTF_8
import java.nio.{ByteBuffer, ByteOrder}

/** One tensor of a shard: its name, dtype, shape, and where its bytes lie in the task's
  * buffers (`buffer`, `start`, `length`). */
private[write] final case class TensorSlot(
    name: String, dtype: String, shape: Array[Int], buffer: Bytes, start: Int, length: Int)

/** A shard's header laid out as the reference library (`safetensors.torch.save`) lays it
  * out: tensors by dtype rank descending, then by name (code point order), offsets
  * packed, compact JSON with non-ASCII kept as UTF-8, metadata keys sorted, the JSON
  * padded with spaces to a multiple of 8 and prefixed by its length (u64 little-endian). */
private[write] final class ShardLayout(val header: Array[Byte], val order: Array[TensorSlot], val begins: Array[Long]) {
  def dataStart: Long = header.length.toLong
  def fileSize: Long = dataStart + (if (order.isEmpty) 0L else begins.last + order.last.length)
}

private[write] object ShardFormat {
  val MetadataKey = "__metadata__"

  /** A JSON string as Python's `json.encoder.encode_basestring` writes it. */
  def jsonString(s: String, sb: java.lang.StringBuilder): Unit = {
    sb.append('"')
    var i = 0
    while (i < s.length) {
      val c = s.charAt(i)
      c match {
        case '"' => sb.append("\\\"")
        case '\\' => sb.append("\\\\")
        case '\n' => sb.append("\\n")
        case '\r' => sb.append("\\r")
        case '\t' => sb.append("\\t")
        case '\b' => sb.append("\\b")
        case '\f' => sb.append("\\f")
        case _ if c < 0x20 => sb.append(f"\\u${c.toInt}%04x")
        case _ => sb.append(c)
      }
      i += 1
    }
    sb.append('"')
  }

  private def hasLoneSurrogate(s: String): Boolean = {
    var i = 0
    while (i < s.length) {
      val c = s.charAt(i)
      if (Character.isHighSurrogate(c)) {
        if (i + 1 >= s.length || !Character.isLowSurrogate(s.charAt(i + 1))) return true
        i += 1
      } else if (Character.isLowSurrogate(c)) return true
      i += 1
    }
    false
  }

  private def unsignedCompare(a: Array[Byte], b: Array[Byte]): Int =
    java.util.Arrays.compareUnsigned(a, b)

  def layout(slots: Seq[TensorSlot], metadata: Map[String, String]): ShardLayout = {
    val names = slots.map(_.name)
    if (names.distinct.size != names.size) {
      val dup = names.diff(names.distinct).head
      throw new SafetensorsWriteException(s"tensor '$dup': two tensors are named '$dup'")
    }
    if (names.contains(MetadataKey))
      throw new SafetensorsWriteException(s"'$MetadataKey' is reserved and cannot name a tensor")
    slots.find(s => hasLoneSurrogate(s.name)).foreach { s =>
      throw new SafetensorsWriteException(
        s"tensor '${s.name}': tensor name holds a lone UTF-16 surrogate, which UTF-8 cannot encode")
    }
    // UTF-8 byte order is code point order, the order Python sorts names in.
    val keyed = slots.map(s => (s, s.name.getBytes(UTF_8))).toArray
    val order = keyed.sortWith { case ((a, ab), (b, bb)) =>
      val ra = DTypes.Rank(a.dtype)
      val rb = DTypes.Rank(b.dtype)
      if (ra != rb) ra > rb else unsignedCompare(ab, bb) < 0
    }.map(_._1)
    val begins = new Array[Long](order.length)
    val sb = new java.lang.StringBuilder(64 + 96 * order.length)
    sb.append('{')
    if (metadata != null) {
      sb.append("\"").append(MetadataKey).append("\":{")
      metadata.keys.toSeq.sortWith((a, b) => unsignedCompare(a.getBytes(UTF_8), b.getBytes(UTF_8)) < 0)
        .zipWithIndex.foreach { case (k, i) =>
          if (i > 0) sb.append(',')
          jsonString(k, sb); sb.append(':'); jsonString(metadata(k), sb)
        }
      sb.append('}')
    }
    var offset = 0L
    var i = 0
    while (i < order.length) {
      val s = order(i)
      if (i > 0 || metadata != null) sb.append(',')
      jsonString(s.name, sb)
      sb.append(":{\"dtype\":\"").append(s.dtype).append("\",\"shape\":[")
      var d = 0
      while (d < s.shape.length) { if (d > 0) sb.append(','); sb.append(s.shape(d)); d += 1 }
      begins(i) = offset
      sb.append("],\"data_offsets\":[").append(offset).append(',').append(offset + s.length).append("]}")
      offset += s.length
      i += 1
    }
    sb.append('}')
    val body = sb.toString.getBytes(UTF_8)
    val padded = body.length + ((8 - body.length % 8) % 8)
    val header = new Array[Byte](8 + padded)
    ByteBuffer.wrap(header).order(ByteOrder.LITTLE_ENDIAN).putLong(padded.toLong)
    System.arraycopy(body, 0, header, 8, body.length)
    java.util.Arrays.fill(header, 8 + body.length, header.length, ' '.toByte)
    new ShardLayout(header, order, begins)
  }

  /** Write the shard's bytes in file order to `out`, updating `crc` (if any) with each. */
  def write(layout: ShardLayout, out: OutputStream, crc: java.util.zip.Checksum): Unit = {
    def put(b: Array[Byte], off: Int, n: Int): Unit = {
      out.write(b, off, n)
      if (crc != null) crc.update(b, off, n)
    }
    put(layout.header, 0, layout.header.length)
    // Consecutive slots of one buffer go out as one write.
    var i = 0
    val o = layout.order
    while (i < o.length) {
      var j = i + 1
      var end = o(i).start + o(i).length
      while (j < o.length && (o(j).buffer eq o(i).buffer) && o(j).start == end) {
        end += o(j).length; j += 1
      }
      put(o(i).buffer.array, o(i).start, end - o(i).start)
      i = j
    }
  }
}
