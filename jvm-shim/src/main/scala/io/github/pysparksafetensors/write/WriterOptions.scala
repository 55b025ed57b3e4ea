package io.github.pysparksafetensors.write

import java.util.Locale

import scala.jdk.CollectionConverters._

import com.fasterxml.jackson.databind.{JsonNode, ObjectMapper}

/** A bad writer option, a column the data cannot be written from, or a refused append;
  * the message is one line naming the option, column or rule and what to do instead. */
final class SafetensorsWriteException(message: String) extends IllegalArgumentException(message)

/** The `safetensors` writer's options, parsed and checked: the twin of the Python
  * `WriterOptions` (same names, defaults, bounds and messages in substance).
  *
  * Exactly one of `batch_size` (batch mode: every N rows of a partition become one shard)
  * or `name_col` (KV mode: one tensor per row and column, named `{key}{kv_separator}{col}`).
  */
final case class WriterOptions(
    path: String,
    batchSize: Option[Int],
    nameCol: Option[String],
    dtype: Option[String],
    columnDtypes: Map[String, String],
    columns: Option[Seq[String]],
    shapes: Map[String, Seq[Int]],
    tailStrategy: String,
    duplicatesStrategy: String,
    kvSeparator: String,
    targetShardSizeMb: Int,
    generateIndex: Boolean,
    metadata: Map[String, String],
    checksum: String,
    keepPreviousGeneration: Boolean
) {
  def mode: String = if (nameCol.isDefined) "kv" else "batch"

  /** The dtype a numeric column of dtype `source` is written as. */
  def targetDtype(column: String, source: String): String =
    columnDtypes.getOrElse(column, dtype.getOrElse(source))
}

object WriterOptions {
  val TailStrategies: Seq[String] = Seq("write", "drop", "pad")
  val DuplicateStrategies: Seq[String] = Seq("fail", "lastWin")
  val Checksums: Seq[String] = Seq("crc32c", "none")
  val MinShardMb = 50
  val DefaultShardMb = 300
  val MaxShardMb = 1000
  val MaxRows: Int = Int.MaxValue

  /** Every option the writer takes besides `path`, in the order they are checked. */
  val Names: Seq[String] = Seq(
    "batch_size", "name_col", "dtype", "columns", "shapes", "tail_strategy",
    "duplicatesStrategy", "kv_separator", "target_shard_size_mb", "generate_index",
    "metadata", "checksum", "keep_previous_generation", "implementation"
  )

  /** Whether `key` (lower case) is one of the writer's options, storage ones included. */
  def takes(key: String): Boolean =
    key == "path" || (Names ++ StorageOptions).exists(_.equalsIgnoreCase(key))

  /** The default of each option that has one, as the text a user would pass
    * (`generate_index`: true in KV mode, false in batch mode). */
  val Defaults: Map[String, String] = Map(
    "tail_strategy" -> "write",
    "duplicatesStrategy" -> "fail",
    "kv_separator" -> "__",
    "target_shard_size_mb" -> DefaultShardMb.toString,
    "metadata" -> "{}",
    "checksum" -> "crc32c",
    "keep_previous_generation" -> "false"
  )

  /** Storage options, as the Python writer takes them for S3-compatible stores; here they
    * become the s3a connector's Hadoop settings (`storageConf`). */
  val StorageOptions: Seq[String] = Seq("endpoint_url", "region", "path_style", "anonymous")

  /** The Hadoop settings of the storage options in `options` (names case-insensitive). */
  def storageConf(options: java.util.Map[String, String]): Map[String, String] =
    options.asScala.toSeq.flatMap { case (k, v) =>
      k.toLowerCase(Locale.ROOT) match {
        case "endpoint_url" => Seq("fs.s3a.endpoint" -> v)
        case "region" => Seq("fs.s3a.endpoint.region" -> v)
        case "path_style" => Seq("fs.s3a.path.style.access" -> parseBool(k, v).toString)
        case "anonymous" if parseBool(k, v) =>
          Seq("fs.s3a.aws.credentials.provider" -> "org.apache.hadoop.fs.s3a.AnonymousAWSCredentialsProvider")
        case _ => Nil
      }
    }.toMap

  /** `Names` and `Defaults` as JSON, for tools that compare the two writers' tables. */
  def describe(): String = {
    val mapper = new ObjectMapper()
    val doc = mapper.createObjectNode()
    val names = doc.putArray("names")
    Names.foreach(names.add)
    val defaults = doc.putObject("defaults")
    Defaults.toSeq.sorted.foreach { case (k, v) => defaults.put(k, v) }
    mapper.writeValueAsString(doc)
  }

  private def fail(message: String): Nothing = throw new SafetensorsWriteException(message)

  def parseBool(name: String, value: String): Boolean = value.trim.toLowerCase(Locale.ROOT) match {
    case "true" | "1" | "yes" => true
    case "false" | "0" | "no" => false
    case _ => fail(s"option $name='$value': expected true or false")
  }

  def parseInt(name: String, value: String, lo: Int, hi: Int = MaxRows): Int = {
    val text = value.trim
    if (!text.matches("[+-]?[0-9]{1,30}"))
      fail(s"option $name='$value': expected an integer between $lo and $hi")
    val n = BigInt(text)
    if (n < lo || n > hi) fail(s"option $name=$n: must be between $lo and $hi")
    n.toInt
  }

  def parseChoice(name: String, value: String, choices: Seq[String]): String =
    choices.find(_.equalsIgnoreCase(value)).getOrElse(
      fail(s"option $name='$value': valid values are ${choices.mkString(", ")}"))

  private lazy val mapper = new ObjectMapper()

  /** A JSON option (no NaN/Infinity); errors show `example`. */
  def parseJson(name: String, value: String, example: String): JsonNode = {
    val node =
      try mapper.readTree(value)
      catch {
        case e: com.fasterxml.jackson.core.JacksonException =>
          fail(s"option $name: not valid JSON (${e.getOriginalMessage}); example: $example")
      }
    if (node == null || node.isMissingNode) fail(s"option $name: not valid JSON (empty); example: $example")
    node
  }

  private def nonEmpty(name: String, value: String): String =
    if (value.isEmpty) fail(s"option $name is empty") else value

  private def kvSeparator(value: String): String =
    if (value.isEmpty)
      fail("option kv_separator is empty: with no separator a tensor name cannot be split " +
        "back into key and column; use one that no key contains, such as '__' (the " +
        "default), '/' or '::'")
    else value

  private def dtypeOption(value: String): Either[String, Map[String, String]] = {
    val raw = value.trim
    if (!raw.startsWith("{")) return Left(DTypes.writable("dtype", raw))
    val node = parseJson("dtype", raw, """{"activation": "F16", "token_pos": "I32"}""")
    if (!node.isObject) fail("option dtype: a JSON object of column -> dtype")
    Right(node.properties().asScala.map { e =>
      e.getKey -> DTypes.writable("dtype", if (e.getValue.isTextual) e.getValue.asText else e.getValue.toString)
    }.toMap)
  }

  private def columnsOption(value: String): Seq[String] = {
    val cols = value.split(",").map(_.trim).filter(_.nonEmpty).toSeq
    if (cols.isEmpty) fail("option columns is empty; give a comma-separated list of column names")
    cols
  }

  private def shapesOption(value: String): Map[String, Seq[Int]] = {
    val node = parseJson("shapes", value, """{"image": [3, 224, 224]}""")
    def dim(d: JsonNode) = d.isIntegralNumber && d.canConvertToLong && d.asLong >= 0 && d.asLong <= MaxRows
    val ok = node.isObject && node.properties().asScala.forall { e =>
      e.getValue.isArray && e.getValue.elements().asScala.forall(dim)
    }
    if (!ok)
      fail(s"""option shapes: a JSON object of column -> list of ints in 0..$MaxRows, e.g. {"image": [3, 224, 224]}""")
    node.properties().asScala.map(e => e.getKey -> e.getValue.elements().asScala.map(_.asInt).toList).toMap
  }

  private def metadataOption(value: String): Map[String, String] = {
    val node = parseJson("metadata", value,
      """{"model": "all-MiniLM-L6-v2", "hook_point": "encoder.layer.0"}""")
    if (!node.isObject || !node.properties().asScala.forall(_.getValue.isTextual))
      fail("option metadata: a JSON object of string keys to string values")
    node.properties().asScala.map(e => e.getKey -> e.getValue.asText).toMap
  }

  /** The unknown option names, the closest known one for each, and every known name. */
  private def unknownOptions(unknown: Seq[String]): Nothing = {
    val hints = unknown.map { name =>
      Names.map(k => k -> Similarity.ratio(name.toLowerCase(Locale.ROOT), k.toLowerCase(Locale.ROOT)))
        .filter(_._2 >= 0.6).sortBy(-_._2).headOption
        .fold(name)(k => s"$name (did you mean ${k._1}?)")
    }
    fail(s"unknown option(s) ${hints.mkString(", ")}; valid options: " +
      Names.sortBy(_.toLowerCase(Locale.ROOT)).mkString(", "))
  }

  /** Parse Spark's write options (names case-insensitive); `path` comes from `save(path)`. */
  def parse(options: java.util.Map[String, String]): WriterOptions = {
    val opts = options.asScala.map { case (k, v) => k.toLowerCase(Locale.ROOT) -> v }.toMap
    val known = ("path" +: (Names ++ StorageOptions)).map(_.toLowerCase(Locale.ROOT)).toSet
    val unknown = options.asScala.keys.filterNot(k => known(k.toLowerCase(Locale.ROOT))).toSeq.sorted
    if (unknown.nonEmpty) unknownOptions(unknown)
    def get(name: String): Option[String] = opts.get(name.toLowerCase(Locale.ROOT))
    val path = get("path").filter(_.nonEmpty).getOrElse(
      fail("no path: use .save(path) or .option('path', ...)"))
    if (get("batch_size").isDefined == get("name_col").isDefined)
      fail("set exactly one of batch_size (batch mode) or name_col (KV mode)")
    val dtypes = get("dtype").map(dtypeOption)
    WriterOptions(
      path = path,
      batchSize = get("batch_size").map(parseInt("batch_size", _, 1)),
      nameCol = get("name_col").map(nonEmpty("name_col", _)),
      dtype = dtypes.flatMap(_.left.toOption),
      columnDtypes = dtypes.flatMap(_.toOption).getOrElse(Map.empty),
      columns = get("columns").map(columnsOption),
      shapes = get("shapes").map(shapesOption).getOrElse(Map.empty),
      tailStrategy = get("tail_strategy").fold("write")(parseChoice("tail_strategy", _, TailStrategies)),
      duplicatesStrategy = get("duplicatesStrategy").fold("fail")(
        parseChoice("duplicatesStrategy", _, DuplicateStrategies)),
      kvSeparator = get("kv_separator").fold("__")(kvSeparator),
      targetShardSizeMb = get("target_shard_size_mb").fold(DefaultShardMb)(
        parseInt("target_shard_size_mb", _, MinShardMb, MaxShardMb)),
      generateIndex = get("generate_index").fold(get("name_col").isDefined)(parseBool("generate_index", _)),
      metadata = get("metadata").map(metadataOption).getOrElse(Map.empty),
      checksum = get("checksum").fold("crc32c")(parseChoice("checksum", _, Checksums)),
      keepPreviousGeneration = get("keep_previous_generation").exists(parseBool("keep_previous_generation", _))
    )
  }
}

/** Python difflib's similarity ratio (2 * matches / total length, matches found as the
  * longest common blocks, recursively), so "did you mean" hints pick the same names. */
private[write] object Similarity {
  def ratio(a: String, b: String): Double =
    if (a.isEmpty && b.isEmpty) 1.0 else 2.0 * matches(a, b) / (a.length + b.length)

  private def matches(a: String, b: String): Int = {
    if (a.isEmpty || b.isEmpty) return 0
    var best, bi, bj = 0
    for (i <- a.indices; j <- b.indices) {
      var k = 0
      while (i + k < a.length && j + k < b.length && a(i + k) == b(j + k)) k += 1
      if (k > best) { best = k; bi = i; bj = j }
    }
    if (best == 0) 0
    else best + matches(a.substring(0, bi), b.substring(0, bj)) +
      matches(a.substring(bi + best), b.substring(bj + best))
  }
}
