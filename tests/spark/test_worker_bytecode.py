"""Bytecode added to Spark's Python zips: the same modules, imported without compiling,
checked against their sources, replaced where another Python wrote them, and none for
tests."""

import subprocess
import sys
import zipfile

import pytest

from pyspark_safetensors.spark.worker_bytecode import (
    add_bytecode,
    has_bytecode,
    main,
    spark_python_zips,
)

pytestmark = pytest.mark.unit

SOURCES = {
    "pkg/__init__.py": "from .mod import answer\n",
    "pkg/mod.py": "def answer():\n    return 42\n",
    "pkg/data.txt": "not a module\n",
    "pkg/tests/__init__.py": "",
    "pkg/tests/test_mod.py": "def test_answer():\n    pass\n",
}


def _zip(path, entries):
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, data in entries.items():
            archive.writestr(name, data)
    return path


def _with_bytecode(tmp_path):
    """A zip of ``SOURCES`` given bytecode, and its entries by name."""
    path = _zip(tmp_path / "lib.zip", SOURCES)
    add_bytecode(path)
    with zipfile.ZipFile(path) as archive:
        return path, {name: archive.read(name) for name in archive.namelist()}


def _import_from(path, expression="pkg.answer()"):
    """Evaluate ``expression`` after importing ``pkg`` from the zip in a fresh Python;
    returns the value and how many of its sources zipimport compiled."""
    code = (
        "import builtins, sys\n"
        "compiled = []\n"
        "real = builtins.compile\n"
        "builtins.compile = lambda *a, **k: compiled.append(a[1]) or real(*a, **k)\n"
        f"sys.path.insert(0, {str(path)!r})\n"
        "import pkg\n"
        f"print({expression}, len({{f for f in compiled if str(f).endswith('.py')}}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    value, compiled = out.stdout.split()
    return value, int(compiled)


def test_modules_import_from_their_bytecode_and_the_rest_is_kept(tmp_path):
    path = _zip(tmp_path / "lib.zip", SOURCES)
    assert _import_from(path) == ("42", 2)  # no bytecode: both modules compiled
    assert not has_bytecode(path)
    assert add_bytecode(path) == 2
    assert has_bytecode(path)
    with zipfile.ZipFile(path) as archive:
        assert sorted(archive.namelist()) == sorted([*SOURCES, "pkg/__init__.pyc", "pkg/mod.pyc"])
        assert all(archive.read(name).decode() == data for name, data in SOURCES.items())
    assert _import_from(path) == ("42", 0)
    # tracebacks name the module as zipimport does, archive path then file
    value, _ = _import_from(path, "pkg.mod.answer.__code__.co_filename")
    assert value == f"{path}/pkg/mod.py"


def test_bytecode_of_a_changed_source_is_not_used(tmp_path):
    path, entries = _with_bytecode(tmp_path)  # the same bytecode, a source edited since
    entries["pkg/mod.py"] = b"def answer():\n    return 7\n"
    _zip(path, entries)
    assert _import_from(path) == ("7", 1)


def test_another_pythons_bytecode_is_replaced(tmp_path):
    path, entries = _with_bytecode(tmp_path)
    for name in ("pkg/__init__.pyc", "pkg/mod.pyc"):
        entries[name] = b"\x00\x00\r\n" + entries[name][4:]  # another magic number
    _zip(path, entries)
    assert not has_bytecode(path)
    assert add_bytecode(path) == 2
    assert has_bytecode(path)
    assert _import_from(path) == ("42", 0)


def test_tests_have_no_bytecode_and_an_earlier_runs_is_removed(tmp_path):
    path, entries = _with_bytecode(tmp_path)
    assert not any(name.startswith("pkg/tests/") and name.endswith(".pyc") for name in entries)
    # bytecode of a test, as an earlier version of add_bytecode wrote it
    entries["pkg/tests/test_mod.pyc"] = entries["pkg/mod.pyc"]
    _zip(path, entries)
    assert not has_bytecode(path)
    add_bytecode(path)
    assert has_bytecode(path)
    with zipfile.ZipFile(path) as archive:
        assert "pkg/tests/test_mod.pyc" not in archive.namelist()


def test_main_adds_once_to_every_zip_of_the_spark_install(tmp_path, monkeypatch, capsys):
    lib = tmp_path / "spark" / "python" / "lib"
    lib.mkdir(parents=True)
    zips = [_zip(lib / "a.zip", SOURCES), _zip(lib / "b.zip", {"b.py": "x = 1\n"})]
    monkeypatch.setenv("SPARK_HOME", str(tmp_path / "spark"))
    assert spark_python_zips() == zips
    assert main(["--quiet"]) == 0
    assert all(has_bytecode(z) for z in zips)
    assert "bytecode of 2 modules added" in capsys.readouterr().out
    assert main(["--quiet"]) == 0
    assert capsys.readouterr().out == ""  # nothing left to do
    assert main([]) == 0
    assert capsys.readouterr().out.count("has bytecode") == 2
