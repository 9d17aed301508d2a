"""Prefill/decode disaggregation's edges (JSON over HTTP): the router's order to a prefill replica,
its report, and a decode replica's receipt for the KV blocks it was sent (``server/api/pd.py``; the
blocks themselves travel in the disk tier's format, ``memory/kv_transfer.py``)."""

from __future__ import annotations

from typing import Literal

import msgspec

PREFILL_PATH = "/v1/pd/prefill"  # on a prefill replica: compute a prompt's KV and send it on
KV_PATH = "/v1/pd/kv"  # on a decode replica: receive KV blocks into its disk tier
PD_PATHS = ("/v1/chat/completions", "/v1/completions")  # requests whose prompt can be prefilled elsewhere
# The router's id of one request's hand-over: on the KV stream (prefill → decode replica) and on the
# request itself when the router sends it to the decode replica, which first lets that id's streams
# end (a stream cut by a dying prefill replica may still be publishing blocks it received).
TRANSFER_HEADER = "x-tripod-pd-transfer"


class PrefillOrder(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Router → prefill replica: the client's request (``body``, the bytes of an OpenAI request to
    ``path``) and the decode replica that will answer it."""

    path: Literal["/v1/chat/completions", "/v1/completions"]
    body: msgspec.Raw
    decode_url: str
    transfer_id: str = ""  # sent on as TRANSFER_HEADER with the KV stream


class KVReceipt(msgspec.Struct, kw_only=True):
    """Decode replica → prefill replica: what it verified (``blocks``, ``bytes``) and how many of
    them were new in its tier (``published``)."""

    blocks: int
    published: int
    bytes: int


class PrefillDone(msgspec.Struct, kw_only=True):
    """Prefill replica → router: the prompt(s) prefilled and handed over."""

    prompt_tokens: int
    blocks: int  # sent
    accepted: int  # verified by the decode replica (== blocks unless it refused part-way)
    published: int
    bytes: int
    prefill_seconds: float  # computing the prompt's KV
    export_seconds: float  # copying it out of the pool and encoding it (the engine loop)
    transfer_seconds: float  # sending it until the decode replica's receipt


def decode_order(raw: bytes) -> PrefillOrder:
    """An order, validated (``msgspec.ValidationError``/``DecodeError`` for a bad one)."""
    return msgspec.json.decode(raw, type=PrefillOrder)


def encode(msg: PrefillOrder | KVReceipt | PrefillDone) -> bytes:
    return msgspec.json.encode(msg)


def decode_receipt(raw: bytes) -> KVReceipt:
    return msgspec.json.decode(raw, type=KVReceipt)


def decode_done(raw: bytes) -> PrefillDone:
    return msgspec.json.decode(raw, type=PrefillDone)
