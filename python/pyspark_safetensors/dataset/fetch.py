"""Local copies of remote files and directories, for libraries that open local paths only
(transformers' ``from_pretrained``, ``safetensors``' ``safe_open``, ``open``).

``local_copy("s3://bucket/models/llama", cache_dir=...)`` downloads the directory (or one
file) through ``DatasetLocation`` into ``cache_dir`` once per version and returns the
local path; a local path or ``file:`` URI is returned as the path it names, untouched. A
version is the listing's names, sizes and modification times: an object replaced in the
store is downloaded again, an unchanged one never. The copy is made under a temporary
name and renamed into place, so processes sharing ``cache_dir`` (a Spark executor's
Python workers) never see a partial one; the one that loses the race drops its copy.
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
import shutil
import uuid
from collections.abc import Mapping

import pyarrow.fs as pafs

from .errors import StorageError
from .location import DatasetLocation

_CHUNK = 16 << 20


def local_copy(
    path: str | os.PathLike | DatasetLocation,
    *,
    cache_dir: str | os.PathLike,
    storage_options: Mapping[str, str] | None = None,
) -> str:
    """The local path of ``path`` (a file or a directory): itself when local, else a copy
    in ``cache_dir`` (module docstring). A missing remote path is a ``StorageError``."""
    location = DatasetLocation.of(path, storage_options=storage_options)
    if location.is_local:
        return location.root
    info = location.fs.get_file_info(location.root)
    if info.type == pafs.FileType.File:
        folder, name = location.parent()
        files = {name: info}
    else:
        folder, name = location, ""
        files = {n: i for n, i in location.list(recursive=True).items()
                 if i.type == pafs.FileType.File}  # fmt: skip
    if not files:
        raise StorageError(errno.ENOENT, f"no such file or directory: {location.uri!r}")
    version = hashlib.sha256(location.uri.encode())
    for n in sorted(files):
        version.update(f"\0{n}\0{files[n].size}\0{files[n].mtime_ns}".encode())
    label = re.sub(r"[^A-Za-z0-9._-]", "_", location.root.rstrip("/").rpartition("/")[2])[-64:]
    dest = os.path.join(os.fspath(cache_dir), f"{label}-{version.hexdigest()[:20]}")
    if not os.path.isdir(dest):
        _download(folder, files, dest)
    return os.path.join(dest, name) if name else dest


def _download(folder: DatasetLocation, files: Mapping[str, pafs.FileInfo], dest: str) -> None:
    parent, base = os.path.split(dest)
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".{base}.{uuid.uuid4().hex[:12]}.tmp")
    try:
        for name in files:
            target = os.path.join(tmp, *name.split("/"))
            os.makedirs(os.path.dirname(target), exist_ok=True)
            source = folder.path(name, what="file")
            with folder.fs.open_input_stream(source) as src, open(target, "wb") as out:
                shutil.copyfileobj(src, out, _CHUNK)
        try:
            os.rename(tmp, dest)
        except OSError as e:  # another process put the same version first: keep its copy
            if e.errno not in (errno.ENOTEMPTY, errno.EEXIST) or not os.path.isdir(dest):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
