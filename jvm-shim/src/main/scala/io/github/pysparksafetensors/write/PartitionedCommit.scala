package io.github.pysparksafetensors.write

import java.time.format.DateTimeFormatter
import java.time.{OffsetDateTime, ZoneOffset}

import scala.util.Try

import io.github.pysparksafetensors.core.Partitions

/** The commit of a partitioned write (`partitionBy`): shards in Hive-style `col=value/`
  * directories, each directory a dataset of its own (manifest, index, `_SUCCESS`), and the
  * root's manifest listing every partition's shards (`partition_columns`, shard paths under
  * their directories) as the one commit point of the whole write: a reader of the root sees
  * all the new partitions or none, and a failure before that point changes no partition.
  *
  * The root's manifest is the authority: a partition's manifest and index are written from
  * it right after the commit point, so a crash between the two leaves a partition readable
  * as it was, and the next write to it writes them again. */
object PartitionedCommit {
  private def stamp: String =
    OffsetDateTime.now(ZoneOffset.UTC).format(DateTimeFormatter.ofPattern("yyyy-MM-dd'T'HH:mm:ssxxx"))

  /** The top directories of shard paths (`layer=0` of `layer=0/part-…`). */
  def topDirs(shards: Seq[ShardEntry]): Seq[String] =
    shards.map(_.path).filter(_.contains("/")).map(p => p.substring(0, p.indexOf('/'))).distinct

  /** `shards` under `dir`, their paths relative to it and numbered from 0 again. */
  private def under(shards: Seq[ShardEntry], dir: String): Seq[ShardEntry] = {
    var first = 0L
    shards.filter(s => Partitions.prefix(s.path) == dir).map { s =>
      val e = s.copy(path = s.path.substring(dir.length + 1), firstSample = Some(first)); first += s.samples; e
    }
  }

  /** Publish the tasks' shards, replacing the partitions `replace` names and appending to
    * the others. */
  def commit(files: DatasetFiles, jobId: String, results: Seq[TaskCommit], template: ManifestDoc,
      replace: Replace, generateIndex: Boolean, uniqueKeys: Boolean, keepPrevious: Boolean,
      stream: Option[StreamBatch] = None): ManifestDoc = {
    val where = s"dataset '${files.uri}'"
    val kv = template.mode == "kv"
    val replaceAll = replace == Replace.All
    val written = results.filter(_.shards.nonEmpty).groupBy(_.dir)
    val dirs = written.keys.toSeq.sorted
    val previous = Commit.previousManifest(files, replaceAll, s"'${files.uri}/${Layout.Manifest}'")
    if (Commit.replayed(previous, stream)) {
      abort(files, jobId); Commit.republish(files, previous.get); return previous.get
    }
    if (replace == Replace.Nothing) previous.foreach(Commit.refuseComplete(_, where))
    val replaced: String => Boolean = replace match {
      case Replace.All => _ => true
      case Replace.Written => written.contains
      case Replace.Matching(filters) =>
        val columns = template.partitionColumns
        val before = previous.toSeq.flatMap(_.shards).map(s => Partitions.prefix(s.path)).distinct
        val raw = before.map(d => d -> Partitions.values(d + "/x", columns).getOrElse(Nil)).toMap
        val types = columns.indices.map(i => columns(i) -> Partitions.inferType(raw.values.map(_(i)).toSeq)).toMap
        d => raw.get(d).exists(v => filters.forall(f => Partitions.decide(f, columns.zip(v).toMap, types).contains(true)))
      case Replace.Nothing => _ => false
    }
    val kept = previous.toSeq.flatMap(_.shards).filterNot(s => replaced(Partitions.prefix(s.path)))

    // The whole write against the dataset: settings, partition columns, columns, dtypes.
    val taskSchemas = dirs.map(d => d -> Commit.mergeSchemas(written(d).map(_.schema), s"$where, partition '$d'", kv)).toMap
    val allTasks = Commit.mergeSchemas(taskSchemas.values.toSeq, where, varying = true)
    previous.filter(_ => !replaceAll).foreach { p =>
      Commit.checkAppend(p.copy(shards = if (kept.nonEmpty) p.shards else Nil), template,
        if (dirs.nonEmpty) Some(allTasks) else None, where, varying = Some(true))
    }
    // Each partition appended to against its own manifest: exact sample shapes (batch mode).
    val schemas = dirs.map { d =>
      val before = if (!kept.exists(s => Partitions.prefix(s.path) == d)) None
        else Try(ManifestDoc.parse(files.sub(d).readBytes(Layout.Manifest), "")).toOption
      d -> before.fold(taskSchemas(d))(b => Commit.checkAppend(b, template.copy(partitionColumns = Nil),
        Some(taskSchemas(d)), s"$where, partition '$d'"))
    }.toMap

    val keptPaths = kept.map(_.path).toSet
    val keptIndex: Seq[IndexRows] = previous.flatMap(_.indexFile).filter(_ => (generateIndex || uniqueKeys) && kept.nonEmpty)
      .toSeq.flatMap(f => IndexFile.read(files.readBytes(f), s"$where, $f")).filter(r => keptPaths(r.fileName))
    val staged = results.flatMap(_.shards).sortBy(s => (Partitions.prefix(s.name), s.taskId, s.shardIndex))
    if (uniqueKeys) dirs.foreach { d =>
      val seen = new java.util.HashSet[String]()
      val keys = keptIndex.iterator.filter(r => Partitions.prefix(r.fileName) == d).flatMap(_.keys) ++
        staged.iterator.filter(s => Partitions.prefix(s.name) == d).flatMap(_.keys.iterator.flatten)
      val dups = keys.filterNot(seen.add).toSeq.distinct.take(5)
      if (dups.nonEmpty)
        throw new SafetensorsWriteException(
          s"$where, partition '$d': duplicate tensor keys across shards: ${dups.map(k => s"'$k'").mkString(", ")} " +
            "(keys must be unique in a partition of a KV dataset)")
    }

    val commitId = java.util.UUID.randomUUID().toString.replace("-", "")
    val indexRows: Option[Seq[IndexRows]] = if (!generateIndex) None
      else Some(keptIndex ++ results.filter(_.shards.nonEmpty).sortBy(_.shards.head.taskId)
        .flatMap(_.index.toSeq.flatMap(b => IndexFile.read(b, where))))
    val indexData = indexRows.map(IndexFile.bytes)
    val indexFile = indexData.map { data =>
      files.putBytes(Layout.indexName(commitId), data)
      val crc = new java.util.zip.CRC32C(); crc.update(data)
      (Layout.indexName(commitId), f"${crc.getValue}%08x")
    }
    val entries = (kept ++ staged.map(s => ShardEntry(s.name, s.samples, s.bytes, None, s.crc32c)))
      .zipWithIndex.sortBy { case (e, i) => (Partitions.prefix(e.path), i) }.map(_._1)
    var first = 0L
    val shards = entries.map { e => val r = e.copy(firstSample = Some(first)); first += e.samples; r }
    val keptSchema = previous.filter(_ => kept.nonEmpty).map(_.schema).toSeq
    val rootSchema = Commit.mergeSchemas(keptSchema ++ dirs.map(schemas), where, varying = true)
    def shapes(schema: Seq[(String, ColumnSchema)]) =
      schema.map { case (n, c) => n -> template.batchSize.fold(c.sampleShape)(b => b +: c.sampleShape) }.toMap
    val (streamCommits, streamCheckpoints, complete) = Commit.streamFields(previous, stream, replace != Replace.Nothing)
    val manifest = template.copy(shards = shards, schema = rootSchema, shapes = shapes(rootSchema),
      streamCommits = streamCommits, streamCheckpoints = streamCheckpoints, complete = complete,
      indexFile = indexFile.map(_._1), indexCrc32c = indexFile.map(_._2), commitId = Some(commitId),
      parentCommit = previous.flatMap(_.commitId), createdAt = Some(stamp))
    try Commit.publish(files, manifest, previous)
    catch { case e: Throwable => indexFile.foreach(f => files.delete(Seq(f._1))); throw e }

    // After the commit point: the written partitions as datasets of their own.
    Commit.publishSpecIndex(files, indexData)
    dirs.foreach { d =>
      val part = files.sub(d)
      val before = Try(ManifestDoc.parse(part.readBytes(Layout.Manifest), "")).toOption
      val own = under(shards, d)
      val ownIndex = indexRows.map(rows => IndexFile.bytes(rows.filter(r => Partitions.prefix(r.fileName) == d)
        .map(r => r.copy(fileName = r.fileName.substring(d.length + 1)))))
      val ownFile = ownIndex.map { data =>
        part.putBytes(Layout.indexName(commitId), data)
        val crc = new java.util.zip.CRC32C(); crc.update(data)
        (Layout.indexName(commitId), f"${crc.getValue}%08x")
      }
      val m = template.copy(shards = own, schema = schemas(d), shapes = shapes(schemas(d)),
        indexFile = ownFile.map(_._1), indexCrc32c = ownFile.map(_._2), commitId = Some(commitId),
        parentCommit = before.flatMap(_.commitId), createdAt = manifest.createdAt, partitionColumns = Nil)
      part.putBytes(Layout.Manifest, m.toJson)
      Commit.publishSpecIndex(part, ownIndex)
      var keep = own.map(_.path).toSet ++ Set(Layout.Manifest, Layout.Index) ++ ownFile.map(_._1)
      if (keepPrevious) before.foreach(b => keep ++= b.shards.map(_.path) ++ b.indexFile)
      Commit.reclaim(part, keep, Some(jobId), leases = Some(files))
      part.putBytes(Layout.Success, Array.emptyByteArray)
    }
    files.delete(Seq(Layout.leaseName(jobId)))
    var keep = Set(Layout.Manifest, Layout.Lock, Layout.Index) ++ manifest.indexFile
    if (keepPrevious) previous.foreach(p => keep ++= p.indexFile)
    Commit.reclaim(files, keep, Some(jobId))
    // partitions an overwrite dropped (directories this commit lists no shard in)
    if (replaceAll && !keepPrevious) previous.foreach { p =>
      val live = topDirs(shards).toSet
      files.delete(topDirs(p.shards).filterNot(live))
    }
    files.putBytes(Layout.Success, Array.emptyByteArray)
    manifest
  }

  /** Delete every file the job wrote that the dataset's manifest does not list, in every
    * partition directory, and the directories left empty (its tasks' and its own). */
  def abort(files: DatasetFiles, jobId: String): Unit = {
    files.delete(Seq(Layout.leaseName(jobId)))
    val listed = if (!files.has(Layout.Manifest)) Set.empty[String]
      else Try(ManifestDoc.parse(files.readBytes(Layout.Manifest), "").shards.map(_.path).toSet).getOrElse(Set.empty)
    val tag = Layout.jobTag(jobId)
    val mine = files.listUnder("").filter { n =>
      !n.startsWith(Layout.Staging + "/") && !listed(n) && Layout.jobOf(n.substring(n.lastIndexOf('/') + 1)).contains(tag)
    }
    files.delete(mine)
    if (files.has(Layout.Staging) && files.listUnder(Layout.Staging).isEmpty) files.delete(Seq(Layout.Staging))
    files.removeEmptyDirs()
  }
}
