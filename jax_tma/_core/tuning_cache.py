"""The persistent autotuning cache: a JSON file of entries keyed by strings the tuners build,
shared by every process on the machine.

The cache is ``$JAX_TMA_AUTOTUNE_CACHE`` or ``<cache dir>/jax_tma/autotune.json`` (``<cache dir>``:
``$XDG_CACHE_HOME`` or ``~/.cache``). Writers take an exclusive lock on a sibling ``.lock``
file, merge their entries into what is on disk and replace the file atomically, so concurrent
processes lose no entry and readers never see a partial file. A file of another
``CACHE_VERSION`` is ignored and rewritten on the next store. Nothing here knows an op.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import pathlib
import tempfile
from typing import Any

CACHE_VERSION = 1
_CACHE_ENV = "JAX_TMA_AUTOTUNE_CACHE"


def cache_path() -> pathlib.Path:
    """Where the cache lives (see the module's docstring)."""
    explicit = os.environ.get(_CACHE_ENV, "").strip()
    if explicit:
        return pathlib.Path(explicit).expanduser()
    base = os.environ.get("XDG_CACHE_HOME", "").strip() or os.path.join("~", ".cache")
    return pathlib.Path(base).expanduser() / "jax_tma" / "autotune.json"


_memory: dict[str, tuple[float, dict[str, Any]]] = {}  # path -> (mtime, entries)


def _read(path: pathlib.Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as err:
        raise RuntimeError(f"jax_tma: the autotuning cache {path} cannot be read ({err}); "
                           f"delete it or point {_CACHE_ENV} elsewhere") from err
    if not isinstance(data, dict) or data.get("version") != CACHE_VERSION:
        return {}  # another version's cache: ignored, rewritten on the next store
    entries = data.get("entries", {})
    return entries if isinstance(entries, dict) else {}


def entries() -> dict[str, Any]:
    """Every cached entry (re-read when the file changed)."""
    path = cache_path()
    try:
        mtime = path.stat().st_mtime_ns
    except FileNotFoundError:
        return {}
    cached = _memory.get(str(path))
    if cached is None or cached[0] != mtime:
        cached = (mtime, _read(path))
        _memory[str(path)] = cached
    return cached[1]


@contextlib.contextmanager
def _locked(path: pathlib.Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def store(key: str, entry: dict[str, Any]) -> None:
    """Adds one entry: under the lock, merged into the file's current entries, written to a
    temporary file and renamed over the cache."""
    path = cache_path()
    with _locked(path):
        merged = dict(_read(path))
        merged[key] = entry
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump({"version": CACHE_VERSION, "entries": merged}, f, indent=1,
                          sort_keys=True)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
    _memory.pop(str(path), None)
