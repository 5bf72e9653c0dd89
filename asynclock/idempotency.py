"""The rules of idempotency keys, for integrations and your own glue (docs/idempotency.md).

``backend.idempotent(...)`` applies them; this module gives them to code that declares
idempotent operations of its own (the Celery and FastAPI integrations use nothing else),
so every door checks a key, a ``keep``, a fingerprint and a result the same way:

* :func:`check_key`, :data:`MAX_KEY_BYTES`: a key is a str of 1 to 255 UTF-8 bytes,
  without NUL or lone surrogates;
* :func:`check_keep`, :data:`MIN_KEEP`, :data:`MAX_KEEP`, :data:`DEFAULT_KEEP`: a record
  is kept 1 second to 30 days after its last write, 24 hours by default;
* :func:`check_store_errors`: the errors stored and replayed, a tuple of Exception classes;
* :func:`canonical_json`, :func:`fingerprint_of`, :data:`MAX_DEPTH`: the canonical JSON
  (sorted keys, no whitespace, ASCII) a fingerprint is hashed from; dicts with str keys,
  at most 100 levels deep, else a TypeError / ValueError;
* :func:`encode_result`, :data:`MAX_RESULT_BYTES`: what a stored result may be (the same
  JSON, at most 64 KiB);
* :class:`KeyedCalls` with :func:`arguments_of`: a function's calls keyed by a template of
  their arguments (or a hash of them all) and fingerprinted by some of them, checked where
  the function is declared.
"""

from ._core.idempotency_rules import (
    DEFAULT_KEEP,
    MAX_DEPTH,
    MAX_KEEP,
    MAX_KEY_BYTES,
    MAX_RESULT_BYTES,
    MIN_KEEP,
    KeyedCalls,
    arguments_of,
    canonical_json,
    check_keep,
    check_key,
    check_store_errors,
    encode_result,
    fingerprint_of,
)

__all__ = (
    "DEFAULT_KEEP",
    "MAX_DEPTH",
    "MAX_KEEP",
    "MAX_KEY_BYTES",
    "MAX_RESULT_BYTES",
    "MIN_KEEP",
    "KeyedCalls",
    "arguments_of",
    "canonical_json",
    "check_keep",
    "check_key",
    "check_store_errors",
    "encode_result",
    "fingerprint_of",
)
