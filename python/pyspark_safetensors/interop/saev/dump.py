"""Read, write and verify saev dumps on local disk.

Reading maps every shard with ``np.memmap`` (read-only, no copy). saev's own writer pads
the last shard with zeros to the full shard shape, while protocol §5 allows a shorter
last shard: both are read, and padding is never data (only ``n_imgs`` images are).
Writing streams images into shards padded like saev's, under a staging name, writes
``metadata.json`` last and publishes the hash directory whole.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import warnings
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from ...dataset.publish import publish, staging_path
from .protocol import (
    METADATA,
    SHARDS_JSON,
    DumpError,
    Metadata,
    View,
    metadata_hash,
    new_metadata,
    parse_metadata,
    shard_file,
)

_SHARD_FILE = re.compile(r"^acts(\d{6,})\.bin$")


def find_dump(path: str | os.PathLike) -> Path:
    """The hash directory: ``path`` itself when it holds ``metadata.json``, else the one
    hash directory inside the ``dump_to`` directory ``path``."""
    path = Path(path)
    if (path / METADATA).is_file():
        return path
    if not path.is_dir():
        raise DumpError(f"{path}: no such directory")
    found = sorted(
        child
        for child in path.iterdir()
        if child.is_dir() and not child.name.startswith(".") and (child / METADATA).is_file()
    )
    if not found:
        raise DumpError(f"{path}: no {METADATA}; give a saev hash directory or its dump_to")
    if len(found) > 1:
        names = ", ".join(c.name for c in found)
        raise DumpError(
            f"{path} holds {len(found)} saev dumps ({names}); give the hash directory of one"
        )
    return found[0]


def read_metadata(dump_dir: Path) -> Metadata:
    path = dump_dir / METADATA
    try:
        doc = json.loads(path.read_bytes())
    except FileNotFoundError:
        raise DumpError(f"{path}: missing") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DumpError(f"{path}: not valid JSON ({e})") from None
    return parse_metadata(doc, str(path))


def hash_matches(meta: Metadata, name: str) -> bool:
    """Whether ``name`` is the metadata's hash (the seed's rule or saev's compact one)."""
    return name in (metadata_hash(meta.doc), metadata_hash(meta.doc, compact=True))


def layer_order_note(meta: Metadata) -> str | None:
    """saev stored the layer axis in hook execution order, which is ``layers``' order
    only when the list ascends within one sign; otherwise the axis may be permuted."""
    layers = meta.layers
    same_sign = all(x >= 0 for x in layers) or all(x < 0 for x in layers)
    if same_sign and list(layers) == sorted(layers):
        return None
    return (
        f"layers {list(layers)} are not in execution order: saev's writer stored the layer axis "
        "in the order the hooks ran, so rows may belong to another layer than the list says"
    )


def check_shards(dump_dir: Path, meta: Metadata) -> tuple[list[int], list[str], list[str]]:
    """Images stored in each data shard file (the full S when padded), the problems found
    (all of them), and notes (a trailing all-padding shard)."""
    full = meta.n_imgs_per_shard * meta.img_nbytes
    stored, problems, notes, missing = [], [], [], []
    for s in range(meta.n_shards):
        path = dump_dir / shard_file(s)
        if not path.is_file():
            missing.append(path.name)
            continue
        size = path.stat().st_size
        exact = meta.imgs_in_shard(s) * meta.img_nbytes
        if size == full:
            stored.append(meta.n_imgs_per_shard)
        elif size == exact:
            stored.append(meta.imgs_in_shard(s))
        else:
            shape = [meta.imgs_in_shard(s), *meta.shard_shape[1:]]
            problems.append(
                f"{path.name} has {size:,} bytes; expected {full:,} (shard shape "
                f"{list(meta.shard_shape)} float32)"
                + (f" or {exact:,} (its {shape} float32 of data)" if exact != full else "")
            )
    if missing:
        problems.insert(
            0, f"missing shard(s) {', '.join(missing)} of {meta.n_shards} for {meta.n_imgs} images"
        )
    for child in sorted(dump_dir.iterdir()):
        m = _SHARD_FILE.match(child.name)
        if not m or int(m.group(1)) < meta.n_shards:
            continue
        if int(m.group(1)) == meta.n_shards and child.stat().st_size == full:
            # saev's writer opens one more shard when n_imgs fills the last one exactly
            notes.append(f"{child.name} holds only padding (ignored)")
        else:
            problems.append(f"{child.name}: unexpected shard beyond the {meta.n_shards} needed")
    shards_json = dump_dir / SHARDS_JSON
    if shards_json.is_file():
        problems += _check_shards_json(shards_json, meta)
    return stored, problems, notes


def _check_shards_json(path: Path, meta: Metadata) -> list[str]:
    """saev protocol 1.x lists each shard's image count: it must agree with ours."""
    try:
        entries = json.loads(path.read_bytes())
        counts = {e["name"]: e["n_imgs"] for e in entries}
    except (ValueError, TypeError, KeyError) as e:
        return [f"{path.name}: not a list of {{name, n_imgs}} objects ({e})"]
    want = {shard_file(s): meta.imgs_in_shard(s) for s in range(meta.n_shards)}
    wrong = {k: v for k, v in counts.items() if want.get(k) != v and v != 0}
    if wrong:
        return [f"{path.name}: image counts {wrong} disagree with metadata.json ({want})"]
    return []


class SaevDump:
    """A saev dump opened for reading: ``meta`` (the parsed ``metadata.json``), each
    shard's data as a read-only memmap ``[n, L, T, D]``, and views (protocol §5).

        dump = SaevDump("shards/ab12...")        # or its dump_to directory
        dump.vector(img=3, layer=-2, token=0)    # one activation [d_vit]
        view = dump.view("image", layer=-2)      # len(view) == n_imgs * P
    """

    def __init__(self, path: str | os.PathLike):
        self.path = find_dump(path)
        self.meta = read_metadata(self.path)
        self.stored, problems, _ = check_shards(self.path, self.meta)
        if problems:
            raise DumpError(f"{self.path}: " + "; ".join(problems))
        self._maps: dict[int, np.memmap] = {}
        self._pid = os.getpid()

    def __getstate__(self):
        return {"path": self.path, "meta": self.meta, "stored": self.stored}

    def __setstate__(self, state):
        self.__dict__.update(state, _maps={}, _pid=os.getpid())

    @property
    def hash_ok(self) -> bool:
        return hash_matches(self.meta, self.path.name)

    def shard(self, s: int) -> np.ndarray:
        """The data of shard ``s``: a read-only memmap ``[imgs_in_shard(s), L, T, D]``
        (padding cut off)."""
        if self._pid != os.getpid():  # a forked worker maps its own
            self._maps, self._pid = {}, os.getpid()
        arr = self._maps.get(s)
        if arr is None:
            if not 0 <= s < self.meta.n_shards:
                raise IndexError(f"shard {s} out of range 0..{self.meta.n_shards - 1}")
            shape = (self.stored[s], *self.meta.shard_shape[1:])
            arr = self._maps[s] = np.memmap(
                self.path / shard_file(s), dtype="<f4", mode="r", shape=shape
            )
        return arr[: self.meta.imgs_in_shard(s)]

    def images(self, start: int, stop: int) -> np.ndarray:
        """Images ``start:stop`` as one array ``[n, L, T, D]`` (a view when they share a
        shard, else a copy)."""
        S = self.meta.n_imgs_per_shard
        if not 0 <= start <= stop <= self.meta.n_imgs:
            raise IndexError(f"images {start}:{stop} outside 0:{self.meta.n_imgs}")
        pieces = []
        while start < stop:
            s, first = divmod(start, S)
            take = min(stop - start, S - first)
            pieces.append(self.shard(s)[first : first + take])
            start += take
        if len(pieces) == 1:
            return pieces[0]
        if not pieces:
            return np.empty((0, *self.meta.shard_shape[1:]), "<f4")
        return np.concatenate(pieces)

    def vector(self, img: int, layer: int, token: int) -> np.ndarray:
        """One activation ``[d_vit]`` by logical coordinate (protocol §5.2)."""
        if not 0 <= img < self.meta.n_imgs:
            raise IndexError(f"image {img} outside 0..{self.meta.n_imgs - 1}")
        if not 0 <= token < self.meta.n_tokens_per_img:
            raise IndexError(f"token {token} outside 0..{self.meta.n_tokens_per_img - 1}")
        s, i = divmod(img, self.meta.n_imgs_per_shard)
        return self.shard(s)[i, self.meta.layer_index(layer), token]

    def view(self, patches="image", layer="all") -> View:
        return View(self.meta, patches, layer)

    def gather(self, img: np.ndarray, layer_pos: np.ndarray, token: np.ndarray) -> np.ndarray:
        """Activations ``[n, D]`` at (image, layer position, token position) triples."""
        out = np.empty((len(img), self.meta.d_vit), np.float32)
        shard, in_shard = np.divmod(img, self.meta.n_imgs_per_shard)
        for s in np.unique(shard):
            sel = np.flatnonzero(shard == s)
            out[sel] = self.shard(int(s))[in_shard[sel], layer_pos[sel], token[sel]]
        return out


def verify_dump(path: str | os.PathLike) -> str:
    """Check a dump: ``metadata.json`` keys and types, the directory name against the
    hash (a warning when they differ), every shard's byte length (all missing shards
    reported at once). Raises ``DumpError`` naming the files or keys at fault; returns a
    one-line summary."""
    dump_dir = find_dump(path)
    meta = read_metadata(dump_dir)
    _, problems, notes = check_shards(dump_dir, meta)
    if problems:
        raise DumpError(f"{dump_dir}: " + "; ".join(problems))
    if not hash_matches(meta, dump_dir.name):
        note = f"directory name {dump_dir.name!r} is not the metadata hash {meta.hash}"
        warnings.warn(f"{dump_dir}: {note}", stacklevel=2)
        notes.append(note)
    order = layer_order_note(meta)
    if order:
        warnings.warn(f"{dump_dir}: {order}", stacklevel=2)
        notes.append(order)
    return (
        f"{dump_dir}: saev dump, {meta.n_imgs:,} images x {meta.n_layers} layer(s) x "
        f"{meta.n_tokens_per_img} tokens x {meta.d_vit} in {meta.n_shards} shard(s) of "
        f"{meta.n_imgs_per_shard} images" + ("; " + "; ".join(notes) if notes else "; whole")
    )


@contextmanager
def staged_dump(dump_to: str | os.PathLike, name: str, *, overwrite: bool = False):
    """Build ``dump_to/name`` under a staging name and publish it whole; on failure remove
    the staging directory (and ``dump_to`` itself when this call created it)."""
    dump_to = Path(dump_to)
    final = dump_to / name
    if final.exists() and not overwrite:
        raise DumpError(f"{final} already holds a dump with this metadata; remove it first")
    created = not dump_to.exists()
    dump_to.mkdir(parents=True, exist_ok=True)
    tmp = staging_path(final)
    tmp.mkdir()
    try:
        yield tmp
        publish(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if created:
            shutil.rmtree(dump_to, ignore_errors=True)
        raise


def write_metadata(dump_dir: Path, text: str) -> None:
    """``metadata.json`` written and synced (the last file of a dump)."""
    with open(dump_dir / METADATA, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def metadata_text(meta: Metadata) -> str:
    """``metadata.json`` as saev writes it: ``json.dump(..., indent=4)``."""
    return json.dumps(meta.doc, indent=4)


def pad_shard(path: Path, meta: Metadata) -> None:
    """Extend a shard file with zeros to the full shard shape (as saev's writer leaves
    every shard), and sync it."""
    with open(path, "r+b") as f:
        f.truncate(meta.n_imgs_per_shard * meta.img_nbytes)
        f.flush()
        os.fsync(f.fileno())


class DumpWriter:
    """Stream images into a new dump at ``dump_to/<HASH>/``; memory stays that of one
    ``write`` call.

        meta = new_metadata(vit_family="clip", vit_ckpt="ViT-B-16/openai", layers=[-2],
                            n_patches_per_img=196, cls_token=True, d_vit=768, seed=42,
                            n_imgs=len(images), data={"type": "ImageFolder", "root": "imgs"})
        with DumpWriter("shards", meta) as w:
            for batch in batches:
                w.write(acts)                    # [n, L, T, D]
        w.path                                   # shards/<HASH>

    Shards are padded with zeros to the full shard shape like saev's writer, so saev's own
    readers open them; ``metadata.json`` is written last, and the hash directory appears
    only when every image was written.
    """

    def __init__(self, dump_to: str | os.PathLike, meta: Metadata, *, overwrite: bool = False):
        self.meta = meta
        self.path = Path(dump_to) / meta.hash
        self._stage = staged_dump(dump_to, meta.hash, overwrite=overwrite)
        self._tmp: Path | None = None
        self._file = None
        self.written = 0

    def __enter__(self) -> DumpWriter:
        self._tmp = self._stage.__enter__()
        return self

    def write(self, acts) -> None:
        """Append images ``[n, L, T, D]`` (numpy or anything ``np.asarray`` takes; cast
        to float32)."""
        meta = self.meta
        acts = np.asarray(acts)
        if acts.ndim != 4 or acts.shape[1:] != meta.shard_shape[1:]:
            raise DumpError(
                f"images of shape {list(acts.shape)}; this dump takes [n, {meta.n_layers}, "
                f"{meta.n_tokens_per_img}, {meta.d_vit}] (n, layers, tokens, d_vit)"
            )
        if self.written + len(acts) > meta.n_imgs:
            raise DumpError(f"more than n_imgs={meta.n_imgs} images written")
        acts = acts.astype("<f4", copy=False)
        S, done = meta.n_imgs_per_shard, 0
        while done < len(acts):
            shard, first = divmod(self.written, S)
            if first == 0:
                self._next_shard(shard)
            take = min(len(acts) - done, S - first)
            self._file.write(memoryview(np.ascontiguousarray(acts[done : done + take])).cast("B"))
            done += take
            self.written += take

    def _next_shard(self, shard: int) -> None:
        self._close_shard()
        self._file = open(self._tmp / shard_file(shard), "wb")  # noqa: SIM115 (spans write calls)

    def _close_shard(self) -> None:
        if self._file is not None:
            self._file.close()
            pad_shard(Path(self._file.name), self.meta)
            self._file = None

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if exc_type is None:
                if self.written != self.meta.n_imgs:
                    raise DumpError(
                        f"{self.written} images written; metadata.json says n_imgs={self.meta.n_imgs}"
                    )
                self._close_shard()
                write_metadata(self._tmp, metadata_text(self.meta))
        except BaseException as e:
            if self._file is not None:
                self._file.close()
            self._stage.__exit__(type(e), e, e.__traceback__)
            raise
        if self._file is not None:
            self._file.close()
        self._stage.__exit__(exc_type, exc, tb)


def write_dump(
    dump_to: str | os.PathLike, acts: np.ndarray, *, overwrite: bool = False, **metadata
) -> Path:
    """Write all images ``acts [n_imgs, L, T, D]`` as a dump; ``metadata`` are
    ``new_metadata``'s keywords (``n_imgs`` and ``d_vit`` taken from ``acts``)."""
    meta = new_metadata(n_imgs=len(acts), d_vit=acts.shape[-1], **metadata)
    with DumpWriter(dump_to, meta, overwrite=overwrite) as w:
        w.write(acts)
    return w.path
