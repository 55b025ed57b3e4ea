package io.github.pysparksafetensors

import org.apache.spark.sql.SparkSession
import org.apache.spark.sql.catalyst.expressions.Expression

/** What differs on Spark 4.x: Python data sources live in the session state. */
object SparkLine {
  val HasPythonDataSources: Boolean = true

  def pythonSourceRegistered(spark: SparkSession, name: String): Boolean =
    spark.sessionState.dataSourceManager.dataSourceExists(name)
}

/** An expression that is null whenever an input is: a method since Spark 4.0. */
trait NullIntolerantExpression extends Expression {
  override def nullIntolerant: Boolean = true
}
