"""The compile cache loads nothing but data, and only from files no one else can write.

Each case runs a small virtual-device step, ``x * 7 + x`` on an 8x4 tensor of 8.0 (64 in every
element; with the add edited into a sub, 48), once to write its cache file, then changes the file
or the directory as an attacker or an accident would and runs the step again: the file must be
ignored with a CompileCacheWarning and the result must be 64.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import partita
from partita import CompileCacheWarning, Mesh, P
from partita.ir.op_lookup import find_op
from partita.partition.special.random_draw import _run_draw
from partita.virtual import disk_cache
from partita.virtual import state as virtual_state

MESH = Mesh.create((2, 4), ("data", "model"))
RIGHT, POISONED = 64.0, 48.0
NOBODY = 65534
IS_ROOT = os.geteuid() == 0


@pytest.fixture(scope="module")
def dev() -> torch.device:
    return partita.use_spmd(MESH)


@pytest.fixture(autouse=True)
def _fresh_warnings() -> Iterator[None]:
    disk_cache._WARNED.clear()  # each test sees its own once-per-process warnings
    yield
    disk_cache._WARNED.clear()
    disk_cache.set_directory(None)


def _run(cache: Path | None) -> tuple[float, int, int]:
    """The step's value (every element is the same), its compiles and its disk hits."""
    virtual_state.get().programs.clear()  # forget the in-memory programs: only the disk can help
    partita.metrics(reset=True)
    disk_cache.set_directory(cache)
    try:
        x = torch.full((8, 4), 8.0).to(torch.device("spmd", 0))
        partita.mark_sharding(x, MESH, P("data", None))
        out = (x * 7 + x).cpu()
    finally:
        disk_cache.set_directory(None)
    assert bool((out == out[0, 0]).all())
    m = partita.metrics()
    return out[0, 0].item(), m.compiles, m.disk_hits


def _saved(cache: Path, dev: torch.device) -> Path:
    """The cache file of the step, written by a first run (and read back by a second)."""
    assert _run(cache) == (RIGHT, 1, 0)
    assert _run(cache) == (RIGHT, 0, 1)
    (path,) = cache.glob("*.json")
    return path


def _poisoned(path: Path, target: str = "aten::sub.Tensor", rehash: bool = True) -> bytes:
    """The file with its add replaced by ``target``, its hash recomputed as an attacker would."""
    data = json.loads(path.read_bytes())
    (row,) = [r for r in data["graph"] if r["target"] == "aten::add.Tensor"]
    row["target"] = target
    if rehash:
        data["sha256"] = disk_cache._digest(data)
    return json.dumps(data).encode()


def _replace(path: Path, blob: bytes, mode: int = 0o600) -> None:
    path.write_bytes(blob)
    path.chmod(mode)


def _ignored(cache: Path, match: str) -> None:
    """The next run ignores the file with a warning matching ``match``, compiles, is right."""
    with pytest.warns(CompileCacheWarning, match=match):
        assert _run(cache) == (RIGHT, 1, 0)


# --- 1. what a file may call ----------------------------------------------------------------


class _Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def load_library(self, *args: object) -> None:
        self.calls.append(args)


@pytest.mark.parametrize(
    "target",
    [
        "load_library::__self__.load_library",  # the reported attack: torch.ops.load_library
        "aten::__self__.load_library",
        "aten::add.__class__",
        "aten::add.Tensor.__call__",
        "os::system.default",
        "builtins.eval",
        "operator.attrgetter",
        "torchvision::nms.default",
        "partita::no_such_op.default",
        "aten::from_file.default",  # an aten op, but it reads a file it is given by name
        "aten::add",
    ],
)
def test_a_file_calling_outside_the_table_is_ignored_and_calls_nothing(
    dev: torch.device, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, target: str
) -> None:
    path = _saved(tmp_path, dev)
    recorder = _Recorder()
    monkeypatch.setattr(torch.ops, "load_library", recorder.load_library)
    _replace(path, _poisoned(path, target))  # a valid hash, a private file: only the table stops it
    _ignored(tmp_path, rf"ignored {path}: .*{target!r}")
    assert recorder.calls == []
    assert _run(tmp_path) == (RIGHT, 0, 1)  # the new file replaced it


def test_the_table_is_looked_up_by_exact_name() -> None:
    aten = ("aten", "prims", "partita")
    assert find_op("aten", "add", "Tensor", aten) is torch.ops.aten.add.Tensor
    assert find_op("aten", "__and__", "Tensor", aten) is torch.ops.aten.__and__.Tensor
    assert find_op("partita", "all_reduce", "default", aten) is torch.ops.partita.all_reduce.default
    assert find_op("aten", "add", "Tensor", ("prims",)) is None  # namespace not allowed
    for parts in [
        ("aten", "__class__", "default"),
        ("aten", "add", "__class__"),
        ("aten", "add.Tensor", "default"),
        ("aten", "add", "Tensor "),
        ("load_library", "__self__", "load_library"),
        ("aten", "add", 3),
    ]:
        assert find_op(*parts, aten) is None, parts


def test_a_random_draw_naming_another_function_is_refused() -> None:
    """The draw op's own string argument is looked up by exact name too."""
    with pytest.raises(partita.CompilerError, match=r"'__dict__\.clear' is not an aten op"):
        _run_draw([], "__dict__.clear", json.dumps({"args": [], "kwargs": {}}))
    spec = {"args": [[2]], "kwargs": {"dtype": {"dtype": "load"}}}
    with pytest.raises(partita.CompilerError, match=r"'load' is not a torch dtype"):
        _run_draw([], "rand.default", json.dumps(spec))


def test_a_kwarg_that_is_not_an_argument_of_the_op_is_refused(
    dev: torch.device, tmp_path: Path
) -> None:
    """Keyword names go into the code fx generates: only the op's own argument names load."""
    path = _saved(tmp_path, dev)
    data = json.loads(path.read_bytes())
    (row,) = [r for r in data["graph"] if r["target"] == "aten::add.Tensor"]
    row["kwargs"] = {"alpha=__import__('os').getpid(), beta": 1}
    row2 = data["graph"][0]
    data["sha256"] = disk_cache._digest(data)
    _replace(path, json.dumps(data).encode())
    _ignored(tmp_path, r"is malformed .*aten::add\.Tensor has no argument named")
    row["kwargs"] = {}
    row2["name"] = "x; import os"
    data["sha256"] = disk_cache._digest(data)
    _replace(path, json.dumps(data).encode())
    _ignored(tmp_path, r"is malformed .*a node name must be a plain identifier")


def test_a_random_draw_naming_another_function_is_ignored_at_load(
    dev: torch.device, tmp_path: Path
) -> None:
    """A random draw names its aten op as a string argument: the file is checked for it."""

    def draw() -> tuple[torch.Tensor, int]:
        virtual_state.get().programs.clear()
        partita.metrics(reset=True)
        disk_cache.set_directory(tmp_path)
        try:
            torch.manual_seed(0)
            x = torch.ones(8, 4).to(torch.device("spmd", 0))
            partita.mark_sharding(x, MESH, P("data", None))
            out = (torch.rand_like(x) + x).cpu()
        finally:
            disk_cache.set_directory(None)
        return out, partita.metrics().disk_hits

    first, _ = draw()
    (path,) = tmp_path.glob("*.json")
    data = json.loads(path.read_bytes())
    (row,) = [r for r in data["graph"] if r["target"] == "partita::global_random_draw.default"]
    assert row["args"]["tuple"][1] == "rand_like.default"
    row["args"]["tuple"][1] = "__dict__.clear"
    data["sha256"] = disk_cache._digest(data)
    _replace(path, json.dumps(data).encode())
    with pytest.warns(CompileCacheWarning, match=r"global_random_draw names '__dict__\.clear'"):
        again, hits = draw()
    assert hits == 0
    torch.testing.assert_close(again, first)  # the same seed, compiled again: the same draw
    assert bool(((first >= 1) & (first < 2)).all())


# --- 2. the content hash --------------------------------------------------------------------


def test_an_edited_op_is_detected_by_the_hash(dev: torch.device, tmp_path: Path) -> None:
    path = _saved(tmp_path, dev)
    _replace(path, _poisoned(path, rehash=False))  # add -> sub, the hash left as it was
    _ignored(tmp_path, r"does not match the SHA-256 stored in it")


@pytest.mark.parametrize("where", [0.0, 0.1, 0.3, 0.5, 0.7, 0.9, 0.97])
def test_a_flipped_byte_is_detected(dev: torch.device, tmp_path: Path, where: float) -> None:
    path = _saved(tmp_path, dev)
    blob = bytearray(path.read_bytes())
    i = int(where * (len(blob) - 1))
    blob[i] ^= 0x01
    _replace(path, bytes(blob))
    _ignored(
        tmp_path, r"ignored .*: (it is not valid JSON|its content does not match|it is format)"
    )


# --- 3. owner and mode ------------------------------------------------------------------------


def test_a_file_others_can_write_is_ignored(dev: torch.device, tmp_path: Path) -> None:
    path = _saved(tmp_path, dev)
    _replace(path, _poisoned(path), mode=0o666)
    _ignored(tmp_path, r"the file is writable by group and others \(mode -rw-rw-rw-\)")
    _replace(path, _poisoned(path), mode=0o620)
    _ignored(tmp_path, r"the file is writable by group \(mode -rw--w----\)")
    # The hash does not stop whoever can write the file: the same file, private, is used.
    _replace(path, _poisoned(path), mode=0o600)
    assert _run(tmp_path) == (POISONED, 0, 1)


@pytest.mark.parametrize(
    ("mode", "who"), [(0o1777, "group and others"), (0o770, "group"), (0o757, "others")]
)
def test_a_directory_others_can_write_is_not_used(
    dev: torch.device, tmp_path: Path, mode: int, who: str
) -> None:
    path = _saved(tmp_path, dev)
    blob = _poisoned(path)
    _replace(path, blob)
    tmp_path.chmod(mode)
    try:
        match = rf"not using {tmp_path}: the directory is writable by {who}.*chmod 700 {tmp_path}"
        _ignored(tmp_path, match)
        assert _run(tmp_path) == (RIGHT, 1, 0)  # one warning per process; still not used
        assert path.read_bytes() == blob  # nor written
    finally:
        tmp_path.chmod(0o700)


def test_a_cache_file_that_is_a_symlink_is_ignored(dev: torch.device, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    path = _saved(cache, dev)
    elsewhere = tmp_path / "elsewhere.json"
    elsewhere.write_bytes(_poisoned(path))
    elsewhere.chmod(0o600)
    path.unlink()
    path.symlink_to(elsewhere)
    _ignored(cache, r"it is a symbolic link; a cache file must be a regular file")


def test_a_symlink_to_a_private_directory_works(dev: torch.device, tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(real)
    _saved(link, dev)
    assert len(list(real.glob("*.json"))) == 1


@pytest.mark.skipif(not IS_ROOT, reason="needs root to make a file of another user")
def test_a_directory_or_file_of_another_user_is_not_used(dev: torch.device, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    path = _saved(cache, dev)
    _replace(path, _poisoned(path))
    os.chown(path, NOBODY, NOBODY)
    _ignored(cache, rf"the file is owned by uid {NOBODY}, not by you \(uid 0\)")
    # A private directory of another user, reached through a symbolic link of ours.
    theirs = tmp_path / "theirs"
    shutil.copytree(cache, theirs)
    theirs.chmod(0o700)
    for p in [theirs, *theirs.iterdir()]:
        os.chown(p, NOBODY, NOBODY)
    (theirs / path.name).write_bytes(_poisoned(path))
    link = tmp_path / "link"
    link.symlink_to(theirs)
    _ignored(link, rf"not using {link} \(a symbolic link to {theirs}\): the directory is owned")


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A world-writable sticky directory (a shared /tmp/cache), reachable by every user."""
    path = Path(tempfile.mkdtemp(prefix="partita-shared-", dir="/tmp"))
    path.chmod(0o1777)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _as_nobody() -> None:
    os.setgroups([])
    os.setgid(NOBODY)
    os.setuid(NOBODY)


@pytest.mark.skipif(not IS_ROOT, reason="needs root to run the attacker as another user")
def test_another_user_cannot_poison_a_shared_cache(
    dev: torch.device, tmp_path: Path, shared_dir: Path
) -> None:
    """The reported attack: another user writes the victim's cache file (its name and hash
    recomputed) into a shared 1777 directory; the victim ignores it and computes 64."""
    path = _saved(tmp_path, dev)  # what the attacker learns by running the same step
    target, blob = shared_dir / path.name, _poisoned(path)
    attacker = subprocess.run(
        ["/bin/sh", "-c", 'cat > "$1" && chmod 644 "$1"', "sh", str(target)],
        input=blob,
        preexec_fn=_as_nobody,
        capture_output=True,
        timeout=60,
    )
    assert attacker.returncode == 0, attacker.stderr
    assert target.stat().st_uid == NOBODY
    _ignored(shared_dir, rf"not using {shared_dir}: the directory is writable by group and others")
    assert target.read_bytes() == blob  # the victim wrote nothing there either


# --- 4. a cache that cannot be written or read ----------------------------------------------


def test_a_cache_path_that_is_a_file_only_warns(dev: torch.device, tmp_path: Path) -> None:
    not_a_dir = tmp_path / "cache"
    not_a_dir.write_text("not a directory")
    with pytest.warns(CompileCacheWarning, match=r"cannot .* it is not a directory") as record:
        assert _run(not_a_dir) == (RIGHT, 1, 0)
        assert _run(not_a_dir) == (RIGHT, 1, 0)
    assert len([w for w in record if w.category is CompileCacheWarning]) == 2  # read and save
    inside = not_a_dir / "sub"  # a path under a file: cannot be created
    with pytest.warns(CompileCacheWarning) as record:
        assert _run(inside) == (RIGHT, 1, 0)
    messages = sorted(str(w.message) for w in record if w.category is CompileCacheWarning)
    assert len(messages) == 2
    assert messages[0].startswith(
        f"partita compile cache: cannot read compiled steps from {inside}"
    )
    assert messages[1].startswith(f"partita compile cache: cannot save compiled steps in {inside}")


@pytest.mark.parametrize(
    "error",
    [
        OSError(errno.ENOSPC, "No space left on device"),
        PermissionError(errno.EACCES, "Permission denied"),
    ],
)
def test_a_failed_write_only_warns(
    dev: torch.device, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, error: OSError
) -> None:
    def fail(fd: int, blob: bytes) -> None:
        os.close(fd)
        raise error

    monkeypatch.setattr(disk_cache, "_write", fail)
    with pytest.warns(CompileCacheWarning, match=rf"cannot save .*: {error.strerror}.*") as rec:
        assert _run(tmp_path) == (RIGHT, 1, 0)
        assert _run(tmp_path) == (RIGHT, 1, 0)
    assert len([w for w in rec if w.category is CompileCacheWarning]) == 1  # once per process
    assert list(tmp_path.iterdir()) == []  # no temporary file left behind


@pytest.mark.skipif(IS_ROOT, reason="root can write a directory of mode 0o500")
def test_a_read_only_directory_only_warns(dev: torch.device, tmp_path: Path) -> None:
    tmp_path.chmod(0o500)
    try:
        with pytest.warns(CompileCacheWarning, match=r"cannot save .*Permission denied"):
            assert _run(tmp_path) == (RIGHT, 1, 0)
    finally:
        tmp_path.chmod(0o700)


def test_an_unreadable_file_only_warns(
    dev: torch.device, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _saved(tmp_path, dev)

    def fail(dfd: int, name: str) -> bytes:
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(disk_cache, "_read", fail)
    with pytest.warns(CompileCacheWarning, match=r"cannot read compiled steps from .*denied"):
        assert _run(tmp_path) == (RIGHT, 1, 0)


# --- 5. how partita writes, and where -------------------------------------------------------


def test_partita_creates_a_private_directory_and_private_files(
    dev: torch.device, tmp_path: Path
) -> None:
    cache = tmp_path / "a" / "cache"
    path = _saved(cache, dev)
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert [p.name for p in cache.iterdir()] == [path.name]  # no temporary file left


def test_the_directory_comes_from_the_options(
    dev: torch.device, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert disk_cache.directory() is None
    with partita.options.using(compile_cache=str(tmp_path / "opt")):
        assert disk_cache.directory() == tmp_path / "opt"
        assert _run(None) == (RIGHT, 1, 0)
    assert len(list((tmp_path / "opt").glob("*.json"))) == 1
    monkeypatch.setenv("PARTITA_COMPILE_CACHE", str(tmp_path / "env"))
    assert disk_cache.directory() == tmp_path / "env"
    assert _run(None) == (RIGHT, 1, 0)
    assert _run(None) == (RIGHT, 0, 1)
    disk_cache.set_directory(tmp_path / "explicit")  # set_directory (use_spmd) comes first
    assert disk_cache.directory() == tmp_path / "explicit"
    disk_cache.set_directory("~/partita-cache")
    assert disk_cache.directory() == Path.home() / "partita-cache"
