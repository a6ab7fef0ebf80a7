"""One options value: every knob of the compiler and the runtime, defined once.

Each knob is one :class:`Knob`: its field of :class:`CompileOptions`, its environment variable,
its parser and its default. That single table gives the three ways to set it, in order of
precedence (the last one set wins):

1. the default in the table;
2. the environment variable (``PARTITA_STRICT=1``), read when :func:`current` is called;
3. :func:`using`, a context manager (``with partita.options.using(strict=True): ...``);
4. per call: ``partita.jit(fn, ..., options=CompileOptions(...))`` or ``options={"strict": True}``
   (applied over the current value by :func:`resolve`).

This module is the only place in ``src/`` that reads a ``PARTITA_*`` variable. Every variable is
parsed with one vocabulary (booleans: ``1 true on yes`` / ``0 false off no``, any case) and a bad
value is one typed error, :class:`~partita.errors.OptionError`, naming the variable, the value and
what it accepts. Fields that change the compiled program are part of :meth:`CompileOptions.key`,
which every compile cache includes; runtime-only fields (timeouts, the cache directory) are not.

This module holds values only: it imports nothing from the stages.

Example:
    >>> from partita.options import CompileOptions, current, using
    >>> with using(strict=True):
    ...     current().strict
    True
    >>> CompileOptions(collectives="loud")
    Traceback (most recent call last):
    ...
    partita.errors.OptionError: CompileOptions(collectives='loud'): ...
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Literal

from partita.errors import OptionError

__all__ = [
    "KNOBS",
    "CollectivesMode",
    "CompileOptions",
    "Knob",
    "current",
    "environment",
    "resolve",
    "using",
]

CollectivesMode = Literal["auto", "explicit", "warn"]

_TRUE = ("1", "true", "on", "yes")
_FALSE = ("0", "false", "off", "no")


# --- parsers: text of an environment variable -> value (None: unset) ------------------------


def _bool(text: str) -> bool:
    low = text.lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    raise OptionError(f"one of {'/'.join(_TRUE)} or {'/'.join(_FALSE)}")


def _bool_or_auto(text: str) -> bool | None:
    if text.lower() == "auto":
        return None
    try:
        return _bool(text)
    except OptionError:
        raise OptionError(f"auto or one of {'/'.join(_TRUE)} or {'/'.join(_FALSE)}") from None


def _bytes(text: str) -> int:
    if not text.isdigit():
        raise OptionError("a whole number of bytes >= 0 (0 turns it off)")
    return int(text)


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise OptionError("a number of seconds > 0") from None
    if not math.isfinite(value) or value <= 0:
        raise OptionError("a finite number of seconds > 0")
    return value


def _count(text: str) -> int:
    if not text.isdigit():
        raise OptionError("a whole number >= 0 (0: never; unset: the cost-based choice)")
    return int(text)


def _collectives(text: str) -> str:
    low = text.lower()
    if low not in ("auto", "explicit", "warn"):
        raise OptionError("one of auto, explicit, warn")
    return low


def _objective(text: str) -> str:
    low = text.lower()
    if low not in ("time", "bytes"):
        raise OptionError("one of time, bytes")
    return low


def _path(text: str) -> str:
    return os.path.expanduser(text)


@dataclass(frozen=True, slots=True)
class Knob:
    """One option: its field, its environment variable, how to parse it, what it is."""

    name: str
    env: str
    parse: Callable[[str], Any]
    doc: str
    #: Part of the compile cache key (it changes the compiled program or how it runs).
    keyed: bool = True


#: Every option, in the order of :class:`CompileOptions`' fields.
KNOBS: tuple[Knob, ...] = (
    Knob("strict", "PARTITA_STRICT", _bool,
         "raise RematerializationError instead of warning on an involuntary full "
         "rematerialization"),
    Knob("replicate_unsupported", "PARTITA_REPLICATE_UNSUPPORTED", _bool,
         "run ops without a sharding rule on gathered inputs (recorded in the Plan)"),
    Knob("collectives", "PARTITA_COLLECTIVES", _collectives,
         "'auto' inserts every collective; 'explicit' makes one the annotations do not imply "
         "an error, 'warn' a warning"),
    Knob("regather", "PARTITA_REGATHER", _bool,
         "under FSDP, gather parameters again for the backward (less memory, more bytes)"),
    Knob("inductor", "PARTITA_INDUCTOR", _bool,
         "run the per-device programs' local ops compiled by Inductor"),
    Knob("bucket_bytes", "PARTITA_BUCKET_BYTES", _bytes,
         "fuse small collectives of one kind and group up to this many bytes (0: off)"),
    Knob("overlap_bytes", "PARTITA_OVERLAP_BYTES", _bytes,
         "bytes of collectives in flight while local ops run, receives posted ahead "
         "included (0: synchronous)"),
    Knob("scan_layers", "PARTITA_SCAN_LAYERS", _bool,
         "trace a module's repeated layers once"),
    Knob("trace_flat_at", "PARTITA_TRACE_FLAT_AT", _count,
         "the LocalMesh traces a segment's flat graph at its n-th run (None: cost-based)",
         keyed=False),
    Knob("check_replicas", "PARTITA_CHECK_REPLICAS", _bool,
         "under torch.distributed, compare a checksum of replicated inputs across ranks at a "
         "program's first run", keyed=False),
    Knob("join_timeout", "PARTITA_JOIN_TIMEOUT", _seconds,
         "seconds every rank may take to join the job", keyed=False),
    Knob("collective_timeout", "PARTITA_COLLECTIVE_TIMEOUT", _seconds,
         "seconds one collective may wait", keyed=False),
    Knob("compile_cache", "PARTITA_COMPILE_CACHE", _path,
         "directory of the virtual device's on-disk compile cache (None: off)", keyed=False),
    Knob("check_calls", "PARTITA_CHECK_CALLS", _bool,
         "under torch.distributed, check before every run of a program (not only its first) "
         "that every rank runs it with the same input shapes and dtypes", keyed=False),
    Knob("compile_in_child", "PARTITA_COMPILE_IN_CHILD", _bool_or_auto,
         "partita.jit compiles in a forked child process and runs the per-device program it "
         "hands back: this process never imports or holds the compiler (less memory; where "
         "os.fork exists). None (auto): under torch.distributed only, compiling here silently "
         "when the child cannot; True: on every mesh, a warning says when it cannot; False: "
         "never", keyed=False),
    Knob("auto_objective", "PARTITA_AUTO_OBJECTIVE", _objective,
         "what auto-sharding minimizes: modelled step time, or wire bytes at the best "
         "preset's compute (docs/auto.md)"),
    Knob("auto_time_limit", "PARTITA_AUTO_TIME_LIMIT", _seconds,
         "seconds auto-sharding's solver may take (LP relaxation, then MILP)"),
    Knob("memory_limit", "PARTITA_MEMORY_LIMIT", _bytes,
         "per-device peak bytes (Plan.memory()) an auto-sharded plan must fit (0: no limit)"),
)  # fmt: skip

_BY_NAME = {k.name: k for k in KNOBS}


@dataclass(frozen=True, slots=True)
class CompileOptions:
    """Every option of partita, as one frozen value (see the module docstring for precedence).

    Build one with keywords (``CompileOptions(strict=True)``); read the active one with
    :func:`current`. Values are validated here, whatever set them.
    """

    strict: bool = False
    replicate_unsupported: bool = False
    collectives: CollectivesMode = "auto"
    regather: bool = False
    inductor: bool = False
    bucket_bytes: int = 4 << 20
    overlap_bytes: int = 64 << 20
    scan_layers: bool = True
    trace_flat_at: int | None = None
    check_replicas: bool = True
    join_timeout: float = 300.0
    collective_timeout: float = 300.0
    compile_cache: str | None = None
    check_calls: bool = True
    compile_in_child: bool | None = None
    auto_objective: str = "time"
    auto_time_limit: float = 30.0
    memory_limit: int = 0
    _source: str = field(default="CompileOptions", compare=False, repr=False)

    def __post_init__(self) -> None:
        for f in fields(self):
            if f.name.startswith("_"):
                continue
            value = getattr(self, f.name)
            problem = _check(f.name, value)
            if problem:
                raise OptionError(
                    f"{self._source}({f.name}={value!r}): {f.name} must be {problem}. "
                    f"{_BY_NAME[f.name].doc.capitalize()}; its environment variable is "
                    f"{_BY_NAME[f.name].env}."
                )

    def key(self) -> tuple[Any, ...]:
        """The fields that change a compiled program, for compile cache keys."""
        return tuple(getattr(self, k.name) for k in KNOBS if k.keyed)

    def replace(self, **changes: Any) -> CompileOptions:
        """A copy with ``changes``; an unknown name is an OptionError listing the options."""
        _check_names(changes, "CompileOptions.replace")
        return dataclasses.replace(self, **changes)


#: What each parser reads, for checking a value set from Python.
_KINDS: dict[Callable[[str], Any], str | tuple[str, ...]] = {
    _bool: "bool",
    _bool_or_auto: "bool or None",
    _bytes: "bytes",
    _count: "count",
    _seconds: "seconds",
    _path: "path",
    _collectives: ("auto", "explicit", "warn"),
    _objective: ("time", "bytes"),
}


def _check(name: str, value: Any) -> str | None:
    """Why ``value`` is not valid for ``name`` (None if it is)."""
    kind = _KINDS[_BY_NAME[name].parse]  # the field's kind follows its variable's parser
    if isinstance(kind, tuple):
        return None if value in kind else f"one of {', '.join(map(repr, kind))}"
    if kind == "bool":
        return None if isinstance(value, bool) else "True or False"
    if kind == "bool or None":
        return None if value is None or isinstance(value, bool) else "None, True or False"
    if kind == "bytes":
        ok = isinstance(value, int) and not isinstance(value, bool) and value >= 0
        return None if ok else "an int >= 0 (bytes; 0 turns it off)"
    if kind == "count":
        ok = value is None or (isinstance(value, int) and not isinstance(value, bool))
        return None if ok and (value is None or value >= 0) else "None or an int >= 0"
    if kind == "seconds":
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        return None if ok and math.isfinite(value) and value > 0 else "finite seconds > 0"
    return None if value is None or isinstance(value, str | os.PathLike) else "None or a path"


def _check_names(changes: Mapping[str, Any], where: str) -> None:
    unknown = sorted(set(changes) - set(_BY_NAME))
    if unknown:
        raise OptionError(
            f"{where}: no option named {', '.join(map(repr, unknown))}. The options are: "
            f"{', '.join(_BY_NAME)} (docs/options.md)."
        )


def environment(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The options the environment sets, parsed (an OptionError names a bad variable)."""
    env = os.environ if environ is None else environ
    found: dict[str, Any] = {}
    for knob in KNOBS:
        text = env.get(knob.env, "").strip()
        if not text:
            continue
        try:
            found[knob.name] = knob.parse(text)
        except ValueError as e:
            raise OptionError(
                f"{knob.env}={text!r}: must be {e}. It sets {knob.name}: {knob.doc}. Fix or "
                f"unset the variable."
            ) from None
    return found


_OVERRIDES: contextvars.ContextVar[tuple[tuple[str, Any], ...]] = contextvars.ContextVar(
    "partita_options", default=()
)
#: The last environment read and the options it gave (the environment rarely changes).
_ENV_CACHE: list[Any] = [None, None]
#: (environment snapshot, using() overrides) -> the options they give (a call reads this on
#: every run of a compiled program: building and validating a value each time would cost more).
_MEMO: dict[tuple[Any, ...], CompileOptions] = {}


#: The variables' keys in ``os.environ``'s own mapping (read on every call: a jitted function
#: resolves its options per call, and ``os.environ.get`` costs microseconds per variable).
_ENV_KEYS = tuple(getattr(os.environ, "encodekey", str)(k.env) for k in KNOBS)


def _environ_snapshot() -> tuple[Any, ...]:
    data = getattr(os.environ, "_data", None)
    if isinstance(data, dict):
        return tuple(map(data.get, _ENV_KEYS))
    return tuple(os.environ.get(k.env) for k in KNOBS)


def current() -> CompileOptions:
    """The active options: defaults, then the environment, then :func:`using` blocks."""
    snapshot = _environ_snapshot()
    overrides = _OVERRIDES.get()
    memo_key: tuple[Any, ...] | None = (snapshot, overrides)
    try:
        found = _MEMO.get((snapshot, overrides))
    except TypeError:  # an unhashable value in using(): validated below, never memoized
        found, memo_key = None, None
    if found is not None:
        return found
    if _ENV_CACHE[0] != snapshot:
        _ENV_CACHE[1] = environment()
        _ENV_CACHE[0] = snapshot
    values = {**_ENV_CACHE[1], **dict(overrides)}
    value = CompileOptions(**values, _source="partita options") if values else _DEFAULT
    if memo_key is not None:
        if len(_MEMO) > 256:
            _MEMO.clear()
        _MEMO[memo_key] = value
    return value


_DEFAULT = CompileOptions()


@contextlib.contextmanager
def using(**changes: Any) -> Iterator[CompileOptions]:
    """Set options for a block (per thread and per asyncio task); yields the new value.

    >>> with using(inductor=True) as options:
    ...     options.inductor
    True
    """
    _check_names(changes, "partita.options.using")
    token = _OVERRIDES.set((*_OVERRIDES.get(), *changes.items()))
    try:
        yield current()  # validates the values now, not at the first compile
    finally:
        _OVERRIDES.reset(token)


def resolve(options: CompileOptions | Mapping[str, Any] | None = None) -> CompileOptions:
    """The options of one call: a full ``CompileOptions`` is taken as is; a mapping changes
    the current value (``{"strict": True}``); None is the current value."""
    if options is None:
        return current()
    if isinstance(options, CompileOptions):
        return options
    if isinstance(options, Mapping):
        return current().replace(**options)
    raise OptionError(
        f"options={options!r}: expected a partita.CompileOptions, a dict of option names to "
        f"values, or None. The options are: {', '.join(_BY_NAME)}."
    )
