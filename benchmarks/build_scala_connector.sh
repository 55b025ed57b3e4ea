#!/usr/bin/env bash
# Builds the Scala safetensors connector (SemyonSinchenko/safetensors-spark), the connector
# the reader and writer benchmarks compare with, offline from a checkout of its public
# sources, the way jvm-shim/build.sh builds ours: the Scala compiler and the Spark jars
# inside the installed pyspark wheel, no sbt, no network.
#
#   benchmarks/build_scala_connector.sh SRC [python]
#     SRC     a checkout of the connector's repository (git clone it first)
#     python  the interpreter whose pyspark to use (default: the repo's .venv)
#
# Prints the jar's path; pass it to the benchmarks as SCALA_CONNECTOR_JAR.
set -euo pipefail
SRC=${1:?usage: benchmarks/build_scala_connector.sh SRC [python]}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${2:-$ROOT/.venv/bin/python}
[ -d "$SRC/src/main/scala" ] || { echo "error: $SRC has no src/main/scala: not the connector's sources" >&2; exit 1; }
JARS=$("$PY" -c 'import os, pyspark; print(os.path.join(os.path.dirname(pyspark.__file__), "jars"))')
# The connector keeps the code that differs between Spark minor versions in
# scala-spark-X.Y: take the newest one not newer than the installed Spark.
MINOR=$("$PY" - "$SRC/src/main" <<'PY'
import os, sys, pyspark
ours = tuple(int(x) for x in pyspark.__version__.split(".")[:2])
have = [tuple(int(x) for x in d.removeprefix("scala-spark-").split("."))
        for d in os.listdir(sys.argv[1]) if d.startswith("scala-spark-")]
print(".".join(map(str, max((v for v in have if v <= ours), default=ours))))
PY
)
OUT=$ROOT/benchmarks/target
CLASSES=$OUT/scala-connector-classes
JAR=$OUT/safetensors-spark-$MINOR.jar
rm -rf "$CLASSES" "$JAR"
mkdir -p "$CLASSES"
# Its main sources, without the MLflow dataset source (MLflow is not on Spark's classpath).
SOURCES=$(find "$SRC/src/main/scala" "$SRC/src/main/scala-spark-$MINOR" -name '*.scala' 2>/dev/null |
  grep -v '/mlflow/' | sort)
echo "compiling the Scala connector (its Spark $MINOR sources) with the Scala compiler in pyspark/jars" >&2
java -Xss8m -cp "$JARS/*" scala.tools.nsc.Main -usejavacp -nowarn -d "$CLASSES" $SOURCES
cp -r "$SRC/src/main/resources/." "$CLASSES/"
(cd "$CLASSES" && "$PY" -m zipfile -c "$JAR" ./*)
rm -rf "$CLASSES"
echo "$JAR"
