"""Datasets on remote filesystems: one listing for the sizes, ranged reads for the bytes.

``pyarrow.fs`` reaches ``s3://``, ``gs://``, ``hdfs://`` and ``abfs://`` natively; any
other protocol fsspec knows (``memory://``, ``az://``, ``http://``, ...) goes through
fsspec behind ``pyarrow.fs.PyFileSystem``. Local paths never come here: they are
memory-mapped instead.
"""

from __future__ import annotations

import os
import posixpath
import re

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from ..format import SafetensorsFormatError
from ..format.header import Header, decode_header, read_header_length
from .index import INDEX_SCHEMA
from .layout import INDEX, MANIFEST, local_path
from .manifest import Manifest, parse_manifest
from .verify import stream_crc32c, verify_shards

_URI = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]+://")


def is_remote(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a URI of a non-local filesystem (``file:`` URIs are local)."""
    text = os.fspath(path)
    return bool(_URI.match(text)) and not text.startswith("file:")


def as_arrow_filesystem(filesystem) -> pafs.FileSystem:
    """A ``pyarrow.fs.FileSystem`` from one, or from an fsspec filesystem."""
    if isinstance(filesystem, pafs.FileSystem):
        return filesystem
    try:
        import fsspec
    except ImportError:  # pragma: no cover - fsspec ships with the torch extra
        fsspec = None
    if fsspec is not None and isinstance(filesystem, fsspec.AbstractFileSystem):
        return pafs.PyFileSystem(pafs.FSSpecHandler(filesystem))
    raise TypeError(
        f"expected a pyarrow.fs.FileSystem or an fsspec filesystem, got {type(filesystem).__name__}"
    )


class RemoteDir:
    """A dataset directory on a (pyarrow) filesystem: listing, whole and ranged reads.

    Picklable (DataLoader workers, spawn included) when its filesystem is; open files are
    per process and reopened after a fork.
    """

    def __init__(self, filesystem, root: str, uri: str | None = None):
        self.fs = as_arrow_filesystem(filesystem)
        self.root = root.rstrip("/")
        self.uri = uri or self.root
        self._pid, self._files = os.getpid(), {}

    @classmethod
    def open(cls, path: str | os.PathLike, filesystem=None) -> RemoteDir:
        """From a URI (pyarrow's filesystems first, then fsspec's), or from a path on
        ``filesystem`` (a pyarrow or fsspec filesystem)."""
        text = os.fspath(path)
        if filesystem is not None:
            return cls(filesystem, text, text)
        try:
            fs, root = pafs.FileSystem.from_uri(text)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError, ValueError):
            import fsspec

            fs, root = fsspec.core.url_to_fs(text)
        return cls(fs, root, text)

    def __str__(self) -> str:
        return self.uri

    def __getstate__(self):
        return {"fs": self.fs, "root": self.root, "uri": self.uri}

    def __setstate__(self, state):
        self.__init__(state["fs"], state["root"], state["uri"])

    def path(self, name: str, *, what: str = "shard path") -> str:
        """The full path of ``name``, refusing absolute names and any ``..``."""
        if not name or name.startswith("/") or "\\" in name or ".." in name.split("/"):
            raise ValueError(
                f"{what} {name!r} in {self.uri!r} must be a relative name inside the dataset"
            )
        return posixpath.join(self.root, name)

    def sizes(self) -> dict[str, int]:
        """Every file under the directory with its size, from one listing."""
        infos = self.fs.get_file_info(
            pafs.FileSelector(self.root, recursive=True, allow_not_found=True)
        )
        prefix = self.root + "/"
        return {
            i.path[len(prefix) :] if i.path.startswith(prefix) else i.path: i.size
            for i in infos
            if i.type == pafs.FileType.File
        }

    def read_bytes(self, name: str) -> bytes:
        with self.fs.open_input_stream(self.path(name, what="file")) as f:
            return f.read()

    def _file(self, name: str):
        if self._pid != os.getpid():
            self._pid, self._files = os.getpid(), {}
        f = self._files.get(name)
        if f is None:
            f = self._files[name] = self.fs.open_input_file(self.path(name))
        return f

    def read_range(self, name: str, begin: int, end: int):
        """Bytes ``[begin, end)`` of ``name`` (a buffer or bytes): one ranged read."""
        data = self._file(name).read_at(end - begin, begin)
        if len(data) != end - begin:
            raise SafetensorsFormatError(
                f"byte range [{begin}, {end}) reaches past the end of the file",
                path=self.path(name),
            )
        return data

    def read_header(self, name: str, size: int) -> Header:
        """A shard's validated header: two small ranged reads."""
        prefix = bytes(self.read_range(name, 0, min(8, size)))
        n = read_header_length(prefix, size, self.path(name))
        return decode_header(prefix + bytes(self.read_range(name, 8, 8 + n)), size, self.path(name))

    def load_manifest(self) -> Manifest:
        manifest = parse_manifest(
            lambda: self.read_bytes(MANIFEST), self.uri, posixpath.join(self.uri, MANIFEST)
        )
        for shard in manifest.shards:
            self.path(shard.shard_path)  # refuse escaping names at load time
        return manifest

    def verify(self, *, checksums: bool = False) -> Manifest:
        """The manifest, checked against the files as ``verify_dataset`` does locally
        (sizes from one listing, headers from ranged reads, crc32c streamed)."""
        manifest = self.load_manifest()
        sizes = self.sizes()

        def crc(entry) -> str:
            with self.fs.open_input_stream(self.path(entry.shard_path)) as f:
                return stream_crc32c(f)

        return verify_shards(
            manifest,
            self.uri,
            lambda e: sizes.get(e.shard_path),
            lambda e: self.read_header(e.shard_path, e.bytes),
            crc,
            checksums=checksums,
        )

    def read_index(self) -> pa.Table:
        return pq.read_table(self.path(INDEX, what="file"), filesystem=self.fs, schema=INDEX_SCHEMA)


def open_location(path: str | os.PathLike, filesystem=None):
    """A local ``Path`` (memory-mapped later) or a ``RemoteDir``."""
    if filesystem is None and not is_remote(path):
        return local_path(path)
    return RemoteDir.open(path, filesystem)
