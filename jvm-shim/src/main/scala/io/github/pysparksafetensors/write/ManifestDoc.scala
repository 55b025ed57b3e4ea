package io.github.pysparksafetensors.write

import java.nio.charset.StandardCharsets.UTF_8

import scala.jdk.CollectionConverters._

import com.fasterxml.jackson.databind.node.ObjectNode
import com.fasterxml.jackson.databind.{JsonNode, ObjectMapper, SerializationFeature}

import io.github.pysparksafetensors.core.Partitions

/** One shard of a manifest. */
final case class ShardEntry(path: String, samples: Long, bytes: Long, firstSample: Option[Long], crc32c: Option[String])

/** `dataset_manifest.json` as the writer needs it: the fields of the Python `Manifest`
  * (format spec §2.2 plus our optional ones), written with the same layout of fields. */
final case class ManifestDoc(
    shards: Seq[ShardEntry],
    schema: Seq[(String, ColumnSchema)],
    mode: String,
    batchSize: Option[Int],
    nameCol: Option[String],
    kvSeparator: Option[String],
    indexFile: Option[String],
    indexCrc32c: Option[String],
    commitId: Option[String],
    parentCommit: Option[String],
    metadata: Map[String, String],
    createdBy: String,
    createdAt: Option[String],
    /** Full shapes of the schema's columns (batch: `[batch_size, *sample]`). */
    shapes: Map[String, Seq[Int]] = Map.empty,
    /** A partitioned dataset's columns: its shards lie in `col=value/` directories. */
    partitionColumns: Seq[String] = Nil,
    /** Streaming writes: per stream id, the last batch id committed, in document order. */
    streamCommits: Seq[(String, Long)] = Nil,
    /** Whether the producer declared the dataset finished (appends are then refused). */
    complete: Option[Boolean] = None,
    /** Streaming writes: per stream id, the checkpoint its batches were committed from. */
    streamCheckpoints: Seq[(String, String)] = Nil
) {
  /** Whether batch `batchId` of stream `streamId` is committed already (a replay). */
  def committed(streamId: String, batchId: Long): Boolean =
    streamCommits.exists { case (s, b) => s == streamId && b >= batchId }

  /** `streamCommits` with stream `streamId`'s entry set to `batchId`, the others as they were. */
  def withStreamCommit(streamId: String, batchId: Long): Seq[(String, Long)] =
    if (streamCommits.exists(_._1 == streamId)) streamCommits.map { case (s, b) => s -> (if (s == streamId) batchId else b) }
    else streamCommits :+ (streamId -> batchId)

  /** `streamCheckpoints` with stream `streamId`'s entry set to `checkpoint`. */
  def withStreamCheckpoint(streamId: String, checkpoint: String): Seq[(String, String)] =
    if (streamCheckpoints.exists(_._1 == streamId))
      streamCheckpoints.map { case (s, c) => s -> (if (s == streamId) checkpoint else c) }
    else streamCheckpoints :+ (streamId -> checkpoint)

  def toJson: Array[Byte] = {
    val m = ManifestDoc.mapper
    val doc = m.createObjectNode()
    doc.put("format_version", Layout.FormatVersion)
    doc.put("safetensors_version", Layout.SafetensorsVersion)
    doc.put("total_samples", shards.map(_.samples).sum)
    doc.put("total_bytes", shards.map(_.bytes).sum)
    val list = doc.putArray("shards")
    shards.foreach { s =>
      val e = list.addObject()
      e.put("shard_path", s.path).put("samples_count", s.samples).put("bytes", s.bytes)
      s.firstSample.foreach(e.put("first_sample", _))
      s.crc32c.foreach(e.put("crc32c", _))
    }
    val sch = doc.putObject("schema")
    schema.foreach { case (name, c) =>
      val e = sch.putObject(name)
      e.put("dtype", c.dtype)
      val shape = e.putArray("shape")
      shapes.getOrElse(name, c.sampleShape).foreach(d => shape.add(d))
      val sample = e.putArray("sample_shape")
      c.sampleShape.foreach(d => sample.add(d))
    }
    doc.put("mode", mode)
    batchSize.foreach(doc.put("batch_size", _))
    nameCol.foreach(doc.put("name_col", _))
    kvSeparator.foreach(doc.put("kv_separator", _))
    indexFile.foreach(doc.put("index_file", _))
    indexCrc32c.foreach(doc.put("index_crc32c", _))
    commitId.foreach(doc.put("commit_id", _))
    parentCommit.foreach(doc.put("parent_commit", _))
    if (partitionColumns.nonEmpty) {
      val cols = doc.putArray("partition_columns")
      partitionColumns.foreach(c => cols.add(c))
    }
    if (streamCommits.nonEmpty) {
      val commits = doc.putObject("stream_commits")
      streamCommits.foreach { case (s, b) => commits.put(s, b) }
    }
    if (streamCheckpoints.nonEmpty) {
      val checkpoints = doc.putObject("stream_checkpoints")
      streamCheckpoints.foreach { case (s, c) => checkpoints.put(s, c) }
    }
    complete.foreach(doc.put("complete", _))
    doc.put("created_by", createdBy)
    createdAt.foreach(doc.put("created_at", _))
    val md = doc.putObject("metadata")
    metadata.toSeq.sortBy(_._1).foreach { case (k, v) => md.put(k, v) }
    (m.writerWithDefaultPrettyPrinter().writeValueAsString(doc) + "\n").getBytes(UTF_8)
  }
}

object ManifestDoc {
  private[write] val mapper = new ObjectMapper().disable(SerializationFeature.FAIL_ON_EMPTY_BEANS)

  private def fail(where: String, msg: String): Nothing = throw new SafetensorsWriteException(s"$where: $msg")

  /** Parse a manifest, checking what the writer relies on; errors name `where` and the field. */
  def parse(data: Array[Byte], where: String): ManifestDoc = {
    val doc: JsonNode =
      try mapper.readTree(data)
      catch { case e: com.fasterxml.jackson.core.JacksonException => fail(where, s"not valid JSON (${e.getOriginalMessage})") }
    if (doc == null || !doc.isObject) fail(where, "the manifest is not a JSON object")
    for (f <- Seq("format_version", "total_samples", "total_bytes", "shards", "schema"))
      if (!doc.has(f)) fail(where, s"missing required field '$f'")
    if (!doc.get("format_version").asText.startsWith("1."))
      fail(where, s"format_version '${doc.get("format_version").asText}' is not supported (1.x expected)")
    def text(n: JsonNode, f: String): Option[String] = Option(n.get(f)).filter(!_.isNull).map(_.asText)
    val partitionColumns = Option(doc.get("partition_columns")).filter(_.isArray)
      .map(_.elements().asScala.map(_.asText).toList).getOrElse(Nil)
    val shards = doc.get("shards").elements().asScala.zipWithIndex.map { case (s, i) =>
      for (f <- Seq("shard_path", "samples_count", "bytes"))
        if (!s.has(f)) fail(where, s"missing required field 'shards[$i].$f'")
      val path = s.get("shard_path").asText
      val name = path.substring(path.lastIndexOf('/') + 1)
      if (name.isEmpty || path.contains("\\") || !path.endsWith(".safetensors") ||
          Partitions.values(path, partitionColumns).isEmpty)
        fail(where, s"shards[$i].shard_path '$path' must be a relative name inside the dataset, ending in " +
          ".safetensors" + (if (partitionColumns.isEmpty) "" else
            s", in the directories of partition columns ${partitionColumns.mkString("[", ", ", "]")}"))
      ShardEntry(path, s.get("samples_count").asLong, s.get("bytes").asLong,
        Option(s.get("first_sample")).filter(_.isIntegralNumber).map(_.asLong), text(s, "crc32c"))
    }.toList
    if (shards.map(_.path).distinct.size != shards.size) fail(where, "a shard is listed twice; each shard may appear once")
    if (shards.map(_.samples).sum != doc.get("total_samples").asLong || shards.map(_.bytes).sum != doc.get("total_bytes").asLong)
      fail(where, "total_samples/total_bytes disagree with the sum over shards")
    val schemaNode = doc.get("schema").asInstanceOf[ObjectNode]
    // A Seq over the entries keeps the manifest's column order (a Set would lose it).
    val schema = schemaNode.properties().asScala.toList.map { e =>
      val c = e.getValue
      val shape = c.get("shape").elements().asScala.map(_.asInt).toList
      val sample = Option(c.get("sample_shape")).map(_.elements().asScala.map(_.asInt).toList).getOrElse(shape.drop(1))
      (e.getKey, ColumnSchema(c.get("dtype").asText, sample), shape)
    }.toSeq
    ManifestDoc(
      shards = shards,
      schema = schema.map(s => s._1 -> s._2),
      mode = text(doc, "mode").getOrElse(if (text(doc, "name_col").isDefined) "kv" else "batch"),
      batchSize = Option(doc.get("batch_size")).filter(_.isIntegralNumber).map(_.asInt),
      nameCol = text(doc, "name_col"),
      kvSeparator = text(doc, "kv_separator"),
      indexFile = text(doc, "index_file"),
      indexCrc32c = text(doc, "index_crc32c"),
      commitId = text(doc, "commit_id"),
      parentCommit = text(doc, "parent_commit"),
      metadata = Option(doc.get("metadata")).filter(_.isObject)
        .map(_.properties().asScala.map(e => e.getKey -> e.getValue.asText).toMap).getOrElse(Map.empty),
      createdBy = text(doc, "created_by").getOrElse("unknown"),
      createdAt = text(doc, "created_at"),
      shapes = schema.map(s => s._1 -> s._3).toMap,
      partitionColumns = partitionColumns,
      streamCommits = Option(doc.get("stream_commits")).filter(_.isObject).map(_.properties().asScala.toList.map { e =>
        if (!e.getValue.isIntegralNumber || e.getValue.asLong < 0)
          fail(where, s"stream_commits['${e.getKey}'] must be a batch id, an integer >= 0")
        e.getKey -> e.getValue.asLong
      }).getOrElse(Nil),
      complete = Option(doc.get("complete")).filter(_.isBoolean).map(_.asBoolean),
      streamCheckpoints = Option(doc.get("stream_checkpoints")).filter(_.isObject).map(_.properties().asScala.toList.map { e =>
        if (!e.getValue.isTextual || e.getValue.asText.isEmpty)
          fail(where, s"stream_checkpoints['${e.getKey}'] must be a checkpoint location, a non-empty string")
        e.getKey -> e.getValue.asText
      }).getOrElse(Nil)
    )
  }
}
