"""Publishing a finished file or directory in one step, never losing the old one first.

Every job that produces a local output (extraction, SAE checkpoints, LUTs, conversions)
builds it under a staging name beside its final place and publishes it here. A file
replaces its predecessor atomically (``os.replace``). A directory cannot: the old one is
renamed aside first, the new one takes its name, and only then is the old one deleted, so
a crash at any point leaves either the old or the new output under a name a user can find
(``.{name}.replaced-*`` for the old one in the worst case), never neither.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


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
