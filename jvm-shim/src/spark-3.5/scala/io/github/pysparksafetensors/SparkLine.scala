package io.github.pysparksafetensors

import org.apache.spark.sql.SparkSession
import org.apache.spark.sql.catalyst.expressions.{Expression, NullIntolerant}

/** What differs on Spark 3.5: no Python data sources. */
object SparkLine {
  val HasPythonDataSources: Boolean = false

  def pythonSourceRegistered(spark: SparkSession, name: String): Boolean = false
}

/** An expression that is null whenever an input is: a marker trait on 3.5. */
trait NullIntolerantExpression extends Expression with NullIntolerant
