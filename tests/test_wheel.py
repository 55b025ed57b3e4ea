"""An installed wheel works, not only a checkout: the wheel is built from a copy of the
sources, installed into a fresh virtual environment (dependencies reused from this one,
offline), and the README's first Spark example runs there with that environment activated."""

import os
import re
import shutil
import subprocess
import sys

import pytest

pytestmark = pytest.mark.spark

SOURCES = ["pyproject.toml", "setup.py", "MANIFEST.in", "README.md", "conf", "python"]


def first_spark_example(readme: str) -> str:
    blocks = re.findall(r"^```python\n(.*?)^```", readme, flags=re.S | re.M)
    return next(b for b in blocks if 'format("safetensors")' in b)


def test_installed_wheel_runs_the_readme_example(repo_root, tmp_path, python_without_package):
    src = tmp_path / "src"
    src.mkdir()
    for name in SOURCES:
        copy = shutil.copytree if (repo_root / name).is_dir() else shutil.copy2
        ignore = shutil.ignore_patterns("__pycache__", "*.so", "*.egg-info")
        copy(
            repo_root / name, src / name, **({"ignore": ignore} if copy is shutil.copytree else {})
        )
    for jar in (repo_root / "jvm-shim" / "target").glob("*.jar"):
        (src / "jvm-shim" / "target").mkdir(parents=True, exist_ok=True)
        shutil.copy2(jar, src / "jvm-shim" / "target")
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run(
        [*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", tmp_path / "dist", src],
        check=True,
        capture_output=True,
    )
    (wheel,) = (tmp_path / "dist").glob("pyspark_safetensors-*.whl")
    python = python_without_package(tmp_path / "env")
    subprocess.run(
        [python, "-m", "pip", "--disable-pip-version-check", "-q", "install", "--no-deps", wheel],
        check=True,
        capture_output=True,
    )

    work = tmp_path / "work"
    work.mkdir()
    check = (
        "import pyspark_safetensors, site\n"
        "from pyspark_safetensors.spark.session import conf_file\n"
        "from pyspark_safetensors.functions import shim_jar\n"
        "assert pyspark_safetensors.__file__.startswith(site.getsitepackages()[0])\n"
        "assert str(conf_file('log4j2.properties')).startswith(site.getsitepackages()[0])\n"
        "from pyspark_safetensors.spark.shim import shim_jar_name, spark_line\n"
        "jars = {p.name: p for p in __import__('pathlib').Path(site.getsitepackages()[0]).rglob('*shim*.jar')}\n"
        f"assert sorted(jars) == {sorted(p.name for p in (repo_root / 'jvm-shim' / 'target').glob('*.jar'))!r}\n"
        "assert not jars or shim_jar() == jars[shim_jar_name(spark_line())], (shim_jar(), jars)\n"
    )
    script = work / "example.py"
    script.write_text(check + first_spark_example((repo_root / "README.md").read_text()))
    # "Activated": the environment's bin first on PATH, no PYSPARK_PYTHON (Spark's workers
    # and its data source lookup run `python3` from PATH).
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYSPARK_")}
    env.update(
        PATH=f"{python.parent}{os.pathsep}{env['PATH']}", VIRTUAL_ENV=str(python.parent.parent)
    )
    proc = subprocess.run(
        [python, script], cwd=work, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert (work / "data" / "acts" / "dataset_manifest.json").is_file()
