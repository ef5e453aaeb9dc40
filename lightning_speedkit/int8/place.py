"""An INT8 export as one unit: staged in a hidden directory, switched into place with one rename.

The files keep the names users open (``model.onnx``, ``model.fp32.onnx``, ``model.json``; a ``.data`` sidecar only
past 1.5 GB of weights), but each is a relative symbolic link through one pointer to the directory holding the export:

    model.onnx          -> .model.onnx.export/model.onnx    (likewise for every file of the export)
    .model.onnx.export  -> .model.onnx.v-<id>               the pointer: replaced by a rename(2), atomic
    .model.onnx.v-<id>/                                     a complete export, never changed once in place
    .model.onnx.tmp-<id>/                                   an export in progress, locked by its process

Why not a manifest beside plain files: with ``overwrite=True`` the new files would replace the old ones name by
name, so for a while neither export would be whole. With the pointer a reader sees the old export or the new one,
never a mix: while the pointer names the old directory every name resolves into it, and one rename makes every name
resolve into the new one. The pointer only ever names a directory whose files were all written and flushed to disk,
the report (``model.json``) last; the report lists every file with its size and SHA-256 (``manifest``), so a reader
who copied an export elsewhere can check it too. A reader that must not see a switch between opening two files opens
them through the resolved directory (``Path("model.json").resolve().parent``), which never changes once in place.
ONNX refuses external data reached through a symbolic link: a model with a sidecar is loaded by ``onnx`` from its
resolved path (ONNX Runtime takes either).

A run killed before its switch leaves its ``.tmp-`` (or a not yet current ``.v-``) directory behind; the next export
to the same place removes it unless a live process holds its lock (``flock``, released by the kernel when the process
dies). Where symbolic links cannot be made (Windows without the privilege) the files are moved into place one by
one instead, each atomic, the report last: not atomic as a set.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

__all__ = [
    "can_link",
    "clean_stale",
    "export_exists",
    "export_paths",
    "pointer_of",
    "sha256_of",
    "staging",
    "switch_into_place",
    "version_dir_of",
]


def export_paths(path: str | os.PathLike[str]) -> dict[str, Path]:
    """The files an export to ``path`` may have, sidecars before the models that use them, the report last.

    Example:
        >>> [p.name for p in export_paths("out/model.onnx").values()]
        ['model.fp32.onnx.data', 'model.fp32.onnx', 'model.onnx.data', 'model.onnx', 'model.json']
    """
    if not isinstance(path, (str, os.PathLike)) or not str(path).endswith(".onnx") or Path(path).name == ".onnx":
        raise ValueError(f"`path` must be a path to a file ending in '.onnx', got {path!r}.")
    int8 = Path(path)
    fp32 = int8.with_name(f"{int8.stem}.fp32.onnx")
    return {
        "fp32_data": fp32.with_name(fp32.name + ".data"),
        "fp32": fp32,
        "int8_data": int8.with_name(int8.name + ".data"),
        "int8": int8,
        "report": int8.with_suffix(".json"),
    }


def sha256_of(path: Path) -> str:
    """The SHA-256 of a file, in hex (read in 1 MiB blocks)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def pointer_of(path: Path) -> Path:
    """The symbolic link that names the directory holding the export at ``path``.

    Example:
        >>> pointer_of(Path("out/model.onnx")).name
        '.model.onnx.export'
    """
    return path.with_name(f".{path.name}.export")


def version_dir_of(path: Path, staged: Path) -> Path:
    """The ``.v-`` directory that the staging directory ``staged`` becomes when it is switched in.

    Example:
        >>> version_dir_of(Path("out/model.onnx"), Path("out/.model.onnx.tmp-ab12")).name
        '.model.onnx.v-ab12'
    """
    return path.with_name(f".{path.name}.v-{_tag(staged.name)}")


def export_exists(path: Path) -> bool:
    """Whether an export (or any file in its place) is at ``path``: a file name or its pointer exists, even dangling."""
    return any(os.path.lexists(p) for p in [*export_paths(path).values(), pointer_of(path)])


def can_link(directory: Path) -> bool:
    """Whether relative symbolic links can be made in ``directory`` (not on Windows without the privilege)."""
    probe = directory / f".speedkit-link-probe-{uuid.uuid4().hex[:8]}"
    try:
        os.symlink("target", probe)
    except (OSError, NotImplementedError):
        return False
    probe.unlink()
    return True


def _lock(fd: int, block: bool) -> bool:
    """Take an exclusive ``flock`` on ``fd``; False if another process holds it (never without ``block``)."""
    try:
        import fcntl
    except ImportError:  # Windows: no flock; a concurrent export to the same place is not protected there
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if block else fcntl.LOCK_NB))
    except BlockingIOError:
        return False
    return True


def _tag(name: str) -> str:
    """The id a staging directory, its ``.v-`` directory and its temporary links share (after the last ``-``)."""
    return name.rsplit("-", 1)[-1]


def clean_stale(path: Path) -> list[str]:
    """Remove what killed exports to ``path`` left: unlocked ``.tmp-``/``.v-`` directories and ``.link-`` links.

    A directory stays if the pointer names it or a live process holds its lock; so do that process's links.

    Returns:
        The names removed.
    """
    pointer = pointer_of(path)
    current = os.path.basename(os.readlink(pointer)) if pointer.is_symlink() else None
    removed, live = [], set()
    for prefix in (f".{path.name}.tmp-", f".{path.name}.v-"):
        for candidate in path.parent.glob(glob.escape(prefix) + "*"):
            if candidate.name == current or candidate.is_symlink() or not candidate.is_dir():
                continue
            try:
                fd = os.open(candidate, os.O_RDONLY)
            except OSError:  # gone meanwhile
                continue
            try:
                if _lock(fd, block=False):  # no live process holds it: its owner was killed
                    shutil.rmtree(candidate, ignore_errors=True)
                    removed.append(candidate.name)
                else:
                    live.add(_tag(candidate.name))
            finally:
                os.close(fd)
    for name in [*export_paths(path).values(), pointer]:
        for link in path.parent.glob(glob.escape(f".{name.name}.link-") + "*"):
            if link.is_symlink() and _tag(link.name) not in live:
                link.unlink(missing_ok=True)
                removed.append(link.name)
    return removed


def _new_locked_directory(path: Path) -> tuple[Path, int]:
    """A new ``.<name>.tmp-<id>`` directory beside ``path`` and an open descriptor holding its lock."""
    for _ in range(3):
        directory = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
        try:
            fd = os.open(directory, os.O_RDONLY)
        except FileNotFoundError:  # another export's clean-up took it before it was locked
            continue
        _lock(fd, block=True)
        with contextlib.suppress(FileNotFoundError):
            if os.stat(directory).st_ino == os.fstat(fd).st_ino:
                return directory, fd
        os.close(fd)
    raise OSError(f"INT8 export: cannot create a staging directory beside {path}")  # pragma: no cover


@contextlib.contextmanager
def staging(path: Path) -> Iterator[Path]:
    """A new hidden directory beside ``path``, locked by this process, removed on leaving unless it was switched in.

    The lock (``flock`` on the directory, released when the process ends, even by SIGKILL) tells `clean_stale` in
    another process that this export is alive.
    """
    directory, fd = _new_locked_directory(path)
    try:
        yield directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)  # already gone if it was switched in (renamed)
        os.close(fd)  # releases the lock


def _umask() -> int:
    """The process's umask (read by setting it and putting it back)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _fsync(path: Path) -> None:
    """Flush a file or a directory to disk (directories only where the OS allows opening them)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some file systems refuse fsync on a directory
        pass
    finally:
        os.close(fd)


def _replace_with_link(name: Path, target: str, tag: str) -> None:
    """Make ``name`` a symbolic link to ``target`` in one rename (whatever ``name`` was); ``tag``: the export's id."""
    if name.is_symlink() and os.readlink(name) == target:
        return
    tmp = name.with_name(f".{name.name}.link-{tag}")
    tmp.unlink(missing_ok=True)
    os.symlink(target, tmp)
    os.replace(tmp, name)


def _adopt_plain_files(path: Path, names: list[Path], tag: str) -> None:
    """Put an export written as plain files (by an older version) behind a pointer, without changing what it reads.

    Its files are hard-linked (or copied) into a locked ``.v-`` directory, the pointer made, then each name replaced
    by a link that resolves to the same content: killed at any point, the old export still reads the same.
    """
    plain = [p for p in names if p.is_file() and not p.is_symlink()]
    if not plain or os.path.lexists(pointer_of(path)):
        return
    version = path.with_name(f".{path.name}.v-{tag}0")
    version.mkdir()
    fd = os.open(version, os.O_RDONLY)
    try:
        _lock(fd, block=True)  # until the pointer names it, another export's clean-up must leave it alone
        for file in plain:
            try:
                os.link(file, version / file.name)
            except OSError:
                shutil.copy2(file, version / file.name)
        _fsync(version)
        _replace_with_link(pointer_of(path), version.name, tag)
    finally:
        os.close(fd)
    for file in plain:
        _replace_with_link(file, f"{pointer_of(path).name}/{file.name}", tag)


def switch_into_place(staged: Path, path: Path, links: bool = True) -> None:
    """Make the export in ``staged`` (named as `export_paths` of ``path``) the export at ``path``, in one step.

    Flushes the files, renames ``staged`` to a ``.v-`` directory, links every name through the pointer and renames
    a new pointer over the old one; then drops links to files the new export lacks and the previous directory.
    Files of an export written as plain files before are adopted first (`_adopt_plain_files`). With ``links``
    False (no symbolic links here), the files are moved into place one by one instead.
    """
    names = list(export_paths(path).values())
    for file in staged.iterdir():
        _fsync(file)
    os.chmod(staged, 0o777 & ~_umask())  # mkdtemp's 0700 would hide the export from other users
    _fsync(staged)
    if not links:
        _move_files(staged, names)
        return
    pointer, tag = pointer_of(path), _tag(staged.name)
    version = version_dir_of(path, staged)
    os.rename(staged, version)
    _adopt_plain_files(path, names, tag)
    previous = os.readlink(pointer) if pointer.is_symlink() else None
    for name in names:
        if (version / name.name).is_file():
            _replace_with_link(name, f"{pointer.name}/{name.name}", tag)
    _replace_with_link(pointer, version.name, tag)  # the switch
    _fsync(path.parent)
    for name in names:
        if name.is_symlink() and os.readlink(name) == f"{pointer.name}/{name.name}" and not name.exists():
            name.unlink()
    if previous and previous != version.name and "/" not in previous:
        shutil.rmtree(path.parent / previous, ignore_errors=True)


def _move_files(staged: Path, names: list[Path]) -> None:
    """Without symbolic links: each file moved into place (sidecars first, the report last), then old extras removed."""
    new = [name for name in names if (staged / name.name).is_file()]
    for name in new:
        os.replace(staged / name.name, name)
    for name in names:
        if name not in new and name.is_file():
            name.unlink()
