"""Images in requests (issue 38): where they come from (``sources``: data URLs, base64, http(s)
URLs as ``ImageRef``s, and the 400s they can cause), how URLs are fetched (``fetch``: only from
``--allowed-media-domains``, bounded in bytes and time), how bytes become pictures (``decode``:
format sniffed, decompression bombs refused), a request's images loaded together (``loader``), and
a conversation with images rendered into prompt ids plus the engine's ``ImageInput``s (``prompt``).
"""
