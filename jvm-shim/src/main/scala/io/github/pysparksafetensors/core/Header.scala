package io.github.pysparksafetensors.core

import java.nio.{ByteBuffer, ByteOrder}

import scala.jdk.CollectionConverters._

import com.fasterxml.jackson.core.JsonParser
import com.fasterxml.jackson.databind.{DeserializationFeature, JsonNode, ObjectMapper}

/** One tensor of a header: `begin`/`end` are absolute offsets in the file. */
final case class TensorInfo(name: String, dtype: String, shape: Array[Long], begin: Long, end: Long) {
  def rows: Long = if (shape.isEmpty) 1L else shape(0)
  def sampleShape: Seq[Long] = shape.toSeq.drop(1)
  def numel: Long = shape.product
}

/** A safetensors header: tensors in file order, with the byte where data begins. */
final case class Header(tensors: Seq[TensorInfo], dataStart: Long, metadata: Map[String, String]) {
  private lazy val byName = tensors.map(t => t.name -> t).toMap
  def get(name: String): Option[TensorInfo] = byName.get(name)
}

object Header {
  /** Every dtype of the format with its size in bits (sub-byte dtypes pack whole bytes). */
  val Bits: Map[String, Int] = Map(
    "BOOL" -> 8, "U8" -> 8, "I8" -> 8, "F8_E5M2" -> 8, "F8_E4M3" -> 8, "F8_E8M0" -> 8,
    "F8_E4M3FNUZ" -> 8, "F8_E5M2FNUZ" -> 8, "F4" -> 4, "F6_E2M3" -> 6, "F6_E3M2" -> 6,
    "I16" -> 16, "U16" -> 16, "F16" -> 16, "BF16" -> 16, "I32" -> 32, "U32" -> 32, "F32" -> 32,
    "C64" -> 64, "F64" -> 64, "I64" -> 64, "U64" -> 64)
  /** The largest header the reference library accepts. */
  val MaxHeaderBytes: Long = 100L * 1000 * 1000
  /** Strict as the Python format layer: a key repeated in an object and anything after
    * the closing brace but padding are refused (Jackson accepts both by default). */
  private val mapper = new ObjectMapper()
    .enable(JsonParser.Feature.STRICT_DUPLICATE_DETECTION)
    .enable(DeserializationFeature.FAIL_ON_TRAILING_TOKENS)
  /** The rules named at the end of an error, as the Python format layer names them. */
  val FormatRule = "safetensors format"
  val SizeRule = "file holds the 8-byte header length, the header and every tensor's bytes"

  /** The header of `name`, `size` bytes long, read with two small ranged reads. */
  def read(storage: Storage, name: String, size: Long): Header = {
    val where = storage.display(name)
    def fail(msg: String): Nothing = throw new SafetensorsReadException(s"file '$where': $msg [rule: $FormatRule]")
    if (size < 8) fail(s"$size bytes is too short for a safetensors file (8-byte header length first)")
    val n = ByteBuffer.wrap(storage.readRange(name, 0, 8)).order(ByteOrder.LITTLE_ENDIAN).getLong
    if (n < 2 || n > MaxHeaderBytes || n > size - 8)
      fail(s"header length $n does not fit a file of $size bytes (not a safetensors file?)")
    parse(storage.readRange(name, 8, n), size, where)
  }

  /** A header's JSON checked as the reference library checks it: known dtypes, byte
    * ranges that match shapes, tile the data area without holes and end at the file end. */
  def parse(json: Array[Byte], size: Long, where: String): Header = {
    def fail(msg: String): Nothing = throw new SafetensorsReadException(s"file '$where': $msg [rule: $FormatRule]")
    if (json.isEmpty || json(0) != '{') fail("the header must begin with '{'")
    val doc: JsonNode =
      try mapper.readTree(json)
      catch { case e: com.fasterxml.jackson.core.JacksonException => fail(s"the header is not valid JSON (${e.getOriginalMessage})") }
    if (doc == null || !doc.isObject) fail("the header is not a JSON object")
    val dataStart = 8L + json.length
    var metadata = Map.empty[String, String]
    val tensors = doc.properties().asScala.toSeq.flatMap { e =>
      val (name, t) = (e.getKey, e.getValue)
      if (name == "__metadata__") {
        if (!t.isObject || !t.properties().asScala.forall(_.getValue.isTextual))
          fail("__metadata__ must be an object of strings")
        metadata = t.properties().asScala.map(m => m.getKey -> m.getValue.asText).toMap
        None
      } else Some(tensor(name, t, dataStart, fail))
    }.sortBy(_.begin)
    var at = dataStart
    tensors.foreach { t =>
      if (t.begin != at) fail(s"tensor '${t.name}' begins at byte ${t.begin - dataStart} of the data, expected ${at - dataStart} (holes or overlaps are invalid)")
      at = t.end
    }
    if (at != size) throw new SafetensorsReadException(
      s"file '$where': the tensors end at byte $at but the file has $size bytes [rule: $SizeRule]")
    Header(tensors, dataStart, metadata)
  }

  private def tensor(name: String, t: JsonNode, dataStart: Long, fail: String => Nothing): TensorInfo = {
    if (!t.isObject || !t.has("dtype") || !t.has("shape") || !t.has("data_offsets"))
      fail(s"tensor '$name' needs dtype, shape and data_offsets")
    val dtype = t.get("dtype").asText
    val bits = Bits.get(dtype).filter(_ => t.get("dtype").isTextual)
      .getOrElse(fail(s"tensor '$name' has unknown dtype ${t.get("dtype")}"))
    def whole(n: JsonNode): Boolean = n.isIntegralNumber && n.canConvertToLong && n.asLong >= 0
    if (!t.get("shape").isArray) fail(s"tensor '$name' has shape ${t.get("shape")}, not a list")
    val shape = t.get("shape").elements().asScala.map { d =>
      if (!whole(d)) fail(s"tensor '$name' has a bad dimension $d")
      d.asLong
    }.toArray
    val given = t.get("data_offsets")
    if (!given.isArray || !given.elements().asScala.forall(whole))
      fail(s"tensor '$name' has bad data_offsets $given")
    val offsets = given.elements().asScala.map(_.asLong).toArray
    if (offsets.length != 2 || offsets(1) < offsets(0))
      fail(s"tensor '$name' has bad data_offsets ${t.get("data_offsets")}")
    val numel = shape.foldLeft(BigInt(1))(_ * _)
    val bytes = (numel * bits + 7) / 8
    if (bytes != BigInt(offsets(1) - offsets(0)))
      fail(s"tensor '$name' is $dtype${shape.mkString("[", ", ", "]")} ($bytes bytes) but data_offsets span ${offsets(1) - offsets(0)} bytes")
    TensorInfo(name, dtype, shape, dataStart + offsets(0), dataStart + offsets(1))
  }
}
