"""Files and folders a command will write, checked before any work: argparse ``type``s
(``output_file``, ``output_folder``) and checks that name the flag (``writable_folder``,
``make_folder``), all judging a folder by ``unwritable_folder`` (its permissions and a file
actually made there)."""
from __future__ import annotations

import argparse
import os
import pathlib
import tempfile
from typing import Iterable

from megatron_zeppelin.errors import ConfigError


def output_file(suffixes: Iterable[str] = (), exist_ok: bool = True):
    """An argparse ``type`` for a file the command will write: refused before any work when
    its folder does not exist or cannot be written (``unwritable_folder``), it is a folder,
    it exists and ``exist_ok`` is false, or its suffix is not one of ``suffixes`` (when
    given); a link is judged by where it leads."""
    suffixes = tuple(suffixes)

    def parse(text: str) -> str:
        path = pathlib.Path(text)
        if path.is_dir():
            raise argparse.ArgumentTypeError(f"{text!r} is a folder: expected a file path")
        if path.is_symlink():  # writing follows the link: judge where it leads
            path = path.resolve()
        if path.parent.exists() and not path.parent.is_dir():
            raise argparse.ArgumentTypeError(f"{text!r}: {str(path.parent)!r} is a file, not "
                                             "a folder")
        if not path.parent.is_dir():
            raise argparse.ArgumentTypeError(f"{text!r}: folder {str(path.parent)!r} does not "
                                             "exist")
        if not exist_ok and path.exists():
            raise argparse.ArgumentTypeError(f"{text!r} exists: expected a new file")
        reason = unwritable_folder(path.parent)
        if reason:
            raise argparse.ArgumentTypeError(f"{text!r} is invalid: {reason}")
        if suffixes and path.suffix.lower() not in suffixes:
            raise argparse.ArgumentTypeError(f"{text!r} is invalid: expected a file ending in "
                                             f"one of {list(suffixes)}")
        return text

    parse.__name__ = "output file"
    return parse


def _unwritable(path: pathlib.Path) -> str | None:
    """Why folder ``path`` (made if missing) cannot be written, or None: it, or the nearest
    existing folder above it, is a file or cannot be written (``unwritable_folder``)."""
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        return f"{str(probe)!r} is a file"
    return unwritable_folder(probe)


def unwritable_folder(folder: str | os.PathLike) -> str | None:
    """Why no file can be made in the existing folder ``folder``, or None: by its
    permissions, or by making (and removing) a file there, which finds what permissions do
    not tell (a read-only or virtual file system such as /proc, or root, whom permissions do
    not stop)."""
    if not os.access(folder, os.W_OK | os.X_OK):
        return f"{str(folder)!r} is not writable"
    try:
        fd, name = tempfile.mkstemp(dir=folder, prefix=".zeppelin-write-check-")
    except OSError as exc:
        return f"{str(folder)!r} is not writable: {exc.strerror or exc}"
    os.close(fd)
    os.unlink(name)
    return None


def output_folder(text: str) -> str:
    """An argparse ``type`` for a folder the command writes into (made if missing): refused
    before any work when it, or the nearest existing folder above it, is a file or cannot be
    written."""
    reason = "empty" if not text.strip() else _unwritable(pathlib.Path(text))
    if reason:
        raise argparse.ArgumentTypeError(f"{text!r} is invalid: expected a folder ({reason})")
    return text


def writable_file(path: str) -> bool:
    """Whether the command can write the file ``path``: its folder exists and takes files
    (``unwritable_folder``), and ``path`` is not a folder."""
    folder = os.path.dirname(os.path.abspath(path))
    return os.path.isdir(folder) and not unwritable_folder(folder) and not os.path.isdir(path)


def writable_folder(flag: str, text: str, file: str | None = None) -> pathlib.Path:
    """``text`` as a folder the command will make (if missing) and write into (``file``: the
    flag's value is that file of the folder), checked now without making anything:
    ``ConfigError`` naming ``flag`` when it cannot be (``_unwritable``)."""
    reason = "empty" if not text.strip() else _unwritable(pathlib.Path(text))
    if reason is None:
        return pathlib.Path(text)
    expected = "a folder" if file is None else "a file in a folder that can be written"
    raise ConfigError(f"{flag}={file or text!r} is invalid: expected {expected} ({reason})")


def make_folder(flag: str, path: pathlib.Path) -> pathlib.Path:
    """Make ``path`` (and its parents) if missing; ``ConfigError`` naming ``flag`` if not."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"{flag}: cannot make the folder {str(path)!r}: "
                          f"{exc.strerror or exc}") from None
    return path
