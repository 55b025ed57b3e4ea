package io.github.pysparksafetensors.write

import java.net.InetAddress
import java.time.format.DateTimeFormatter
import java.time.{OffsetDateTime, ZoneOffset}
import java.util.concurrent.TimeUnit

import scala.util.Try

/** Another write committed to the same dataset while this one was committing. */
final class ConcurrentCommitException(message: String) extends RuntimeException(message)

/** The driver's side of the commit protocol of `dataset/commit.py`, on the same files:
  * a job lease `_temporary/{job}.job`, shards written once at the root under attempt-own
  * names, the manifest put last as the commit point (after checking that no other commit
  * landed), then `_tensor_index.parquet`, reclaiming what no manifest lists (failed and
  * losing attempts, dead jobs, and by default the generation an overwrite replaced) and
  * `_SUCCESS`. Datasets written by either writer can be appended by the other. */
object Commit {
  val StaleJobSeconds: Long = 24 * 3600
  private val LockWaitSeconds = 30.0

  private lazy val host: String = Try(InetAddress.getLocalHost.getHostName).getOrElse("localhost")
  private def pid: Long = ProcessHandle.current().pid()
  private def now: Double = System.currentTimeMillis() / 1000.0

  /** One schema for all tasks: dtype and sample shape must agree per column; with
    * `varying` (KV mode) dimensions that differ become -1 (dtype and rank must agree). */
  def mergeSchemas(schemas: Seq[Seq[(String, ColumnSchema)]], where: String, varying: Boolean): Seq[(String, ColumnSchema)] = {
    val merged = scala.collection.mutable.LinkedHashMap.empty[String, ColumnSchema]
    for (schema <- schemas; (name, col) <- schema) merged.get(name) match {
      case None => merged(name) = col
      case Some(seen) if seen == col =>
      case Some(seen) if varying && seen.dtype == col.dtype && seen.sampleShape.size == col.sampleShape.size =>
        merged(name) = ColumnSchema(col.dtype, seen.sampleShape.zip(col.sampleShape).map { case (a, b) => if (a == b) a else -1 })
      case Some(seen) =>
        throw new SafetensorsWriteException(
          s"$where: column '$name' is ${seen.dtype}${show(seen.sampleShape)} in one part and " +
            s"${col.dtype}${show(col.sampleShape)} in another; every row must have the same shape and dtype")
    }
    merged.toSeq
  }

  private def show(s: Seq[Int]): String = s.mkString("[", ", ", "]")

  /** The schema of `previous` after appending data written with `template`'s settings
    * and columns `schema` (None: no new shards); the rule of `check_append`. `varying`:
    * dimensions may differ (KV datasets, and the partitions of a partitioned one). */
  def checkAppend(previous: ManifestDoc, template: ManifestDoc, schema: Option[Seq[(String, ColumnSchema)]],
      where: String, varying: Option[Boolean] = None): Seq[(String, ColumnSchema)] = {
    if (previous.mode != template.mode)
      throw new SafetensorsWriteException(
        s"$where: cannot append ${template.mode}-mode data to a ${previous.mode}-mode dataset")
    if (previous.shards.isEmpty) return schema.getOrElse(Seq.empty)
    if (previous.partitionColumns != template.partitionColumns) {
      def by(cols: Seq[String]) = if (cols.isEmpty) "not partitioned" else s"partitioned by ${cols.mkString("['", "', '", "']")}"
      throw new SafetensorsWriteException(
        s"$where is ${by(previous.partitionColumns)}, this write is ${by(template.partitionColumns)}; " +
          (if (previous.partitionColumns.isEmpty) "append without partitionBy, or overwrite the dataset"
           else s"append with partitionBy(${previous.partitionColumns.mkString("'", "', '", "'")}), or overwrite the dataset"))
    }
    // values as the Python writer's message shows them: numbers bare, text quoted
    def shown(v: Option[Any]): String = v match {
      case Some(s: String) => s"'$s'"
      case Some(other) => other.toString
      case None => "None"
    }
    val settings: Seq[(String, Option[Any], Option[Any])] =
      if (previous.mode == "batch") Seq(("batch_size", previous.batchSize, template.batchSize))
      else Seq(("name_col", previous.nameCol, template.nameCol), ("kv_separator", previous.kvSeparator, template.kvSeparator))
    for ((option, theirs, ours) <- settings if theirs.isDefined && theirs != ours)
      throw new SafetensorsWriteException(
        s"$where: the dataset's $option is ${shown(theirs)}, this write's is ${shown(ours)}; " +
          s"append with $option=${shown(theirs)}, or overwrite the dataset")
    schema match {
      case None => previous.schema
      case Some(cols) =>
        val (have, want) = (cols.map(_._1).toSet, previous.schema.map(_._1).toSet)
        if (have != want) {
          val missing = (want -- have).toSeq.sorted
          val extra = (have -- want).toSeq.sorted
          val detail = Seq(
            if (missing.nonEmpty) s"missing ${missing.mkString("['", "', '", "']")}" else "",
            if (extra.nonEmpty) s"not in the dataset ${extra.mkString("['", "', '", "']")}" else "").filter(_.nonEmpty)
          throw new SafetensorsWriteException(
            s"$where: appended columns ${have.toSeq.sorted.mkString("['", "', '", "']")} differ from the dataset's " +
              s"${want.toSeq.sorted.mkString("['", "', '", "']")} (${detail.mkString("; ")})")
        }
        mergeSchemas(Seq(previous.schema, cols), s"$where (append)", varying.getOrElse(previous.mode == "kv"))
    }
  }

  /** Lease the job before its tasks run, so no other write reclaims its shards. */
  def beginJob(files: DatasetFiles, jobId: String): Unit = {
    files.makedirs()
    val lease = ManifestDoc.mapper.createObjectNode()
      .put("job_id", jobId).put("host", host).put("pid", pid).put("started", now)
    files.putBytes(Layout.leaseName(jobId), ManifestDoc.mapper.writeValueAsBytes(lease))
  }

  private def alive(leaseBytes: Array[Byte]): Boolean = {
    val lease = Try(ManifestDoc.mapper.readTree(leaseBytes)).toOption.filter(_ != null).getOrElse(return false)
    if (Option(lease.get("host")).map(_.asText).contains(host)) {
      val p = Option(lease.get("pid")).filter(_.canConvertToLong).map(_.asLong)
      p.forall(id => ProcessHandle.of(id).isPresent)
    } else {
      val started = Option(lease.get("started")).filter(_.isNumber).map(_.asDouble)
      started.exists(s => now - s < StaleJobSeconds)
    }
  }

  /** Delete what no manifest trusts: unlisted shards and indexes (except `keep`), and the
    * leases and staging leftovers of dead jobs and of `ownJob`; live jobs' files stay.
    * `leases`: where the jobs' leases are (a partition's are at its dataset's root). */
  def reclaim(files: DatasetFiles, keep: Set[String], ownJob: Option[String],
      leases: Option[DatasetFiles] = None): Seq[String] = {
    val listing = files.list()
    val staging = if (listing.contains(Layout.Staging)) files.listUnder(Layout.Staging).map(n => s"${Layout.Staging}/$n") else Seq.empty
    val leaseFiles = leases.getOrElse(files)
    val leaseNames = if (leases.isEmpty) staging else leaseFiles.listUnder(Layout.Staging).map(n => s"${Layout.Staging}/$n")
    val live = leaseNames.filter(n => n.endsWith(Layout.JobLeaseSuffix) && !n.stripPrefix(Layout.Staging + "/").contains("/"))
      .flatMap { n =>
        val job = n.stripPrefix(Layout.Staging + "/").stripSuffix(Layout.JobLeaseSuffix)
        if (ownJob.contains(job)) None
        else if (Try(leaseFiles.readBytes(n)).toOption.exists(alive)) Some(Layout.jobTag(job)) else None
      }.toSet
    val doomed = listing.filterNot(keep).filter {
      case n @ Layout.ShardName(_, _, _) => !Layout.jobOf(n).exists(live)
      case Layout.IndexName(_) => true
      case _ => false
    } ++ staging.filter { n =>
      val rest = n.stripPrefix(Layout.Staging + "/")
      !rest.contains("/") && {
        val job = rest.stripSuffix(Layout.JobLeaseSuffix)
        ownJob.contains(job) || job.length < 16 || !live(Layout.jobTag(job))
      }
    }
    files.delete(doomed)
    if (listing.contains(Layout.Staging) && (staging.toSet -- doomed).isEmpty) files.delete(Seq(Layout.Staging))
    doomed
  }

  private[write] def previousManifest(files: DatasetFiles, overwrite: Boolean, where: String): Option[ManifestDoc] =
    if (!files.has(Layout.Manifest)) None
    else Try(ManifestDoc.parse(files.readBytes(Layout.Manifest), where)).fold(
      e => if (overwrite) None else throw e, Some(_))

  /** Refuse an append to a dataset its producer declared finished (manifest field `complete`). */
  def refuseComplete(previous: ManifestDoc, where: String): Unit =
    if (previous.complete.contains(true))
      throw new SafetensorsWriteException(
        s"$where is marked complete (its producer declared it finished: 'complete' in its manifest); " +
          "appends are refused: overwrite it, or write to another path")

  /** The stream fields of a commit after `previous`: every stream's last batch and
    * checkpoint carried forward, `stream`'s set to its own; `complete` carried by an
    * append, dropped by an overwrite (a new generation starts unfinished). */
  private[write] def streamFields(previous: Option[ManifestDoc], stream: Option[StreamBatch],
      overwrite: Boolean): (Seq[(String, Long)], Seq[(String, String)], Option[Boolean]) = {
    val before = previous.getOrElse(ManifestDoc(Nil, Nil, "batch", None, None, None, None, None, None, None, Map.empty, "", None))
    (stream.fold(before.streamCommits)(s => before.withStreamCommit(s.id, s.batch)),
      stream.flatMap(s => s.checkpoint.map(c => before.withStreamCheckpoint(s.id, c))).getOrElse(before.streamCheckpoints),
      if (overwrite) None else before.complete)
  }

  /** Whether `previous` has batch `stream` committed already: the replay of a micro-batch
    * after a restart, which publishes nothing. */
  private[write] def replayed(previous: Option[ManifestDoc], stream: Option[StreamBatch]): Boolean =
    stream.exists(s => previous.exists(_.committed(s.id, s.batch)))

  /** A replayed batch puts `_tensor_index.parquet` and `_SUCCESS` as `manifest`'s commit
    * leaves them: a crash between a commit's manifest and these names leaves them a commit
    * behind (`republish` of the Python commit). */
  private[write] def republish(files: DatasetFiles, manifest: ManifestDoc): Unit = {
    publishSpecIndex(files, manifest.indexFile.map(files.readBytes))
    files.putBytes(Layout.Success, Array.emptyByteArray)
  }

  /** Refuse stream `streamId` under `checkpoint` when `previous` records its batches from
    * another checkpoint: under a new one Spark numbers the batches from 0 again, and every
    * one would be taken for a replay and dropped (`check_stream_checkpoint`). */
  def refuseOtherCheckpoint(previous: Option[ManifestDoc], streamId: String, checkpoint: Option[String],
      where: String): Unit =
    for (p <- previous; c <- checkpoint; last <- p.streamCommits.find(_._1 == streamId).map(_._2);
         recorded <- p.streamCheckpoints.find(_._1 == streamId).map(_._2) if recorded != c)
      throw new SafetensorsWriteException(
        s"$where: stream '$streamId' committed its batches up to $last from checkpoint '$recorded'; this " +
          s"query's checkpoint is '$c', whose batch ids start again at 0, so every batch would be taken for a " +
          s"replay and dropped. Give this query another stream_id (or none: the query's own id), or run it " +
          s"from checkpoint '$recorded'")

  /** Publish the shards of `results` as the dataset: the twin of `commit_dataset`.
    * `stream`: the (stream id, batch id) of a streaming micro-batch, recorded in the
    * manifest's `stream_commits`; a batch recorded already commits nothing, its shards are
    * deleted and the manifest as it stands is returned. */
  def commit(files: DatasetFiles, jobId: String, results: Seq[TaskCommit], template: ManifestDoc,
      overwrite: Boolean, generateIndex: Boolean, uniqueKeys: Boolean, keepPrevious: Boolean,
      stream: Option[StreamBatch] = None): ManifestDoc = {
    val where = s"dataset '${files.uri}'"
    val staged = results.flatMap(_.shards).sortBy(s => (s.taskId, s.shardIndex))
    var schema = mergeSchemas(results.map(_.schema), where, template.mode == "kv")
    val previous = previousManifest(files, overwrite, s"'${files.uri}/${Layout.Manifest}'")
    if (replayed(previous, stream)) { abort(files, jobId); republish(files, previous.get); return previous.get }
    var kept = Seq.empty[ShardEntry]
    var keptIndex = Seq.empty[IndexRows]
    previous.filter(_ => !overwrite).foreach { p =>
      refuseComplete(p, where)
      schema = checkAppend(p, template, if (staged.nonEmpty) Some(schema) else None, where)
      kept = p.shards
      if ((generateIndex || uniqueKeys) && p.indexFile.isDefined)
        keptIndex = IndexFile.read(files.readBytes(p.indexFile.get), s"$where, ${p.indexFile.get}")
    }
    if (uniqueKeys) {
      val seen = new java.util.HashSet[String]()
      val keys = keptIndex.iterator.flatMap(_.keys) ++ staged.iterator.flatMap(_.keys.iterator.flatten)
      val dups = keys.filterNot(seen.add).toSeq.distinct.take(5)
      if (dups.nonEmpty)
        throw new SafetensorsWriteException(
          s"$where: duplicate tensor keys across shards: ${dups.map(d => s"'$d'").mkString(", ")} (keys must be unique in a KV dataset)")
    }
    val commitId = java.util.UUID.randomUUID().toString.replace("-", "")
    val indexData = if (!generateIndex) None else Some(IndexFile.merge(
      (if (keptIndex.nonEmpty) Seq(IndexFile.bytes(keptIndex)) else Seq.empty) ++
        results.filter(_.shards.nonEmpty).sortBy(_.shards.head.taskId).flatMap(_.index)))
    val indexFile = indexData.map { data =>
      files.putBytes(Layout.indexName(commitId), data)
      val crc = new java.util.zip.CRC32C(); crc.update(data)
      (Layout.indexName(commitId), f"${crc.getValue}%08x")
    }
    val (streamCommits, streamCheckpoints, complete) = streamFields(previous, stream, overwrite)
    val manifest = template.copy(
      shards = entries(kept, staged),
      streamCommits = streamCommits, streamCheckpoints = streamCheckpoints, complete = complete,
      schema = schema,
      shapes = schema.map { case (n, c) => n -> template.batchSize.fold(c.sampleShape)(b => b +: c.sampleShape) }.toMap,
      indexFile = indexFile.map(_._1), indexCrc32c = indexFile.map(_._2),
      commitId = Some(commitId), parentCommit = previous.flatMap(_.commitId),
      createdAt = Some(OffsetDateTime.now(ZoneOffset.UTC).format(DateTimeFormatter.ofPattern("yyyy-MM-dd'T'HH:mm:ssxxx"))))
    try publish(files, manifest, previous)
    catch { case e: Throwable => indexFile.foreach(f => files.delete(Seq(f._1))); throw e }
    publishSpecIndex(files, indexData)
    cleanUp(files, jobId, manifest, if (keepPrevious) previous else None)
    // an overwrite of a partitioned dataset by an unpartitioned write: its directories go
    if (overwrite && !keepPrevious) previous.foreach(p => files.delete(PartitionedCommit.topDirs(p.shards)))
    manifest
  }

  /** After the commit point: the spec's `_tensor_index.parquet/` gets the committed index
    * as its one part, or goes when this commit has none (an index of another generation
    * would route readers to shards the manifest no longer lists). One file of that name,
    * as earlier versions wrote it, gives way to the directory. */
  private[write] def publishSpecIndex(files: DatasetFiles, data: Option[Array[Byte]]): Unit = data match {
    case Some(bytes) =>
      if (files.isFile(Layout.Index)) files.delete(Seq(Layout.Index))
      files.putBytes(Layout.IndexPart, bytes)
    case None => files.delete(Seq(Layout.Index))
  }

  private def entries(kept: Seq[ShardEntry], staged: Seq[StagedShard]): Seq[ShardEntry] = {
    var first = kept.map(_.samples).sum
    val all = kept ++ staged.map { s =>
      val e = ShardEntry(s.name, s.samples, s.bytes, Some(first), s.crc32c); first += s.samples; e
    }
    if (kept.nonEmpty && kept.head.firstSample.isEmpty) {
      var n = 0L
      all.map { e => val r = e.copy(firstSample = Some(n)); n += e.samples; r }
    } else all
  }

  private def cleanUp(files: DatasetFiles, jobId: String, manifest: ManifestDoc, previous: Option[ManifestDoc]): Unit = {
    var keep = manifest.shards.map(_.path).toSet + Layout.Manifest + Layout.Lock
    manifest.indexFile.foreach(f => keep ++= Set(f, Layout.Index))
    files.delete(Seq(Layout.leaseName(jobId))) // before the listing: see abort
    previous.foreach { p => keep ++= p.shards.map(_.path); keep ++= p.indexFile }
    reclaim(files, keep, Some(jobId))
    files.putBytes(Layout.Success, Array.emptyByteArray)
  }

  private def currentCommit(files: DatasetFiles): (Option[String], Boolean) =
    if (!files.has(Layout.Manifest)) (None, false)
    else (Try(ManifestDoc.parse(files.readBytes(Layout.Manifest), "")).toOption.flatMap(_.commitId), true)

  /** Put the manifest unless another commit landed since `previous` was read (locally
    * under the exclusive `_commit.lock`), then read it back. */
  private[write] def publish(files: DatasetFiles, manifest: ManifestDoc, previous: Option[ManifestDoc]): Unit = {
    val base = previous.flatMap(_.commitId)
    withLock(files) {
      val current = currentCommit(files)
      if (current != ((base, previous.isDefined)))
        throw new ConcurrentCommitException(
          s"dataset '${files.uri}': another write committed while this one was committing (expected commit " +
            s"${base.getOrElse("None")}, found ${current._1.getOrElse("None")}); nothing of this write was published, run it again")
      files.putBytes(Layout.Manifest, manifest.toJson)
    }
    val landed = ManifestDoc.parse(files.readBytes(Layout.Manifest), s"'${files.uri}/${Layout.Manifest}'")
    if (!(landed.commitId == manifest.commitId || landed.parentCommit == manifest.commitId))
      throw new ConcurrentCommitException(
        s"dataset '${files.uri}': another write replaced this commit (${manifest.commitId.get}) as it landed; " +
          "its shards may not be listed, run it again")
  }

  private def withLock[T](files: DatasetFiles)(body: => T): T = {
    if (!files.isLocal) return body
    val deadline = System.nanoTime() + TimeUnit.MILLISECONDS.toNanos((LockWaitSeconds * 1000).toLong)
    val lease = ManifestDoc.mapper.createObjectNode().put("host", host).put("pid", pid).put("started", now)
    while (!files.createExclusive(Layout.Lock, ManifestDoc.mapper.writeValueAsBytes(lease))) {
      val held = Try(files.readBytes(Layout.Lock)).toOption
      val stale = held.exists { b =>
        !alive(b) || Try(ManifestDoc.mapper.readTree(b).get("started").asDouble).toOption.exists(now - _ > LockWaitSeconds * 4)
      }
      if (stale) files.delete(Seq(Layout.Lock))
      else if (System.nanoTime() > deadline)
        throw new ConcurrentCommitException(
          s"dataset '${files.uri}': another commit holds ${Layout.Lock} for over ${LockWaitSeconds.toInt} s; delete it if no write is running")
      else Thread.sleep(50)
    }
    try body finally files.delete(Seq(Layout.Lock))
  }

  /** Delete every file the job wrote that no manifest lists, and its lease. */
  def abort(files: DatasetFiles, jobId: String): Unit = {
    files.delete(Seq(Layout.leaseName(jobId)))
    val listed = if (!files.has(Layout.Manifest)) Set.empty[String]
      else Try(ManifestDoc.parse(files.readBytes(Layout.Manifest), "").shards.map(_.path).toSet).getOrElse(Set.empty)
    val tag = Layout.jobTag(jobId)
    val mine = files.list().filter(n => !listed(n) && Layout.jobOf(n).contains(tag))
    files.delete(mine :+ s"${Layout.Staging}/$jobId")
    if (files.has(Layout.Staging) && files.listUnder(Layout.Staging).isEmpty) files.delete(Seq(Layout.Staging))
  }

}
