"""The rules of idempotency keys, stated once: what a key, a fingerprint and a stored result
may be, how long a record is kept, how a call's arguments name its key. The state machine
(``idempotency.py``) and every integration (``asynclock.idempotency`` is the public door)
apply these; none writes them again.
"""

from __future__ import annotations

import hashlib
import inspect
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .templates import NameTemplate
from .validation import RESERVED_PREFIX, check_seconds

#: The lock name of key ``k`` is ``KEY_NAMESPACE + k`` (each ``/`` written as NUL: see
#: :func:`lock_name`); no user lock can take a name in it.
KEY_NAMESPACE = RESERVED_PREFIX + "idempotency:"
#: The longest key, in UTF-8 bytes (Stripe's limit, in characters, for ASCII keys).
MAX_KEY_BYTES = 255
#: The largest result, as its encoded JSON (ASCII) in bytes: 64 KiB.
MAX_RESULT_BYTES = 64 * 1024
#: The deepest nesting of lists and dicts a result or fingerprint may have (Ruby's JSON
#: ``max_nesting``): deeper values are refused with ValueError before anything is stored
#: (JSON encoders and decoders recurse, and a replay must decode what was stored).
MAX_DEPTH = 100
#: How long a record may be kept, in seconds: 1 s to 30 days; 24 h by default (Stripe's).
MIN_KEEP, MAX_KEEP, DEFAULT_KEEP = 1.0, 30 * 86400.0, 86400.0
#: A stored failure's message is cut to this many characters.
MAX_MESSAGE = 4096

_ALLOWED_KEY = f"a str of 1 to {MAX_KEY_BYTES} UTF-8 bytes, without NUL or lone surrogates"
_JSON = "dicts with str keys, lists, str, int, finite float, bool, None"


# -- keys ----------------------------------------------------------------------------------


def check_key(key: object) -> str:
    """``key`` if it is a valid idempotency key, else TypeError/ValueError saying why."""
    if not isinstance(key, str):
        raise TypeError(
            f"idempotency key must be a str, not {type(key).__name__}: use {_ALLOWED_KEY}"
        )
    if not key:
        raise ValueError(f"idempotency key must not be empty: use {_ALLOWED_KEY}")
    nul = key.find("\x00")
    if nul >= 0:
        raise ValueError(f"idempotency key has a NUL character at index {nul}: use {_ALLOWED_KEY}")
    try:
        size = len(key.encode("utf-8"))
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"idempotency key has a lone surrogate {key[exc.start]!r} at index {exc.start}: "
            f"use {_ALLOWED_KEY}"
        ) from None
    if size > MAX_KEY_BYTES:
        raise ValueError(f"idempotency key is {size} UTF-8 bytes long: use {_ALLOWED_KEY}")
    return key


def lock_name(key: str) -> str:
    """The lock name that guards idempotency key ``key``, in asynclock's own namespace.

    Each ``/`` of the key is written as NUL (which no key may contain, so the mapping is
    one-to-one and no longer than the key): a lock name without ``/`` is never a path
    prefix of another one where a backend lays names out as paths (etcd keys
    ``<name>/<lease>``, ZooKeeper nodes), so key ``a`` and key ``a/b`` never meet.
    """
    return KEY_NAMESPACE + key.replace("/", "\x00")


def legacy_lock_name(key: str) -> str | None:
    """The name earlier builds used for ``key`` where it differs (a key with ``/``), else
    None: the done and failed records kept there are still replayed (``Idempotent._get``)."""
    return KEY_NAMESPACE + key if "/" in key else None


def hashed_key(prefix: str, value: object) -> str:
    """A key for ``value`` (a call's arguments): ``prefix`` and the first 32 hex digits of
    the sha256 of its canonical JSON, or, if ``prefix`` makes it longer than
    :data:`MAX_KEY_BYTES`, ``"task:"`` and a sha256 of that."""
    digest = hashlib.sha256(canonical_json(value, "arguments").encode()).hexdigest()[:32]
    key = f"{prefix}:{digest}"
    if len(key.encode("utf-8", "surrogatepass")) > MAX_KEY_BYTES:
        key = "task:" + hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()
    return key


# -- options ---------------------------------------------------------------------------------


def check_keep(keep: object, what: str = "keep") -> float:
    """``keep`` in seconds if it is within :data:`MIN_KEEP` .. :data:`MAX_KEEP`."""
    f = check_seconds(keep, what)
    if not (MIN_KEEP <= f <= MAX_KEEP):
        raise ValueError(
            f"{what} must be between {MIN_KEEP:g} second and {MAX_KEEP:g} seconds (30 days), "
            f"got {keep!r}: past 30 days, keep a unique constraint in your own table "
            "(docs/idempotency.md)"
        )
    return f


def check_store_errors(
    store_errors: object, what: str = "store_errors"
) -> tuple[type[Exception], ...]:
    """``store_errors`` as a tuple of Exception subclasses (one class is taken as a tuple)."""
    if isinstance(store_errors, type):
        store_errors = (store_errors,)
    if not isinstance(store_errors, tuple) or not all(
        isinstance(t, type) and issubclass(t, Exception) for t in store_errors
    ):
        raise TypeError(
            f"{what} must be a tuple of Exception subclasses (the errors stored and "
            f"replayed instead of retried), got {store_errors!r}"
        )
    return store_errors


def check_fingerprint_names(names: object, what: str = "fingerprint") -> tuple[str, ...] | None:
    """Argument names (a tuple or list of str), or None (every argument)."""
    if names is None:
        return None
    if isinstance(names, str) or not (
        isinstance(names, (tuple, list)) and all(isinstance(n, str) for n in names)
    ):
        raise TypeError(
            f"{what} must be a tuple of argument names, e.g. ('amount', 'currency'), got {names!r}"
        )
    return tuple(names)


# -- JSON ------------------------------------------------------------------------------------


_NONE = object()


def _path(trail: tuple[Any, ...] | None) -> str:
    steps: list[str] = []
    while trail is not None:
        trail, step = trail
        steps.append(f"[{step!r}]")
    return "".join(reversed(steps))


def check_json_shape(
    value: object, what: str, *, root: str = "value", max_items: int | None = None
) -> None:
    """Refuse what JSON would change or cannot nest: a dict key that is not a str (JSON
    turns ``1`` into ``"1"``, so ``{1: "a", "1": "b"}`` would come back with one entry)
    is a TypeError; lists and dicts nested deeper than :data:`MAX_DEPTH` a ValueError. No
    recursion, so no RecursionError however deep ``value`` is. ``max_items``: more values
    than that is a ValueError too (a result that cannot fit, refused without walking it
    all). Other types are left to ``json.dumps``. Messages name ``what`` and the place in
    it (``root[0]['a']``)."""
    stack: list[tuple[object, int, tuple[Any, ...] | None]] = [(value, 0, None)]
    seen = 0
    while stack:
        item, depth, trail = stack.pop()
        if isinstance(item, dict):
            bad = next((k for k in item if not isinstance(k, str)), _NONE)
            if bad is not _NONE:
                raise TypeError(
                    f"{what} has a dict key {bad!r} ({type(bad).__name__}) in "
                    f"{root}{_path(trail)}: JSON keys are str, so it would not come back "
                    f"as it was; use str keys ({_JSON})"
                )
            children: Any = item.items()
        elif isinstance(item, (list, tuple)):
            children = enumerate(item)
        else:
            continue
        if depth >= MAX_DEPTH:
            raise ValueError(
                f"{what} nests lists and dicts more than {MAX_DEPTH} levels deep (at "
                f"{root}{_path(trail)[:80]}...); at most {MAX_DEPTH} can be stored"
            )
        seen += len(item)
        if max_items is not None and seen > max_items:
            raise ValueError(
                f"{what} has more than {max_items} values, more than can be stored: store "
                "a reference to it instead"
            )
        for k, v in children:
            if isinstance(v, (dict, list, tuple)):
                stack.append((v, depth + 1, (trail, k)))


def canonical_json(value: object, what: str) -> str:
    """``value`` as canonical JSON (sorted keys, no whitespace, ASCII, finite numbers),
    or TypeError (a value JSON cannot hold as it is) / ValueError (nested too deep)."""
    check_json_shape(value, what, root=what)
    try:
        return json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"{what} must be JSON-serialisable ({_JSON}): {exc}") from None


def fingerprint_of(value: object) -> str | None:
    """A stable hash of ``value`` (sha256 of its canonical JSON), or None for None."""
    if value is None:
        return None
    return hashlib.sha256(canonical_json(value, "fingerprint").encode()).hexdigest()


def encode_result(key: str, result: object) -> str:
    """``result`` as the JSON text stored for ``key``: TypeError if JSON cannot hold it as
    it is (a type it has no form for, a dict key that is not a str, a NaN), ValueError if
    larger than :data:`MAX_RESULT_BYTES` or nested deeper than :data:`MAX_DEPTH`."""
    what = f"the result of idempotent operation {key!r}"
    # Every value takes at least one byte of JSON: a result with more values cannot fit,
    # and is refused before it is walked or encoded in full.
    check_json_shape(result, what, root="result", max_items=MAX_RESULT_BYTES)
    try:
        text = json.dumps(result, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise TypeError(
            f"{what} cannot be stored: it must be JSON-serialisable ({_JSON}): {exc}"
        ) from None
    if len(text) > MAX_RESULT_BYTES:  # ASCII JSON: one byte per character
        raise ValueError(
            f"{what} is {len(text)} bytes as JSON; at most {MAX_RESULT_BYTES} (64 KiB) can "
            "be stored: store a reference to it instead"
        )
    return text


# -- a function's calls ----------------------------------------------------------------------


def arguments_of(
    func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> dict[str, Any]:
    """The arguments of the call ``func(*args, **kwargs)`` by name: defaults applied,
    ``**kwargs`` flattened (``*args`` stay a tuple under their name), as
    :meth:`NameTemplate.format_call` binds them. TypeError if the call does not fit."""
    signature = inspect.signature(func)
    bound = signature.bind(*args, **kwargs)
    bound.apply_defaults()
    arguments = dict(bound.arguments)
    for param in signature.parameters.values():
        if param.kind is param.VAR_KEYWORD and param.name in arguments:
            arguments.update(arguments.pop(param.name))
    return arguments


@dataclass(frozen=True)
class KeyedCalls:
    """How each call of a function is keyed and its record kept, checked where it is
    declared: ``backend.idempotent_function``, Celery's idempotent tasks.

    ``template`` names the key from the call's arguments (None: a hash of them all, see
    :meth:`key`); ``fingerprint`` names the arguments whose values must match for a replay
    (None: all of them; ``()``: none).
    """

    template: NameTemplate | None
    fingerprint: tuple[str, ...] | None
    keep: float
    store_errors: tuple[type[Exception], ...]

    @classmethod
    def declare(
        cls,
        key: str | None,
        *,
        fingerprint: object,
        keep: object = DEFAULT_KEEP,
        store_errors: object = (),
        names: tuple[str, str, str] = ("fingerprint", "keep", "store_errors"),
    ) -> KeyedCalls:
        """The options as declared, checked (``names``: how the caller spells the
        fingerprint, keep and store_errors options in its messages)."""
        return cls(
            None if key is None else NameTemplate(key),
            check_fingerprint_names(fingerprint, names[0]),
            check_keep(keep, names[1]),
            check_store_errors(store_errors, names[2]),
        )

    def check_function(
        self, func: Callable[..., Any], what: str | None = None, option: str = "fingerprint"
    ) -> None:
        """TypeError if the template or the fingerprint (the ``option`` so spelled) names an
        argument ``func`` (``what``) does not take (any name, with ``**kwargs``)."""
        label = what or f"{getattr(func, '__qualname__', func)!s}()"
        if self.template is not None:
            self.template.check_callable(func, what=label)
        params = inspect.signature(func).parameters
        missing = [n for n in self.fingerprint or () if n not in params]
        if missing and not any(p.kind is p.VAR_KEYWORD for p in params.values()):
            raise TypeError(f"{option} names {', '.join(missing)}, which {label} does not take")

    def key(self, arguments: dict[str, Any], default: str = "") -> str:
        """The key of a call with these ``arguments``: the template formatted, or ``default``
        and a hash of all the arguments (:func:`hashed_key`)."""
        if self.template is not None:
            return self.template.format(arguments)
        return hashed_key(default, arguments)

    def fingerprint_of(self, arguments: dict[str, Any]) -> dict[str, Any] | None:
        """The fingerprint of a call with these ``arguments`` (what
        ``backend.idempotent(fingerprint=...)`` takes), or None (nothing compared)."""
        if self.fingerprint is None:
            return arguments
        if not self.fingerprint:
            return None
        return {n: arguments.get(n) for n in self.fingerprint}
