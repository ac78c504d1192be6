"""Who may act: the operator's token, a signed session cookie, a CSRF field and an Origin check.

Actions (cancel, retry or delete a dead letter) exist only with
`--allow-actions`. Then a request acts when

- it carries the token itself in the `X-Dashboard-Token` header or as
  `Authorization: Bearer <token>` (scripts: a browser cannot add either header
  to a cross-site request without a CORS preflight, which this app never
  grants), or
- it comes from a browser session that logged in with the token: the session
  cookie (HttpOnly, SameSite=Strict) and the form field `csrf` derived from it
  both check out;

and, in both cases, an `Origin` (or, without one, a `Referer`) it sends names
this dashboard itself, and `Sec-Fetch-Site`, when sent, is not cross-site.
A form on another site can make the browser send the cookie (SameSite aside,
in older browsers) but can neither read the `csrf` value nor forge Origin.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from urllib.parse import urlsplit

from starlette.requests import Request

COOKIE = "dps_session"
CSRF_FIELD = "csrf"
TOKEN_HEADER = "x-dashboard-token"
# A shorter token is refused at start: it could be guessed through the login form.
MIN_TOKEN_LENGTH = 16


class Guard:
    """Checks action requests against the token; None token: actions are off."""

    def __init__(self, token: str | None) -> None:
        self.token = token
        # Per process: a restart logs every browser out, which is what an operator expects.
        self._key = secrets.token_bytes(32)

    @property
    def enabled(self) -> bool:
        return self.token is not None

    def _sign(self, purpose: str, nonce: str) -> str:
        return hmac.new(self._key, f"{purpose}:{nonce}".encode(), hashlib.sha256).hexdigest()

    @staticmethod
    def presented_token(request: Request) -> str | None:
        """The token a script sent (X-Dashboard-Token, or Authorization: Bearer), None without one."""
        header = request.headers.get(TOKEN_HEADER)
        if header is not None:
            return header
        scheme, _, credentials = request.headers.get("authorization", "").partition(" ")
        return credentials.strip() if scheme.lower() == "bearer" else None

    def token_matches(self, given: str) -> bool:
        return self.token is not None and hmac.compare_digest(given.encode(), self.token.encode())

    def new_session(self) -> str:
        """A session cookie value for a browser that just gave the token."""
        nonce = secrets.token_hex(16)
        return f"{nonce}.{self._sign('session', nonce)}"

    def _session_nonce(self, request: Request) -> str | None:
        value = request.cookies.get(COOKIE, "")
        nonce, _, mac = value.partition(".")
        # A cookie that does not parse is no session, never an error: any page on this host
        # (another app on 127.0.0.1) can set it, and compare_digest refuses non-ASCII str.
        if not nonce or not value.isascii():
            return None
        if not hmac.compare_digest(mac.encode(), self._sign("session", nonce).encode()):
            return None
        return nonce

    def logged_in(self, request: Request) -> bool:
        return self.enabled and self._session_nonce(request) is not None

    def csrf_for(self, request: Request) -> str:
        """The form field value that goes with this browser's session ('' without one)."""
        nonce = self._session_nonce(request)
        return "" if nonce is None else self._sign("csrf", nonce)

    def same_origin(self, request: Request) -> bool:
        """True when the request says it comes from a page of this dashboard."""
        if request.headers.get("sec-fetch-site", "same-origin") not in ("same-origin", "none"):
            return False
        own = f"{request.url.scheme}://{request.headers.get('host', '')}"
        origin = request.headers.get("origin")
        if origin is None:
            referer = request.headers.get("referer")
            if referer is None:
                # No browser sends a form POST with neither; a script gave the header token.
                return self.presented_token(request) is not None
            parts = urlsplit(referer)
            origin = f"{parts.scheme}://{parts.netloc}"
        return origin == own

    def allows(self, request: Request, form_csrf: str) -> bool:
        """May this request act? (see the module's docstring)"""
        if not self.enabled or not self.same_origin(request):
            return False
        header = self.presented_token(request)
        if header is not None:
            return self.token_matches(header)
        expected = self.csrf_for(request)
        return bool(expected) and hmac.compare_digest(form_csrf.encode(), expected.encode())
