"""One translation of a driver library's errors into :class:`BackendUnavailable`.

Every driver builds one mapper with :func:`map_errors` and lets it turn whatever its
library raises into a ``BackendUnavailable`` whose message names the backend (its
``display``, never a password) and says what failed, with the password scrubbed from the
library's own text (a library may echo a DSN or an AUTH argument back).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from .exceptions import AsynclockError, BackendUnavailable

#: A driver's own reading of one of its library's errors (e.g. "authentication failed:
#: check the password"), or None to say the error as it is.
Explain = Callable[[BaseException], "str | None"]


class ErrorMapper:
    """See :func:`map_errors`."""

    __slots__ = ("_explain", "_secrets", "display")

    def __init__(self, display: str, secrets: tuple[str, ...], explain: Explain | None) -> None:
        self.display = display
        self._secrets = secrets
        self._explain = explain

    def scrub(self, text: str) -> str:
        """``text`` with every secret replaced by ``***``."""
        for secret in self._secrets:
            text = text.replace(secret, "***")
        return text

    def detail(self, exc: BaseException) -> str:
        """What went wrong, in words, without a secret."""
        explained = self._explain(exc) if self._explain is not None else None
        if explained is None:
            explained = str(exc) or type(exc).__name__
        return self.scrub(explained)

    def unavailable(self, what: str, exc: BaseException) -> BackendUnavailable:
        """``exc`` as ``BackendUnavailable("<display>: <what>: <detail>")``.

        An asynclock error is returned as it is (it is already translated).
        """
        if isinstance(exc, BackendUnavailable):
            return exc
        return BackendUnavailable(f"{self.display}: {what}: {self.detail(exc)}")

    @contextmanager
    def __call__(self, what: str) -> Iterator[None]:
        """``with errors("acquire failed"):`` raises what the body's library raised as
        :meth:`unavailable` (asynclock's own errors and cancellation pass through)."""
        try:
            yield
        except AsynclockError:
            raise
        except Exception as exc:
            raise self.unavailable(what, exc) from exc


def map_errors(
    display: str, secret: str | None = None, *, explain: Explain | None = None
) -> ErrorMapper:
    """The error mapper of one driver: ``display`` names it in messages; ``secret`` (a
    password) never appears in them; ``explain`` reads the library's errors the driver
    knows (return None for the rest)."""
    return ErrorMapper(display, (secret,) if secret else (), explain)
