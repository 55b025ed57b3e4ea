package io.github.pysparksafetensors.write

import java.util.Locale

import org.apache.spark.sql.types._

/** The dtype names the writer accepts, as the format layer's table has them: canonical
  * names, the usual aliases, and each dtype's rank in the reference library's enum (a
  * shard orders its tensors by rank, widest first, then by name). */
private[write] object DTypes {
  /** The twelve writable dtypes with their byte size and rank. */
  val Size: Map[String, Int] = Map(
    "F16" -> 2, "F32" -> 4, "F64" -> 8, "BF16" -> 2, "U8" -> 1, "I8" -> 1,
    "U16" -> 2, "I16" -> 2, "U32" -> 4, "I32" -> 4, "U64" -> 8, "I64" -> 8)
  val Writable: Seq[String] = Seq("F16", "F32", "F64", "BF16", "U8", "I8", "U16", "I16", "U32", "I32", "U64", "I64")
  val Rank: Map[String, Int] = Map(
    "BOOL" -> 0, "F4" -> 1, "F6_E2M3" -> 2, "F6_E3M2" -> 3, "U8" -> 4, "I8" -> 5, "F8_E5M2" -> 6,
    "F8_E4M3" -> 7, "F8_E8M0" -> 8, "F8_E4M3FNUZ" -> 9, "F8_E5M2FNUZ" -> 10, "I16" -> 11,
    "U16" -> 12, "F16" -> 13, "BF16" -> 14, "I32" -> 15, "U32" -> 16, "F32" -> 17, "C64" -> 18,
    "F64" -> 19, "I64" -> 20, "U64" -> 21)

  private val Aliases: Map[String, Seq[String]] = Map(
    "BOOL" -> Seq("bool", "boolean"), "U8" -> Seq("uint8"), "I8" -> Seq("int8", "tinyint"),
    "I16" -> Seq("int16", "short", "smallint"), "U16" -> Seq("uint16"),
    "I32" -> Seq("int32", "int", "integer"), "U32" -> Seq("uint32"),
    "I64" -> Seq("int64", "long", "bigint"), "U64" -> Seq("uint64"),
    "F16" -> Seq("float16", "fp16", "half"), "BF16" -> Seq("bfloat16", "bf16"),
    "F32" -> Seq("float32", "fp32", "float", "single"), "F64" -> Seq("float64", "fp64", "double"),
    "C64" -> Seq("complex64", "cfloat"), "F8_E5M2" -> Seq("float8_e5m2"),
    "F8_E4M3" -> Seq("float8_e4m3fn", "float8_e4m3"), "F8_E8M0" -> Seq("float8_e8m0fnu", "float8_e8m0"),
    "F8_E4M3FNUZ" -> Seq("float8_e4m3fnuz"), "F8_E5M2FNUZ" -> Seq("float8_e5m2fnuz"))
  private val Names: Map[String, String] =
    Rank.keys.map(n => n.toLowerCase(Locale.ROOT) -> n).toMap ++
      Aliases.toSeq.flatMap { case (n, as) => as.map(_ -> n) }
  private val AliasExamples = "float16, fp16, half, bfloat16, float32, float, int64, long, torch.float16, ..."

  /** The canonical name of a writable dtype named any usual way, or an error naming
    * `option`, the valid names and the closest one. */
  def writable(option: String, text: String): String = {
    var key = text.trim.toLowerCase(Locale.ROOT)
    Seq("torch.", "numpy.", "np.").find(key.startsWith).foreach(p => key = key.substring(p.length))
    Names.get(key) match {
      case Some(name) if Size.contains(name) => name
      case Some(name) =>
        throw new SafetensorsWriteException(
          s"option $option='$text': $name can be read but not written; valid dtypes are " +
            s"${Writable.mkString(", ")} (or their usual names: $AliasExamples)")
      case None =>
        val close = Names.keys.toSeq.map(k => k -> Similarity.ratio(key, k)).filter(_._2 >= 0.6)
          .sortBy(-_._2).map(k => Names(k._1)).find(Size.contains)
        throw new SafetensorsWriteException(
          s"option $option='$text': valid dtypes are ${Writable.mkString(", ")} (or their usual " +
            s"names: $AliasExamples)${close.fold("")(c => s"; did you mean $c?")}")
    }
  }

  /** The dtype a Spark numeric type is written as by default, if it can be written. */
  def ofSpark(t: DataType): Option[String] = t match {
    case FloatType => Some("F32")
    case DoubleType => Some("F64")
    case IntegerType => Some("I32")
    case LongType => Some("I64")
    case ShortType => Some("I16")
    case ByteType => Some("I8")
    case _ => None
  }
}
