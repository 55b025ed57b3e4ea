package io.github.pysparksafetensors.core

import java.time.LocalDate

import scala.util.Try

import org.apache.spark.sql.catalyst.InternalRow
import org.apache.spark.sql.catalyst.catalog.ExternalCatalogUtils
import org.apache.spark.sql.catalyst.expressions.GenericInternalRow
import org.apache.spark.sql.sources._
import org.apache.spark.sql.types._
import org.apache.spark.unsafe.types.UTF8String

/** Hive-style partition directories (`layer=3/hook=mlp/`), as Spark's file sources lay them
  * out: values escaped as Spark escapes them, a null (or empty) value written
  * `__HIVE_DEFAULT_PARTITION__`, and the columns' types inferred on read as Spark infers
  * them for parquet (int, then bigint, double, date, else string). */
object Partitions {
  val Null: String = ExternalCatalogUtils.DEFAULT_PARTITION_NAME

  /** The types a partition column may have: their text form is a directory name. */
  def supported(t: DataType): Boolean = t match {
    case StringType | IntegerType | LongType | ShortType | ByteType | BooleanType | DateType => true
    case _ => false
  }

  /** The directory (`a=1/b=x`) of the row's values at `ordinals`. */
  def dir(row: InternalRow, columns: Seq[String], ordinals: Array[Int], types: Array[DataType]): String =
    columns.indices.map { i =>
      val o = ordinals(i)
      val raw =
        if (row.isNullAt(o)) ""
        else types(i) match {
          case StringType => row.getUTF8String(o).toString
          case DateType => LocalDate.ofEpochDay(row.getInt(o).toLong).toString
          case t => row.get(o, t).toString
        }
      s"${ExternalCatalogUtils.escapePathName(columns(i))}=${if (raw.isEmpty) Null else ExternalCatalogUtils.escapePathName(raw)}"
    }.mkString("/")

  /** The raw values of a shard path's directories `a=1/b=x/part-…` for `columns`, in
    * order (None: null), or None when the path is not laid out that way. */
  def values(path: String, columns: Seq[String]): Option[Seq[Option[String]]] = {
    val dirs = path.split('/').toSeq.dropRight(1)
    if (dirs.size != columns.size) return None
    val parsed = dirs.zip(columns).map { case (d, column) =>
      val at = d.indexOf('=')
      if (at < 0 || ExternalCatalogUtils.unescapePathName(d.substring(0, at)) != column) return None
      val v = ExternalCatalogUtils.unescapePathName(d.substring(at + 1))
      if (v == Null) None else Some(v)
    }
    Some(parsed)
  }

  /** The directory prefix (`a=1/b=x`) of a shard path in a partitioned dataset. */
  def prefix(path: String): String = path.substring(0, math.max(0, path.lastIndexOf('/')))

  /** A column's type from all its values, as Spark infers a parquet partition column's. */
  def inferType(values: Seq[Option[String]]): DataType = {
    val present = values.flatten
    def all(ok: String => Boolean) = present.nonEmpty && present.forall(ok)
    if (all(v => Try(v.toInt).isSuccess)) IntegerType
    else if (all(v => Try(v.toLong).isSuccess)) LongType
    else if (all(v => !v.exists(_.isLetter) && Try(v.toDouble).isSuccess)) DoubleType
    else if (all(v => v.length == 10 && Try(LocalDate.parse(v)).isSuccess)) DateType
    else StringType
  }

  /** The typed row of one partition's raw values (types from `inferType`). */
  def row(raw: Seq[Option[String]], schema: StructType): InternalRow =
    new GenericInternalRow(raw.zip(schema.fields).map {
      case (None, _) => null
      case (Some(v), f) => f.dataType match {
        case IntegerType => v.toInt
        case LongType => v.toLong
        case DoubleType => v.toDouble
        case DateType => LocalDate.parse(v).toEpochDay.toInt
        case _ => UTF8String.fromString(v)
      }
    }.toArray[Any])

  /** Whether a partition with these values may hold rows that pass `filter`: false only
    * when the filter names partition columns alone and their values fail it (a filter this
    * cannot decide keeps the partition; Spark applies every filter to the rows again). */
  def mayMatch(filter: Filter, raw: Map[String, Option[String]], types: Map[String, DataType]): Boolean =
    decide(filter, raw, types).getOrElse(true)

  /** Whether a partition with these values passes `f`; None when `f` names other columns
    * or is a filter this does not evaluate. */
  def decide(f: Filter, raw: Map[String, Option[String]], types: Map[String, DataType]): Option[Boolean] = {
    def cmp(column: String, value: Any)(test: Int => Boolean): Option[Boolean] =
      if (!raw.contains(column)) None
      else raw(column) match {
        case None => Some(false) // a comparison with null is never true
        case Some(v) => compare(v, types(column), value).map(test)
      }
    f match {
      case EqualTo(c, v) => cmp(c, v)(_ == 0)
      case EqualNullSafe(c, null) if raw.contains(c) => Some(raw(c).isEmpty)
      case EqualNullSafe(c, v) => cmp(c, v)(_ == 0)
      case GreaterThan(c, v) => cmp(c, v)(_ > 0)
      case GreaterThanOrEqual(c, v) => cmp(c, v)(_ >= 0)
      case LessThan(c, v) => cmp(c, v)(_ < 0)
      case LessThanOrEqual(c, v) => cmp(c, v)(_ <= 0)
      case In(c, vs) if raw.contains(c) =>
        val each = vs.toSeq.map(v => cmp(c, v)(_ == 0))
        if (each.contains(Some(true))) Some(true) else if (each.forall(_.contains(false))) Some(false) else None
      case IsNull(c) if raw.contains(c) => Some(raw(c).isEmpty)
      case IsNotNull(c) if raw.contains(c) => Some(raw(c).isDefined)
      case StringStartsWith(c, p) if raw.contains(c) => Some(raw(c).exists(_.startsWith(p)))
      case And(a, b) =>
        (decide(a, raw, types), decide(b, raw, types)) match {
          case (Some(false), _) | (_, Some(false)) => Some(false)
          case (Some(true), Some(true)) => Some(true)
          case _ => None
        }
      case Or(a, b) =>
        (decide(a, raw, types), decide(b, raw, types)) match {
          case (Some(true), _) | (_, Some(true)) => Some(true)
          case (Some(false), Some(false)) => Some(false)
          case _ => None
        }
      case Not(a) => decide(a, raw, types).map(!_)
      case _ => None
    }
  }

  /** `raw` (of type `t`) against a filter's value: the sign of raw − value, or None when
    * the two cannot be compared here. */
  private def compare(raw: String, t: DataType, value: Any): Option[Int] = (t, value) match {
    case (IntegerType | LongType | DoubleType, n: java.lang.Number) =>
      Try(BigDecimal(raw).compare(BigDecimal(n.toString))).toOption
    case (DateType, d: java.sql.Date) => Some(LocalDate.parse(raw).compareTo(d.toLocalDate))
    case (DateType, d: LocalDate) => Some(LocalDate.parse(raw).compareTo(d))
    case (StringType, s: String) => Some(Integer.signum(raw.compareTo(s)))
    case _ => None
  }
}
