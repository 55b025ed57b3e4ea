"""The command line: every command documents its options; a mistake in what the user typed
exits with code 2 and a message, never a traceback."""

import subprocess
import sys

import numpy as np
import pytest

from pyspark_safetensors.cli import COMMANDS
from pyspark_safetensors.dataset import write_batch_dataset

pytestmark = pytest.mark.unit


def cli(*args, cwd=None):
    return subprocess.run(
        [sys.executable, "-m", "pyspark_safetensors.cli", *map(str, args)],
        capture_output=True, text=True, cwd=cwd, timeout=300,
    )  # fmt: skip


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_command_has_help(command):
    result = cli(command, "--help")
    assert result.returncode == 0, result.stderr
    assert "usage" in result.stdout.lower() or "pyspark-safetensors" in result.stdout
    assert "Traceback" not in result.stderr


def test_help_answers_without_loading_torch():
    """--help (and any mistake on the command line) is answered before torch loads."""
    script = (
        "import sys\n"
        "from pyspark_safetensors.cli import COMMANDS, main\n"
        "for command in COMMANDS:\n"
        "    if command != 'bench':  # runs the benchmarks' own --help in a process\n"
        "        main([command, '--help'])\n"
        "main(['lut']); main(['evaluate']); main(['train', '--k', 'many'])  # mistakes\n"
        "print(sorted(m for m in ('torch', 'transformers', 'pyspark') if m in sys.modules))\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == "[]"


def test_train_help_lists_every_config_field_with_its_default():
    import dataclasses

    from pyspark_safetensors.sae import SAEConfig

    out = cli("train", "--help").stdout
    for field in dataclasses.fields(SAEConfig):
        assert f"--{field.name.replace('_', '-')}" in out, field.name
    assert "Active latents per token" in out  # the field's docstring


def test_version():
    from pyspark_safetensors import __version__

    result = cli("--version")
    assert result.returncode == 0 and __version__ in result.stdout


def assert_user_error(result, *needles):
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert "Traceback" not in result.stderr, result.stderr
    for needle in needles:
        assert needle in result.stderr, result.stderr


def test_unknown_command_suggests_the_close_one():
    assert_user_error(cli("pipline"), "did you mean 'pipeline'")


def test_unknown_benchmark_is_refused_before_any_runs():
    assert_user_error(cli("bench", "casts", "extrct"), "unknown benchmark 'extrct'", "extract")


def test_unknown_option_suggests_the_close_one():
    assert_user_error(cli("train", "--kk", "64"), "--kk", "--k")


def test_misspelled_option_value_is_refused():
    assert_user_error(cli("train", "--k", "many"), "--k")


def test_manifest_file_given_as_dataset(tmp_path):
    write_batch_dataset(tmp_path / "ds", {"activation": np.ones((8, 4), np.float32)})
    result = cli("train", "--dataset", tmp_path / "ds" / "dataset_manifest.json", "--no-progress")
    assert_user_error(result)
    assert len(result.stderr.strip().splitlines()) == 1


def test_model_directory_given_to_inspect(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    result = cli("inspect", tmp_path / "model")
    assert_user_error(result, "not a safetensors dataset")
    assert len(result.stderr.strip().splitlines()) == 1


def test_garbage_given_to_inspect(tmp_path):
    (tmp_path / "notes.txt").write_bytes(b"this is not a safetensors file at all, just text\n")
    result = cli("inspect", tmp_path / "notes.txt")
    assert_user_error(result, "not a safetensors file")
    assert len(result.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize(
    "command,positionals",
    [("convert", "SRC DST"), ("inspect", "PATH"), ("verify", "PATH"), ("lut", "MODEL_DIR")],
)
def test_usage_line_names_the_positional_arguments(command, positionals):
    usage = cli(command, "--help").stdout.splitlines()[0]
    assert usage.startswith(f"usage: pyspark-safetensors {command} {positionals} ")


def test_only_the_package_errors_are_one_line_a_bug_keeps_its_traceback(monkeypatch, capsys):
    from pyspark_safetensors import PysparkSafetensorsError
    from pyspark_safetensors.cli import main
    from pyspark_safetensors.format.errors import InvalidArgumentError

    def mistake(argv):
        raise InvalidArgumentError("rows_per_shard must be >= 1")

    def bug(argv):
        raise ValueError("an internal invariant broke")

    monkeypatch.setitem(COMMANDS, "mistake", mistake)
    monkeypatch.setitem(COMMANDS, "bug", bug)
    assert main(["mistake"]) == 2
    assert capsys.readouterr().err == "error: rows_per_shard must be >= 1\n"
    with pytest.raises(ValueError, match="an internal invariant broke") as info:
        main(["bug"])
    assert not isinstance(info.value, PysparkSafetensorsError)


def test_missing_path_and_missing_arguments(tmp_path):
    assert_user_error(cli("verify", tmp_path / "nothing-here"))
    assert_user_error(cli("lut", "--sae", "x=y"), "MODEL_DIR")
    assert_user_error(cli("convert", tmp_path, "--to", "zarr"), "SRC and DST")


def test_storage_options_are_key_value_pairs(tmp_path):
    for command in (["extract", "--out", tmp_path / "acts"],
                    ["features", "--extraction", tmp_path, "--sae", tmp_path / "sae", "--out", tmp_path / "f"]):  # fmt: skip
        assert_user_error(cli(*command, "--storage-option", "no-value"), "expected KEY=VALUE")


def test_debug_shows_the_traceback(tmp_path):
    result = cli("--debug", "verify", tmp_path / "nothing-here")
    assert result.returncode != 0 and "Traceback" in result.stderr
