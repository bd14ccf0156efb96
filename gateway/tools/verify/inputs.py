"""What ``verify`` checks before Spark starts: the pipeline extra, Java, the capture files.

Everything here runs without pyspark or a JVM, so a missing package, a
missing Java or a directory of foreign files is one line naming the cause
within seconds, not a traceback after Spark started.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from urllib.parse import urlparse

from gateway.tools.capture.segments import MAX_METADATA_BYTES, SUFFIX, SegmentError, decode_header

PIPELINE_MODULES = ("pyspark", "pyarrow", "pandas")
INSTALL_HINT = "pip install 'tap-upr-gateway[pipeline]'"
_HEADER_READ = 14 + MAX_METADATA_BYTES


class InputError(Exception):
    """A capture path, package or tool that ``verify`` cannot run without; one line."""


def check_pipeline() -> None:
    """The pipeline extra's packages are importable (nothing is imported here)."""
    missing = [name for name in PIPELINE_MODULES if importlib.util.find_spec(name) is None]
    if missing:
        raise InputError(
            f"needs the pipeline extra ({', '.join(missing)} not installed): "
            f"{INSTALL_HINT}; Spark also needs Java 17 or newer"
        )


def check_java() -> None:
    """A ``java`` for Spark's JVM: in ``JAVA_HOME`` or on PATH."""
    home = os.environ.get("JAVA_HOME")
    if home:
        if not os.access(os.path.join(home, "bin", "java"), os.X_OK):
            raise InputError(f"JAVA_HOME={home} has no bin/java; Spark needs Java 17 or newer")
        return
    if shutil.which("java") is None:
        raise InputError("no java on PATH and no JAVA_HOME; Spark needs Java 17 or newer")


def is_local(path: str) -> bool:
    scheme = urlparse(path).scheme
    return scheme in ("", "file") or len(scheme) == 1  # a Windows drive letter


def local_path(path: str) -> str:
    return urlparse(path).path if path.startswith("file:") else path


def list_segment_files(path: str) -> list[str]:
    """Segment files under ``path`` (a file or directory, local or URI), sorted."""
    if is_local(path):
        root = local_path(path)
        if os.path.isfile(root):
            return [root]
        if not os.path.isdir(root):
            raise FileNotFoundError(f"no such capture directory: {path}")
        found = [
            os.path.join(folder, name)
            for folder, _, names in os.walk(root)
            for name in names
            if name.endswith(SUFFIX)
        ]
        return sorted(found)
    from pyarrow import fs  # type: ignore[import-untyped]

    filesystem, root = fs.FileSystem.from_uri(path)
    info = filesystem.get_file_info(root)
    if info.type == fs.FileType.File:
        return [path]
    if info.type == fs.FileType.NotFound:
        raise FileNotFoundError(f"no such capture directory: {path}")
    selector = fs.FileSelector(root, recursive=True)
    prefix = path[: len(path) - len(root)] if path.endswith(root) else ""
    return sorted(
        prefix + f.path
        for f in filesystem.get_file_info(selector)
        if f.type == fs.FileType.File and f.path.endswith(SUFFIX)
    )


def capture_files(path: str, label: str) -> list[str]:
    """The segment files of one side, each local one's header checked."""
    try:
        files = list_segment_files(path)
    except FileNotFoundError as exc:
        raise InputError(f"{label}: {exc}") from None
    except OSError as exc:
        raise InputError(f"{label}: cannot list {path}: {exc}") from None
    if not files:
        raise InputError(f"{label}: no capture segments (*{SUFFIX}) under {path}")
    for name in files:
        if is_local(name):
            check_header(local_path(name), label)
    return files


def check_header(path: str, label: str) -> None:
    try:
        with open(path, "rb") as handle:
            head = handle.read(_HEADER_READ)
    except OSError as exc:
        raise InputError(f"{label}: cannot read {path}: {exc.strerror or exc}") from None
    try:
        meta, _ = decode_header(head, path)
    except SegmentError as exc:
        raise InputError(f"{label}: {exc}") from None
    if meta.get("side") not in ("tap", "upr"):
        raise InputError(f"{label}: {path}: not a capture of a TAP or UPR side: {meta!r:.80}")


def writable_file(path: str, option: str) -> None:
    """``path`` can be written when the job ends (its folder exists and is writable)."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise InputError(f"{option} {path}: is a directory, not a file")
    if not os.path.isdir(folder):
        raise InputError(f"{option} {path}: no such directory {folder}")
    target = path if os.path.exists(path) else folder
    if not os.access(target, os.W_OK):
        raise InputError(f"{option} {path}: not writable ({target})")
