"""Where a dataset lives: one storage interface for local directories and object stores.

``DatasetLocation`` is storage only: listing, stat, whole and ranged reads, checksums of
stored files, shards written by tasks, atomic puts and deletion. It knows names, never
what a manifest or an index means: those rules live in ``manifest.py``, ``index.py`` and
``verify.py``, and the shard readers in ``shards.py``; they import this module, never the
reverse. It is implemented once over ``pyarrow.fs`` (S3, GCS, Azure, HDFS natively; any
fsspec protocol through ``PyFileSystem(FSSpecHandler)``) with a fast local path (files
written in place). Callers never ask which kind of storage they have.

    loc = DatasetLocation.of("s3://bucket/acts")          # or a path, file:, gs://, ...
    manifest = verify_dataset(loc)
    with open_shard(loc, manifest.shards[0].shard_path) as shard:
        x = shard.tensor("activation")
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import posixpath
import re
import shutil
import stat
import tempfile
import uuid
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

import pyarrow as pa
import pyarrow.fs as pafs

from ..format import SafetensorsFormatError
from ..format.errors import InvalidArgumentError, InvalidTypeError
from .errors import DatasetReplacedError, ManifestError, SpecialFileError, StorageError

_URI = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]+):")
_CHUNK = 16 << 20

# Hadoop spellings users copy from Spark jobs, and their pyarrow names.
_SCHEME_ALIASES = {"s3a": "s3", "s3n": "s3", "abfss": "abfs"}

STORAGE_OPTIONS = ("endpoint_url", "region", "path_style", "anonymous")
"""Data-source options that configure the filesystem instead of the data (see
``DatasetLocation.of``)."""


def _scheme(text: str) -> str | None:
    m = _URI.match(text)
    # one letter before ':' is a Windows drive, not a scheme
    return m.group(1).lower() if m and len(m.group(1)) > 1 else None


def split_storage_options(options: Mapping[str, str]) -> tuple[dict[str, str], dict[str, str]]:
    """Split data-source options into (storage options, the rest); names case-insensitive."""
    storage, rest = {}, {}
    for k, v in options.items():
        (storage if k.lower() in STORAGE_OPTIONS else rest)[
            k if k.lower() not in STORAGE_OPTIONS else k.lower()
        ] = v
    return storage, rest


def _truthy(name: str, value) -> bool:
    if isinstance(value, bool):
        return value
    v = str(value).strip().lower()
    if v in ("true", "1", "yes"):
        return True
    if v in ("false", "0", "no"):
        return False
    raise InvalidArgumentError(f"storage option {name}={value!r}: expected true or false")


def _s3_filesystem(options: Mapping[str, str]) -> pafs.S3FileSystem:
    kw: dict = {}
    unknown = sorted(set(options) - set(STORAGE_OPTIONS))
    if unknown:
        raise InvalidArgumentError(
            f"unknown storage option(s) {unknown}; valid: {', '.join(STORAGE_OPTIONS)}"
        )
    endpoint = (
        options.get("endpoint_url")
        or os.environ.get("AWS_ENDPOINT_URL_S3")
        or os.environ.get("AWS_ENDPOINT_URL")
    )
    if endpoint:
        scheme, _, host = endpoint.rpartition("://")
        kw["endpoint_override"] = host.rstrip("/")
        kw["scheme"] = scheme or "https"
    region = (
        options.get("region")
        or os.environ.get("AWS_REGION")
        or os.environ.get("AWS_DEFAULT_REGION")
    )
    if region:
        kw["region"] = region
    if "path_style" in options:
        kw["force_virtual_addressing"] = not _truthy("path_style", options["path_style"])
    if "anonymous" in options:
        kw["anonymous"] = _truthy("anonymous", options["anonymous"])
    return pafs.S3FileSystem(**kw)


class DatasetLocation:
    """A dataset directory on some storage. Picklable (Spark tasks, DataLoader workers,
    spawn included) when its filesystem is; open files are per process."""

    def __init__(self, filesystem, root: str, uri: str | None = None):
        self.fs = as_arrow_filesystem(filesystem)
        self._local = isinstance(self.fs, pafs.LocalFileSystem)
        self.root = os.path.abspath(root) if self._local else root.rstrip("/")
        self.uri = uri or self.root
        self._pid, self._open = os.getpid(), {}

    # -- construction

    @classmethod
    def of(
        cls,
        path: str | os.PathLike | DatasetLocation,
        filesystem=None,
        storage_options: Mapping[str, str] | None = None,
    ) -> DatasetLocation:
        """A location from a path or URI.

        Local paths and ``file:`` URIs are memory-mapped. ``s3://`` (also ``s3a://``,
        ``s3n://``), ``gs://``, ``abfs://``/``abfss://``, ``hdfs://`` go to pyarrow's
        filesystems, any other protocol to fsspec; ``dbfs:/x`` is ``/dbfs/x`` where that
        mount exists. Endpoint, region and credentials come from the usual environment
        (``AWS_ENDPOINT_URL``, ``AWS_REGION``, ``AWS_ACCESS_KEY_ID``, the GCP/Azure
        variables, instance roles). ``storage_options`` (S3: ``endpoint_url``, ``region``,
        ``path_style``, ``anonymous``; fsspec: its own keyword arguments) override them.
        With ``filesystem`` (a ``pyarrow.fs`` or fsspec filesystem), ``path`` is a path on it.
        """
        if isinstance(path, DatasetLocation):
            return path
        text = os.fspath(path)
        options = dict(storage_options or {})
        if filesystem is not None:
            return cls(filesystem, text, text)
        scheme = _scheme(text)
        if scheme is None or scheme == "file":
            return cls(pafs.LocalFileSystem(), _strip_file_scheme(text), text)
        if scheme == "dbfs" and os.path.isdir("/dbfs"):
            return cls(pafs.LocalFileSystem(), "/dbfs/" + text[5:].lstrip("/"), text)
        scheme = _SCHEME_ALIASES.get(scheme, scheme)
        rest = text.split(":", 1)[1]
        if scheme == "s3":
            bucket_path = rest.lstrip("/")
            if not bucket_path:
                raise InvalidArgumentError(f"{text!r}: an s3 URI needs a bucket: s3://bucket/path")
            return cls(_s3_filesystem(options), bucket_path, text)
        if scheme in ("gs", "gcs", "abfs", "hdfs", "viewfs") and not options:
            try:
                fs, root = pafs.FileSystem.from_uri(f"{scheme}:{rest}")
                return cls(fs, root, text)
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError, ValueError, OSError):
                pass  # not built into this pyarrow: fsspec may know it
        try:
            import fsspec
        except ImportError:  # pragma: no cover - fsspec ships with the torch extra
            raise InvalidArgumentError(
                f"{text!r}: pyarrow has no filesystem for {scheme}:// and fsspec is not installed"
            ) from None
        fs, root = fsspec.core.url_to_fs(text, **options)
        return cls(fs, root, text)

    def __str__(self) -> str:
        return self.uri

    def __repr__(self) -> str:
        return f"DatasetLocation({self.uri!r})"

    def __getstate__(self):
        return {"fs": self.fs, "root": self.root, "uri": self.uri}

    def __setstate__(self, state):
        self.__init__(state["fs"], state["root"], state["uri"])

    def parent(self) -> tuple[DatasetLocation, str]:
        """(the location of the enclosing directory, this location's last name): how a
        single file is read through the same interface."""
        parent, _, name = self.root.rstrip("/").rpartition("/")
        uri_parent = self.uri.rstrip("/").rpartition("/")[0]
        return DatasetLocation(self.fs, parent or "/", uri_parent or "."), name

    def child(self, name: str) -> DatasetLocation:
        """The location of directory ``name`` inside this one (a partition of a dataset)."""
        return DatasetLocation(
            self.fs, self.path(name, what="partition"), f"{self.uri.rstrip('/')}/{name}"
        )

    @property
    def is_local(self) -> bool:
        """Whether the dataset is on local storage (memory-mapped by the shard readers)."""
        return self._local

    # -- names

    def path(self, name: str, *, what: str = "shard path") -> str:
        """The full path of ``name`` inside the dataset, refusing absolute names, ``..``
        and backslashes (no listed name may reach outside the directory)."""
        if (
            not isinstance(name, str)
            or not name
            or name.startswith("/")
            or "\\" in name
            or "\x00" in name
            or ".." in name.split("/")
            or _scheme(name) is not None
        ):
            raise ManifestError(
                f"{what} {name!r} in {self.uri!r} must be a relative name inside the dataset"
            )
        return posixpath.join(self.root, name)

    def display(self, name: str) -> str:
        """``name`` as users see it (the URI they gave, joined)."""
        return posixpath.join(self.uri, name)

    # -- listing and stat

    def exists(self) -> bool:
        """Whether the directory exists (on object stores: whether anything is under it)."""
        info = self.fs.get_file_info(self.root)
        if info.type == pafs.FileType.Directory:
            return True
        return bool(self.list()) if not self._local else False

    def has(self, name: str) -> bool:
        return self.fs.get_file_info(self.path(name, what="file")).type != pafs.FileType.NotFound

    def is_file(self, name: str) -> bool:
        return self.fs.get_file_info(self.path(name, what="file")).type == pafs.FileType.File

    def list(self, *, recursive: bool = False) -> dict[str, pafs.FileInfo]:
        """Everything under the directory by relative name (one listing)."""
        try:
            infos = self.fs.get_file_info(
                pafs.FileSelector(self.root, recursive=recursive, allow_not_found=True)
            )
        except NotADirectoryError:  # a file: nothing under it
            return {}
        prefix = self.root.rstrip("/") + "/"
        return {i.path[len(prefix) :] if i.path.startswith(prefix) else i.path: i for i in infos}

    def list_under(self, folder: str) -> dict[str, pafs.FileInfo]:
        """What is directly under a sub-folder, by name relative to it."""
        return DatasetLocation(
            self.fs, self.path(folder, what="folder"), self.display(folder)
        ).list()

    def local_file(self, name: str) -> str | None:
        """The local path of ``name`` when the dataset is on local storage (for locks and
        memory maps), else None."""
        return self.path(name, what="file") if self._local else None

    def sizes(self) -> dict[str, int]:
        """Every regular file directly in the directory with its size (one listing)."""
        return {n: i.size for n, i in self.list().items() if i.type == pafs.FileType.File}

    def regular_size(self, name: str) -> int | None:
        """The size of ``name``; None when missing; ``SpecialFileError`` when it is not a
        regular file (checked before any open: opening a FIFO would block)."""
        full = self.path(name)
        if self._local:
            try:
                st = os.stat(full)
            except FileNotFoundError:
                return None
            if not stat.S_ISREG(st.st_mode):
                raise SpecialFileError(
                    f"{self.display(name)!r} is not a regular file ({_kind(st.st_mode)}); a shard must be a file"
                )
            return st.st_size
        info = self.fs.get_file_info(full)
        if info.type == pafs.FileType.NotFound:
            return None
        if info.type != pafs.FileType.File:
            raise SpecialFileError(
                f"{self.display(name)!r} is not a regular file; a shard must be a file"
            )
        return info.size

    # -- reads

    def read_bytes(self, name: str) -> bytes:
        with self.reading(name):
            if self._local:
                self._refuse_special(name)
                return Path(self.path(name, what="file")).read_bytes()
            with self.fs.open_input_stream(self.path(name, what="file")) as f:
                return f.read()

    def read_range(self, name: str, begin: int, end: int):
        """Bytes ``[begin, end)`` of ``name``: one ranged read (files stay open per process)."""
        with self.reading(name):
            data = self._input_file(name).read_at(end - begin, begin)
        if len(data) != end - begin:
            raise SafetensorsFormatError(
                f"byte range [{begin}, {end}) reaches past the end of the file",
                path=self.display(name),
            )
        return data

    def stream_crc32c(self, name: str) -> str:
        """crc32c (hex) of a stored file, streamed in 16 MB chunks."""
        with self.reading(name):
            if self._local:
                self._refuse_special(name)
                with open(self.path(name), "rb") as f:
                    return stream_crc32c(f)
            with self.fs.open_input_stream(self.path(name)) as f:
                return stream_crc32c(f)

    def _input_file(self, name: str):
        if self._pid != os.getpid():
            self._pid, self._open = os.getpid(), {}
        f = self._open.get(name)
        if f is None:
            if self._local:
                self._refuse_special(name)
            f = self._open[name] = self.fs.open_input_file(self.path(name))
        return f

    @contextlib.contextmanager
    def reading(self, name: str):
        """Say plainly when a file a manifest listed is gone (the dataset was replaced),
        whatever error the store gives for it."""
        try:
            yield
        except DatasetReplacedError:
            raise
        except OSError as e:
            self._open.pop(name, None)
            gone = isinstance(e, FileNotFoundError)
            if not gone:
                with contextlib.suppress(OSError, ManifestError):
                    gone = self.fs.get_file_info(self.path(name, what="file")).type == (
                        pafs.FileType.NotFound
                    )
            if not gone:
                raise
            raise DatasetReplacedError(
                f"{self.display(name)!r} is gone: the dataset {self.uri!r} was replaced or deleted "
                "after it was opened; open it again to read the current version"
            ) from e

    def _refuse_special(self, name: str) -> None:
        if self.regular_size(name) is None:
            raise FileNotFoundError(errno.ENOENT, "no such file", self.display(name))

    # -- writes

    def makedirs(self) -> None:
        self.fs.create_dir(self.root, recursive=True)

    def write_shard(self, name: str, write: Callable[[str], object]):
        """Write a shard under its final-style ``name`` (which no reader trusts before a
        manifest lists it): ``write(path)`` writes a local file; locally that is the
        dataset's own file, elsewhere a spool file uploaded in one stream. Returns what
        ``write`` returns. I/O errors name the dataset and the file."""
        target = self.path(name)
        with self.writing(name):
            if self._local:
                os.makedirs(self.root, exist_ok=True)
                return write(target)
            spool_dir = tempfile.mkdtemp(prefix="pss-shard-")
            try:
                spool = os.path.join(spool_dir, name)
                result = write(spool)
                with open(spool, "rb") as src, self.fs.open_output_stream(target) as dst:
                    shutil.copyfileobj(src, dst, _CHUNK)
                return result
            finally:
                shutil.rmtree(spool_dir, ignore_errors=True)

    def put_bytes(self, name: str, data: bytes) -> None:
        """Publish a whole small file in one atomic step: a temporary name, fsync and a
        rename locally; one PUT on an object store (objects appear whole or not at all)."""
        target = self.path(name, what="file")
        with self.writing(name):
            if self._local:
                folder, _, base = target.rpartition("/")
                os.makedirs(folder, exist_ok=True)
                tmp = os.path.join(folder, f".{base}.{uuid.uuid4().hex}.tmp")
                try:
                    with open(tmp, "wb") as f:
                        f.write(data)
                        f.flush()
                        os.fsync(f.fileno())
                    os.replace(tmp, target)
                except BaseException:
                    with contextlib.suppress(OSError):
                        os.unlink(tmp)
                    raise
                return
            with self.fs.open_output_stream(target) as f:
                f.write(data)

    def write_bytes(self, name: str, data: bytes) -> None:
        """Write a whole file under a name no reader trusts until something publishes it
        (a task attempt's own): locally a plain write into its folder (made when missing;
        no temporary name, no fsync: the publication is the commit point), elsewhere one
        PUT, as ``put_bytes``."""
        target = self.path(name, what="file")
        with self.writing(name):
            if not self._local:
                with self.fs.open_output_stream(target) as f:
                    f.write(data)
                return
            os.makedirs(target.rpartition("/")[0], exist_ok=True)
            with open(target, "wb") as f:
                f.write(data)

    def copy_to(self, name: str, other: DatasetLocation, other_name: str) -> None:
        """Copy the file ``name`` to ``other_name`` of ``other``, a location on the same
        filesystem (a server-side copy on an object store)."""
        target = other.path(other_name, what="file")
        with other.writing(other_name):
            if other._local:
                os.makedirs(target.rpartition("/")[0], exist_ok=True)
            self.fs.copy_file(self.path(name, what="file"), target)

    def put_json(self, name: str, doc: object) -> None:
        self.put_bytes(name, (json.dumps(doc, indent=2, ensure_ascii=False) + "\n").encode())

    def delete(self, names: Iterable[str]) -> None:
        """Delete files and directories (recursively) by name; missing ones are fine."""
        for name in names:
            full = self.path(name, what="file")
            with contextlib.suppress(FileNotFoundError):
                info = self.fs.get_file_info(full)
                if info.type == pafs.FileType.Directory:
                    self.fs.delete_dir(full)
                elif info.type != pafs.FileType.NotFound:
                    self.fs.delete_file(full)

    def remove_if_empty(self) -> bool:
        """Remove the directory itself when nothing is under it (a failed first write
        leaves no trace); returns whether it was removed. Locally ``rmdir`` refuses a
        directory another job has just written into; on object stores only an empty
        prefix (at most a directory marker) is deleted."""
        if self._local:
            try:
                os.rmdir(self.root)
            except FileNotFoundError:
                return False
            except OSError as e:
                if e.errno in (errno.ENOTEMPTY, errno.EEXIST):
                    return False
                raise
            return True
        if self.fs.get_file_info(self.root).type == pafs.FileType.NotFound or self.list():
            return False
        with contextlib.suppress(FileNotFoundError):
            self.fs.delete_dir(self.root)
        return True

    @contextlib.contextmanager
    def writing(self, name: str):
        """Re-raise I/O errors (a full disk, a refused PUT) naming the dataset and the file."""
        try:
            yield
        except StorageError:
            raise
        except OSError as e:
            reason = e.strerror or str(e)
            raise StorageError(
                e.errno, f"writing {name!r} of dataset {self.uri!r} failed: {reason}"
            ) from e


def stream_crc32c(stream) -> str:
    """crc32c (hex) of everything a binary stream yields, read in 16 MB chunks."""
    import crc32c

    crc = 0
    while chunk := stream.read(_CHUNK):
        crc = crc32c.crc32c(chunk, crc)
    return f"{crc:08x}"


def _strip_file_scheme(text: str) -> str:
    if text.startswith("file://"):
        return text[len("file://") :] or "/"
    if text.startswith("file:"):
        return text[len("file:") :]
    return text


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "a special file"


def as_arrow_filesystem(filesystem) -> pafs.FileSystem:
    """A ``pyarrow.fs.FileSystem`` from one, or from an fsspec filesystem."""
    if isinstance(filesystem, pafs.FileSystem):
        return filesystem
    try:
        import fsspec
    except ImportError:  # pragma: no cover - fsspec ships with the torch extra
        fsspec = None
    if fsspec is not None and isinstance(filesystem, fsspec.AbstractFileSystem):
        if "file" in (
            filesystem.protocol
            if isinstance(filesystem.protocol, tuple)
            else (filesystem.protocol,)
        ):
            return pafs.LocalFileSystem()
        return pafs.PyFileSystem(pafs.FSSpecHandler(filesystem))
    raise InvalidTypeError(
        f"expected a pyarrow.fs.FileSystem or an fsspec filesystem, got {type(filesystem).__name__}"
    )
