"""The manifest of an export folder (``manifest.json``): every top-level file of the folder with its size in bytes and
its sha256, written last by ``save_pretrained`` and checked before loading reads any file.

It catches damage (a flipped byte, a truncated or edited file, a save that did not finish) and files that do not
belong (a program or a pickle dropped in, a link that leads out of the folder). It is not a signature: whoever edits
a folder can write a manifest to match. What keeps a folder from someone else from running code is that loading
executes and unpickles nothing (docs/security.md); the manifest makes sure that what is loaded is what was saved.

Layout: ``{"manifest_version": 1, "files": {name: {"size": bytes, "sha256": hex digest}}}``; names are plain file
names (no folders: a nested folder, such as the CLI's ``draft-bf16``, is an export with a manifest of its own).

The sha256 pass is the one cost of the check (about as long as reading the weights, single-threaded). A file this
machine verified before and that has not changed since (same device, inode, size, modification and status-change
times: :func:`verified_before`, the way git's index trusts a file's stat data) is not hashed again: a second load of
a folder costs what a load without the check costs.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import threading
import time
from typing import Dict, Iterator, List, Optional, Tuple

from ..facts import MANIFEST_NAME
from ..utils.fs import default_cache_dir

MANIFEST_VERSION = 1
#: bytes read per hashing step
HASH_PIECE_BYTES = 8 << 20
#: the folder (in the models cache) of this machine's records of files it verified (:func:`verified_before`)
VERIFIED_DIR_NAME = "_verified"
#: a file is recorded as verified only once its status-change time is this old (ns): file times advance by the
#: kernel's clock tick, and a change within the tick of the verification could leave them equal
SETTLED_NS = 2_000_000_000
#: files a folder may hold outside its manifest because loading never opens them: tokenizer files (written beside
#: a saved model by ``tokenizer.save_pretrained``), hub and git files, documentation
UNREAD_NAMES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "vocab.json",
    "chat_template.json", "preprocessor_config.json", "processor_config.json", ".gitattributes", ".DS_Store",
)
#: names of the tokenizer's own files (carried over from an old folder only when a save writes no tokenizer)
TOKENIZER_SUFFIXES = (".model", ".tiktoken", ".jinja")
#: suffixes of files that are never read by loading and hold no program (tokenizer models and templates,
#: documentation, text, images)
UNREAD_SUFFIXES = (".model", ".tiktoken", ".jinja", ".md", ".txt", ".png", ".jpg", ".jpeg", ".gif", ".svg")
#: names transformers' ``from_pretrained`` would follow out of the folder (a PEFT adapter names its base model and
#: may hold pickled weights): refused in a data-only export, listed or not
FOLLOWED_NAMES = ("adapter_config.json", "adapter_model.safetensors", "adapter_model.bin")
#: suffixes of programs and pickles (TorchScript, torch.save, Python, native libraries, NumPy/joblib/Keras files):
#: a data-only export holds none, listed or not
PROGRAM_SUFFIXES = (".pt", ".pth", ".bin", ".pkl", ".pickle", ".ckpt", ".py", ".pyc", ".so", ".dll", ".dylib",
                    ".npy", ".npz", ".joblib", ".h5", ".msgpack")


class ManifestError(ValueError):
    """A folder whose files do not match its manifest (or that has none). The message names the file and the fix."""


def write_manifest(folder: str) -> dict:
    """Write ``folder/manifest.json`` listing every regular top-level file of ``folder`` (the manifest excepted),
    through a temporary file renamed into place. Returns the manifest.

    Raises:
        ValueError: a top-level entry is a symbolic link (a saved export holds its own files).
    """
    files = {}
    for entry in sorted(os.scandir(folder), key=lambda e: e.name):
        if entry.name == MANIFEST_NAME or entry.is_dir(follow_symlinks=False):
            continue
        if entry.is_symlink() or not entry.is_file(follow_symlinks=False):
            raise ValueError(f"{entry.path} is not a regular file; an export folder holds its own files")
        files[entry.name] = {"size": entry.stat(follow_symlinks=False).st_size, "sha256": digest_of_unchanged_file(entry.path)[0]}
    manifest = {"manifest_version": MANIFEST_VERSION, "files": files}
    temporary = os.path.join(folder, f".{MANIFEST_NAME}.partial")
    with open(temporary, "w") as f:
        json.dump(manifest, f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, os.path.join(folder, MANIFEST_NAME))
    return manifest


def read_manifest(folder: str, fix: str) -> Dict[str, dict]:
    """The ``files`` table of ``folder/manifest.json``, its shape checked. ``fix``: what the error messages advise.

    Raises:
        ManifestError: no manifest, not JSON, or not the layout in the module docstring.
    """
    path = os.path.join(folder, MANIFEST_NAME)
    if not os.path.isfile(path) or os.path.islink(path):
        raise ManifestError(f"{folder} has no {MANIFEST_NAME}: it is not a complete export (a save that did not "
                            f"finish, or files copied in by hand); {fix}")
    try:
        with open(path) as f:
            manifest = json.load(f)
    except (OSError, ValueError, RecursionError) as exc:
        raise ManifestError(f"{path} is unreadable ({type(exc).__name__}: {str(exc)[:200]}); {fix}") from exc
    if not isinstance(manifest, dict) or manifest.get("manifest_version") != MANIFEST_VERSION:
        raise ManifestError(f"{path} is not a manifest this package reads (manifest_version "
                            f"{MANIFEST_VERSION}); {fix}")
    files = manifest.get("files")
    if not isinstance(files, dict) or not all(
            isinstance(name, str) and _plain_name(name) and isinstance(info, dict)
            and isinstance(info.get("size"), int) and isinstance(info.get("sha256"), str)
            for name, info in files.items()):
        raise ManifestError(f"{path} does not list plain file names with their size and sha256; {fix}")
    return files


def check_folder(folder: str, fix: str, deferred_suffix: Optional[str] = None,
                 allowed: Tuple[str, ...] = ()) -> "HashCheck":
    """Check every file of ``folder`` against its manifest before it is read: each listed file exists, is a regular
    file inside the folder (a link may point only within it) and has its size (all checked at once), then its sha256
    (one read of each file, which leaves it in the page cache for the load that follows); no file outside the
    manifest could be read by loading (only :data:`UNREAD_NAMES` and :data:`UNREAD_SUFFIXES` may be added, and
    listed ones of them are not checked; subfolders are not read); no file, listed or not, has one of
    :data:`PROGRAM_SUFFIXES` or is one of :data:`FOLLOWED_NAMES`. ``fix``: what the error messages advise.

    ``deferred_suffix`` (e.g. ``".safetensors"``): the sha256 of the files with that suffix is computed by a thread
    started here, while the caller reads them (their sizes are checked at once): wait for it with
    :func:`checked_while_loading` before the loaded model is used. Returns that :class:`HashCheck` (already done
    without ``deferred_suffix``).

    Raises:
        ManifestError: the first problem found, naming the file.
    """
    files = read_manifest(folder, fix)
    root = os.path.realpath(folder)
    check_names(folder, fix, allowed)
    for entry in os.scandir(folder):
        if entry.name == MANIFEST_NAME or entry.name in files or entry.is_dir(follow_symlinks=False):
            continue
        if is_unread(entry.name):
            continue
        raise ManifestError(f"{entry.path} is not in the folder's manifest, and loading could read it (weights, "
                            f"configuration, a pickle or a program); remove it, or {fix}")
    # files loading never reads (a tokenizer saved beside the model, docs) are listed for reference, not checked: an
    # edited chat template is no reason to refuse the model
    files = {name: info for name, info in files.items() if not is_unread(name)}
    for name, info in files.items():
        path = os.path.join(folder, name)
        if not os.path.lexists(path):
            raise ManifestError(f"{path} is listed in the manifest but missing; {fix}")
        real = os.path.realpath(path)
        if os.path.commonpath([root, real]) != root:
            raise ManifestError(f"{path} is a link to {real}, outside the folder; an export's files must lie inside "
                                f"it: {fix}")
        if not os.path.isfile(real):
            raise ManifestError(f"{path} is not a regular file; {fix}")
        size = os.path.getsize(real)
        if size != info["size"]:
            raise ManifestError(f"{path} has {size} bytes, its manifest says {info['size']} (truncated or "
                                f"changed); {fix}")
    now = [(os.path.join(folder, name), info["sha256"]) for name, info in sorted(files.items())
           if not (deferred_suffix and name.endswith(deferred_suffix))]
    HashCheck(now, fix, background=False).wait()
    return HashCheck([(os.path.join(folder, name), info["sha256"]) for name, info in sorted(files.items())
                      if deferred_suffix and name.endswith(deferred_suffix)], fix, background=True)


def check_names(folder: str, fix: str, allowed: Tuple[str, ...] = ()) -> None:
    """Refuse a folder holding, at its top level, a program or pickle (:data:`PROGRAM_SUFFIXES`, any letter case)
    or a file transformers would follow to another model (:data:`FOLLOWED_NAMES`); ``allowed``: names let through
    (formats 1-2's graph archives, loaded only under ``trust_torchscript``).

    Raises:
        ManifestError: naming the file.
    """
    for entry in os.scandir(folder):
        if entry.name in allowed or entry.is_dir(follow_symlinks=False):
            continue
        if entry.name.lower().endswith(PROGRAM_SUFFIXES):
            raise ManifestError(f"{entry.path} is a program or pickle file; an export holds data only and loading "
                                f"never reads such a file: remove it, or {fix}")
        if entry.name in FOLLOWED_NAMES:
            raise ManifestError(f"{entry.path} would make transformers load another model (a PEFT adapter); an export "
                                f"holds none: remove it, or {fix}")


class HashCheck:
    """The sha256 of some files compared with their manifest entries, in this thread or, for ``background``, in a
    thread of its own started by :func:`checked_while_loading` (``hashlib`` and file reads release the GIL: on a CPU
    with a core to spare the check costs the load nothing). A check never started runs nothing.

    ``wait()`` raises the :class:`ManifestError` of the first file that differs, naming it; any other failure of the
    check is a ManifestError too (it never passes a file it could not hash).
    """

    def __init__(self, items: List[Tuple[str, str]], fix: str, background: bool):
        self.items, self.fix, self.error = items, fix, None
        self._thread = None
        self._background = background
        if not background:
            self._run()

    def start(self) -> None:
        if self._background and self._thread is None and self.items:
            self._thread = threading.Thread(target=self._run, name="optimum-ipex-spec sha256", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        self.error = ManifestError(f"the sha256 check did not finish; {self.fix}")  # cleared only at the end
        for path, expected in self.items:
            try:
                if verified_before(path, expected):
                    continue
                found, identity = digest_of_unchanged_file(path)
                if found != expected:
                    self.error = ManifestError(f"{path} does not match the sha256 in its manifest (damaged or "
                                               f"changed after the save); {self.fix}")
                    return
                if identity is not None:
                    record_verified(path, found, identity)
            except Exception as exc:  # a check that fails must not pass
                self.error = ManifestError(f"{path} could not be checked ({type(exc).__name__}: {exc}); {self.fix}")
                return
        self.error = None

    def wait(self) -> None:
        if self._background and self._thread is None:
            self.start()
        if self._thread is not None:
            self._thread.join()
        if self.error is not None:
            raise self.error


@contextlib.contextmanager
def checked_while_loading(check: Optional[HashCheck], wait: bool = True) -> Iterator[None]:
    """Run the body (the load that reads the files) while ``check`` runs; then wait for it (``wait=False``: leave it
    running for a later block). When the body fails and the check finds a damaged file, the :class:`ManifestError` is
    raised (from the body's error): damage is named as damage, not as whatever the reader made of it."""
    if check is not None:
        check.start()
    try:
        yield
    except Exception as exc:
        if check is not None:
            try:
                check.wait()
            except ManifestError as damaged:
                raise damaged from exc
        raise
    if check is not None and wait:
        check.wait()


def _verified_record(path: str) -> str:
    """Where this machine keeps the record of ``path``'s last verified digest: ``<models cache>/_verified/``, one
    JSON file per real path (named by the sha256 of that path)."""
    key = hashlib.sha256(os.fsencode(os.path.realpath(path))).hexdigest()
    return os.path.join(str(default_cache_dir()), VERIFIED_DIR_NAME, f"{key}.json")


def _identity(path: str, st=None) -> dict:
    """What changes whenever a file's bytes change: its device, inode, size and modification / status-change times
    in ns (the status-change time cannot be set by a program: any write or ``utime`` moves it)."""
    st = st if st is not None else os.stat(path)
    return {"path": os.path.realpath(path), "dev": st.st_dev, "ino": st.st_ino, "size": st.st_size,
            "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns}


def digest_of_unchanged_file(path: str) -> Tuple[str, Optional[dict]]:
    """The sha256 of ``path`` and its :func:`_identity` taken from the open file before the read, or None for the
    identity when the file changed while it was read (then nothing may be recorded)."""
    digest = hashlib.sha256()
    buffer = bytearray(HASH_PIECE_BYTES)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        before = os.fstat(f.fileno())
        while True:
            n = f.readinto(view)
            if not n:
                break
            digest.update(view[:n])
        after = os.fstat(f.fileno())
    identity = _identity(path, before)
    return digest.hexdigest(), identity if identity == _identity(path, after) else None


def verified_before(path: str, sha256: str) -> bool:
    """True when this machine verified ``path`` against ``sha256`` before and the file has not changed since (same
    :func:`_identity`, as git's index trusts a file's stat data): loading it again skips the hash pass."""
    try:
        with open(_verified_record(path)) as f:
            record = json.load(f)
        return record == {**_identity(path), "sha256": sha256}
    except (OSError, ValueError, RuntimeError):
        return False


def record_verified(path: str, sha256: str, identity: dict) -> None:
    """Remember that ``path``, with ``identity`` (taken before it was read, unchanged after), matched ``sha256``
    (best effort: a cache that cannot be written only means the next load hashes again)."""
    try:
        if time.time_ns() - identity["ctime_ns"] < SETTLED_NS:
            return  # changed just now: a change within the clock's tick may keep these times ("racy git")
        record = _verified_record(path)
        os.makedirs(os.path.dirname(record), mode=0o700, exist_ok=True)
        temporary = f"{record}.{os.getpid()}.{threading.get_ident()}.partial"
        with open(temporary, "w") as f:
            json.dump({**identity, "sha256": sha256}, f)
        os.replace(temporary, record)
    except (OSError, RuntimeError):  # RuntimeError: no home folder to hold the cache
        pass


def is_unread(name: str) -> bool:
    """True for a file name that loading an export never opens (:data:`UNREAD_NAMES`, :data:`UNREAD_SUFFIXES`,
    ``LICENSE*`` / ``NOTICE*`` that are not JSON or weights)."""
    return name in UNREAD_NAMES or name.endswith(UNREAD_SUFFIXES) or (
        name.startswith(("LICENSE", "NOTICE")) and not name.endswith((".json", ".safetensors")))


def _plain_name(name: str) -> bool:
    return bool(name) and name not in (".", "..") and "/" not in name and "\\" not in name and "\0" not in name
