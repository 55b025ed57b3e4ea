"""Publishing a finished file or directory in one step, never losing the old one first.

Every job that produces a local output (extraction, SAE checkpoints, LUTs, conversions)
builds it under a staging name beside its final place and publishes it here. A file
replaces its predecessor atomically (``os.replace``). A directory cannot: the old one is
renamed aside first, the new one takes its name, and only then is the old one deleted, so
a crash at any point leaves either the old or the new output under a name a user can find
(``.{name}.replaced-*`` for the old one in the worst case), never neither.

``StagedOutput`` (``staged_output``) is the same for an output directory on any storage
a ``DatasetLocation`` reaches, object stores included, whose Spark tasks write files of
their own: each attempt under a folder of its own, only the attempts whose results the
driver collected published (see its docstring for what an object store can promise).
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import pyarrow.fs as pafs

from ..format.errors import InvalidArgumentError
from .errors import StorageError
from .location import DatasetLocation


def staging_path(final: str | os.PathLike, tag: str = "staging") -> Path:
    """A unique hidden sibling of ``final`` to build it under (same filesystem, so the
    publishing rename is cheap)."""
    final = Path(final)
    return final.with_name(f".{final.name}.{tag}-{uuid.uuid4().hex[:12]}")


def publish(staged: str | os.PathLike, final: str | os.PathLike) -> Path:
    """Move the finished ``staged`` file or directory to ``final``, replacing what is
    there only once the new one is in place."""
    staged, final = Path(staged), Path(final)
    if staged.is_file() or not final.is_dir():
        os.replace(staged, final)
        return final
    old = staging_path(final, "replaced")
    os.replace(final, old)
    try:
        os.replace(staged, final)
    except BaseException:
        os.replace(old, final)
        raise
    shutil.rmtree(old, ignore_errors=True)
    return final


@contextmanager
def publishing(final: str | os.PathLike, *, directory: bool = True) -> Iterator[Path]:
    """Build an output under a staging path and publish it at ``final`` on success; on
    any failure the staging path is deleted and ``final`` is left as it was.

        with publishing(out_dir) as tmp:
            (tmp / "metadata.json").write_text(...)
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = staging_path(final)
    if directory:
        tmp.mkdir()
    try:
        yield tmp
        publish(tmp, final)
    except BaseException:
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.unlink(missing_ok=True)
        raise


# -- an output directory on any storage ------------------------------------------------------

ATTEMPTS = "_attempts"
"""The folder of a staged output under which each task attempt writes its own files
(``attempt_folder``); only those a driver ``adopt``s are published."""

_PARALLEL_REQUESTS = 16


class StagedFilesMissingError(StorageError):
    """Files the tasks reported are not in the staging location: on a cluster, a local
    output the executors do not share with the driver."""


def attempt_folder(tag: str) -> str:
    """The staging folder of one task attempt (``tag``: unique to the attempt)."""
    return f"{ATTEMPTS}/{tag}"


class StagedOutput:
    """An output directory built under ``staging`` (a hidden sibling of ``final``, on the
    same storage) and published whole at ``final`` by ``publish``, ``marker`` (a file the
    driver writes into ``staging``) last. Task attempts write under ``attempt_folder``;
    the driver ``adopt``s the files of the attempts whose results it collected and every
    other attempt's files are deleted unpublished.

    Locally the adopted files are renamed into place inside the staging directory, which
    then replaces ``final`` as ``publish`` does (atomic: the old output or the new one).
    On an object store (no rename) nothing of ``final`` is touched until every file is
    staged; then its ``marker`` is deleted (the old output stops looking finished), the
    new files are copied in (a server-side copy each), the old output's other files
    deleted, the marker copied last and the staging prefix deleted. A failure before that
    leaves ``final`` as it was; a failure while publishing leaves it without its marker
    (unfinished: run the job again)."""

    def __init__(self, final: DatasetLocation, marker: str):
        self.final, self.marker = final, marker
        self._adopted: dict[str, str] = {}
        if final.is_local:
            root = staging_path(final.root)
            root.parent.mkdir(parents=True, exist_ok=True)
            root.mkdir()
            self.staging = DatasetLocation.of(root)
        else:
            parent, name = final.parent()
            if not name or parent.root in ("", "/"):
                raise InvalidArgumentError(
                    f"{final.uri}: give a folder inside a bucket (s3://bucket/graphs), not a "
                    "bucket itself: the output is staged beside it"
                )
            self.staging = parent.child(f".{name}.staging-{uuid.uuid4().hex[:12]}")

    def adopt(self, staged: str, final: str) -> None:
        """Publish the staged file ``staged`` (a task attempt's) as ``final``."""
        self._adopted[final] = staged

    def publish(self) -> None:
        files = {n for n, i in self.staging.list(recursive=True).items()
                 if i.type == pafs.FileType.File}  # fmt: skip
        missing = sorted(set(self._adopted.values()) - files)
        if missing:
            raise StagedFilesMissingError(
                errno.ENOENT,
                f"{len(missing)} file(s) the tasks reported are not in {self.staging.uri} "
                f"(e.g. {missing[0]!r}): the executors wrote them where the driver cannot see "
                "them; a local output must be on a disk every executor shares, else give a "
                "URI every executor reaches (s3://..., hdfs://...)",
            )
        own = {n: n for n in files if not n.startswith(ATTEMPTS + "/")}
        if self.marker not in own:
            raise StorageError(errno.ENOENT, f"{self.staging.display(self.marker)} was not written")
        if self.final.is_local:
            for final, staged in self._adopted.items():
                target = Path(self.staging.path(final, what="file"))
                target.parent.mkdir(parents=True, exist_ok=True)
                os.replace(self.staging.path(staged, what="file"), target)
            shutil.rmtree(self.staging.path(ATTEMPTS, what="folder"), ignore_errors=True)
            publish(self.staging.root, self.final.root)
            return
        new = own | self._adopted
        old = self.final.list(recursive=True)
        self.final.delete([self.marker])
        self._parallel(
            lambda name: self.staging.copy_to(new[name], self.final, name),
            [n for n in new if n != self.marker],
        )
        gone = [n for n, i in old.items() if i.type == pafs.FileType.File and n not in new]
        self._parallel(lambda name: self.final.delete([name]), gone)
        kept = {n.rpartition("/")[0] for n in new}
        kept |= {p for n in kept for p in _parents(n)}
        folders = [n for n, i in old.items() if i.type == pafs.FileType.Directory and n not in kept]
        self.final.delete(sorted(folders, key=len))  # outermost first: the rest goes with it
        self.staging.copy_to(self.marker, self.final, self.marker)
        self.discard()

    def discard(self) -> None:
        """Delete the staging location and everything under it."""
        if self.staging.is_local:
            shutil.rmtree(self.staging.root, ignore_errors=True)
            return
        with contextlib.suppress(FileNotFoundError):
            self.staging.fs.delete_dir(self.staging.root)

    @staticmethod
    def _parallel(call, names) -> None:
        if not names:
            return
        with ThreadPoolExecutor(min(_PARALLEL_REQUESTS, len(names))) as pool:
            for _ in pool.map(call, names):
                pass


def _parents(name: str) -> list[str]:
    parts = name.split("/")
    return ["/".join(parts[:i]) for i in range(1, len(parts))]


@contextmanager
def staged_output(final: DatasetLocation, marker: str) -> Iterator[StagedOutput]:
    """A ``StagedOutput`` published when the block ends, discarded when it raises.

    with staged_output(DatasetLocation.of("s3://bucket/out"), "done.json") as out:
        out.staging.put_bytes("table.parquet", data)
        out.adopt("_attempts/t7/part-0.js", "data/part-0.js")
        out.staging.put_json("done.json", summary)
    """
    out = StagedOutput(final, marker)
    try:
        yield out
        out.publish()
    except BaseException:
        out.discard()
        raise
