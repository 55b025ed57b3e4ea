#!/usr/bin/env bash
# Builds the shim jar of one Spark line offline: the Scala compiler and the Spark jars both
# ship inside the installed pyspark wheel (pyspark/jars), so no sbt and no network are
# needed. The jar carries none of Spark.
#
#   jvm-shim/build.sh [python]     python: the interpreter whose pyspark to build against
#                                   (default: the repo's .venv, else python3)
#
# The jar is jvm-shim/target/pyspark-safetensors-shim-{line}_{scala}-{version}.jar, e.g.
# pyspark-safetensors-shim-3.5_2.12-0.1.0.jar: the Spark line of that pyspark and the Scala
# version its jars were built with. Sources: src/main/scala (every line) plus the one
# folder of what differs on that line, src/spark-{line} when it exists, else
# src/spark-{major}. Rebuilds only when a source, the Spark jars or this script changed.
# Every jar built is kept in the cache (${PYSPARK_SAFETENSORS_CACHE:-~/.cache/pyspark-safetensors}/jars),
# by the hash of everything it is built from: another checkout of the same sources (a
# clone a wheel is built from) takes it from there instead of compiling it again.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(dirname "$HERE")
PY=${1:-$ROOT/.venv/bin/python}
[ -x "$PY" ] || PY=python3

read -r JARS SPARK <<<"$("$PY" -c 'import os, pyspark; print(os.path.join(os.path.dirname(pyspark.__file__), "jars"), pyspark.__version__)')"
[ -d "$JARS" ] || { echo "error: no pyspark/jars under $JARS; install pyspark first" >&2; exit 1; }
LINE=$(echo "$SPARK" | cut -d. -f1,2)
SCALA=$(basename "$(ls "$JARS"/scala-library-*.jar)" | sed 's/scala-library-\([0-9]*\.[0-9]*\)\..*/\1/')
LINE_DIR=$HERE/src/spark-$LINE
[ -d "$LINE_DIR" ] || LINE_DIR=$HERE/src/spark-${LINE%%.*}
[ -d "$LINE_DIR" ] || { echo "error: no jvm-shim/src/spark-$LINE or spark-${LINE%%.*} for Spark $SPARK" >&2; exit 1; }
VERSION=$(sed -n 's/^ThisBuild \/ version := "\(.*\)"/\1/p' "$ROOT/build.sbt")
NAME=pyspark-safetensors-shim-${LINE}_$SCALA-$VERSION
JAR=$HERE/target/$NAME.jar
SOURCES=$(find "$HERE/src/main/scala" "$LINE_DIR" -name '*.scala' | sort)
# Resources go into the jar as they are: the service entry that registers the short name.
RESOURCES=$HERE/src/main/resources

STAMP=$HERE/target/.$NAME.sha256
want=$(cat $SOURCES $(find "$RESOURCES" -type f | sort) "$0" | sha256sum | cut -d' ' -f1)-$(basename "$(ls "$JARS"/spark-sql_*.jar)")
if [ -f "$JAR" ] && [ "$(cat "$STAMP" 2>/dev/null)" = "$want" ]; then
  exit 0
fi
CACHED=${PYSPARK_SAFETENSORS_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/pyspark-safetensors}/jars/$want/$NAME.jar
mkdir -p "$HERE/target"
if [ -f "$CACHED" ]; then
  cp "$CACHED" "$JAR.tmp" && mv "$JAR.tmp" "$JAR"
  echo "$want" >"$STAMP"
  exit 0
fi

echo "building $(basename "$JAR") with the Scala $SCALA compiler of pyspark $SPARK" >&2
CLASSES=$HERE/target/classes-$LINE
rm -rf "$CLASSES" "$JAR"
mkdir -p "$CLASSES"
# -usejavacp: compile against the same jars the compiler runs from (Spark + Scala library).
java -Xss8m -cp "$JARS/*" scala.tools.nsc.Main -usejavacp -nowarn -deprecation -feature \
  -d "$CLASSES" $SOURCES
# A jar is a zip with a manifest; Python's zipfile writes it where no JDK 'jar' tool exists.
"$PY" - "$CLASSES" "$RESOURCES" "$JAR" "$SPARK" <<'PY'
import os, sys, zipfile
classes, resources, jar, spark = sys.argv[1:]
manifest = (
    "Manifest-Version: 1.0\r\nCreated-By: pyspark-safetensors jvm-shim/build.sh\r\n"
    f"Spark-Version: {spark}\r\n\r\n"
)
with zipfile.ZipFile(jar + ".tmp", "w", zipfile.ZIP_DEFLATED) as z:
    z.writestr("META-INF/MANIFEST.MF", manifest)
    for root in (classes, resources):
        for folder, _, files in sorted(os.walk(root)):
            for name in sorted(files):
                path = os.path.join(folder, name)
                z.write(path, os.path.relpath(path, root))
os.replace(jar + ".tmp", jar)
PY
rm -rf "$CLASSES"
echo "$want" >"$STAMP"
# The cache is a convenience: a read-only or full one leaves the build as it is.
{ mkdir -p "$(dirname "$CACHED")" && cp "$JAR" "$CACHED.$$" && mv "$CACHED.$$" "$CACHED"; } 2>/dev/null ||
  rm -f "$CACHED.$$"
echo "built $JAR" >&2
