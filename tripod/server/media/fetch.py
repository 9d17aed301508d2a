"""Image URLs fetched over HTTP, only from the hosts the operator allowed.

A server that fetches whatever URL a request names can be made to reach anything its network
reaches (SSRF). So nothing is fetched unless ``--allowed-media-domains`` lists the URL's host
(exactly, or ``*.name`` for name's subdomains); redirects are followed by hand, each hop checked
against the same list, at most ``MAX_REDIRECTS``; the body is read up to ``--max-image-bytes``
(a ``Content-Length`` past it is refused before the body is read) and the whole fetch, redirects
and a slow body included, gets ``--media-fetch-timeout`` seconds. Every refusal is a 400 that
names the request's part and what to change (``sources.ImageError``).
"""

from __future__ import annotations

import asyncio

import httpx

from tripod.server.media.sources import ImageError, too_large

MAX_REDIRECTS = 5
_REDIRECTS = (301, 302, 303, 307, 308)


def host_allowed(host: str, patterns: tuple[str, ...]) -> bool:
    """Whether ``host`` (lower case) is one of ``patterns``: a name, or ``*.name`` (its subdomains)."""
    for p in patterns:
        if p.startswith("*."):
            if host.endswith(p[1:]) and len(host) > len(p) - 1:
                return True
        elif host == p:
            return True
    return False


class MediaFetcher:
    """Owns the HTTP client image URLs are fetched with (made on first use, on the server's event
    loop; ``close`` at shutdown) and the rules they are fetched under (module docstring)."""

    def __init__(self, hosts: tuple[str, ...], max_bytes: int, timeout: float) -> None:
        self.hosts = hosts
        self.max_bytes = max_bytes
        self.timeout = timeout
        self._client: httpx.AsyncClient | None = None

    def check(self, url: str, param: str, via: str | None = None) -> httpx.URL:
        """``url`` parsed, or an ``ImageError`` when it may not be fetched (``via``: the URL that redirected to it)."""
        try:
            u = httpx.URL(url)
        except httpx.InvalidURL as e:
            raise ImageError(f"'{param}': {url[:80]!r} is not a valid URL ({e})", param, "invalid_image_url") from None
        came = f" (redirected to from {via})" if via is not None else ""
        if u.scheme not in ("http", "https") or not u.host:
            raise ImageError(f"'{param}': {str(u)[:200]}{came} is not an http(s) URL", param, "image_url_not_allowed")
        if not self.hosts:
            raise ImageError(f"'{param}': this server fetches no image URLs (it was started without "
                             "--allowed-media-domains); send the image inline as a data: URL "
                             "(data:image/png;base64,...)", param, "image_url_not_allowed")
        if not host_allowed(u.host.lower(), self.hosts):
            raise ImageError(f"'{param}': the host {u.host!r}{came} is not one this server fetches images from "
                             f"(--allowed-media-domains {','.join(self.hosts)}); send the image inline as a data: "
                             "URL, or from an allowed host", param, "image_url_not_allowed")
        return u

    async def fetch(self, url: str, param: str) -> bytes:
        """The bytes behind ``url`` (checked, redirects followed), or an ``ImageError``."""
        target = self.check(url, param)
        try:
            async with asyncio.timeout(self.timeout):
                for _ in range(MAX_REDIRECTS + 1):
                    data, location = await self._get(target, param)
                    if location is None:
                        assert data is not None
                        return data
                    target = self.check(str(target.join(location)), param, via=str(target))
        except TimeoutError:
            raise ImageError(f"'{param}': fetching {url[:200]} took longer than {self.timeout:g} s "
                             "(--media-fetch-timeout); send the image inline as a data: URL, or from a faster host",
                             param, "image_fetch_failed") from None
        except httpx.HTTPError as e:
            raise ImageError(f"'{param}': fetching {url[:200]} failed ({type(e).__name__}: {e}); check the URL, or "
                             "send the image inline as a data: URL", param, "image_fetch_failed") from None
        raise ImageError(f"'{param}': {url[:200]} redirects more than {MAX_REDIRECTS} times; send the final URL",
                         param, "image_fetch_failed")

    async def _get(self, url: httpx.URL, param: str) -> tuple[bytes | None, str | None]:
        """One GET: (the body, None), or (None, the Location it redirects to)."""
        async with self.client.stream("GET", url) as r:
            if r.status_code in _REDIRECTS and "location" in r.headers:
                return None, r.headers["location"]
            if r.status_code != 200:
                raise ImageError(f"'{param}': fetching {str(url)[:200]} answered HTTP {r.status_code}; check the URL",
                                 param, "image_fetch_failed")
            declared = r.headers.get("content-length")
            if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
                raise too_large(param, int(declared), self.max_bytes)
            body = bytearray()
            async for chunk in r.aiter_raw():
                body += chunk
                if len(body) > self.max_bytes:
                    raise too_large(param, len(body), self.max_bytes)
            return bytes(body), None

    @property
    def client(self) -> httpx.AsyncClient:
        if self._client is None:
            # NOTE: redirects by hand (each hop checked); identity encoding, so the byte limit is
            # the bytes that arrive (images are compressed already; a gzip body could expand).
            self._client = httpx.AsyncClient(
                follow_redirects=False, timeout=httpx.Timeout(self.timeout),
                headers={"accept": "image/*", "accept-encoding": "identity", "user-agent": "tripod"},
                limits=httpx.Limits(max_connections=64, max_keepalive_connections=8))
        return self._client

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None
