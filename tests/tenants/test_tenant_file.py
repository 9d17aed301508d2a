"""The tenants file: strict validation (the line and the reason), keys kept as digests, the key →
tenant lookup, the plain --api-key beside the file, and live reloads (good, bad, rotation)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from tripod.tenants import DEFAULT_TENANT, TenantFileError, TenantRegistry, parse_tenants

GOOD = """\
[[tenant]]
name = "acme"
keys = ["sk-acme-1"]
weight = 2.0
requests_per_second = 5
input_tokens_per_minute = 200000
output_tokens_per_minute = 20000
max_concurrent = 8
max_context = 4096
models = ["SmolLM2-135M-Instruct"]

[[tenant]]
name = "globex"
key_sha256 = ["{digest}"]
"""


def good_text() -> str:
    return GOOD.replace("{digest}", hashlib.sha256(b"sk-globex").hexdigest())


def test_a_good_file() -> None:
    f = parse_tenants(good_text())
    acme = f.tenants["acme"]
    assert acme.weight == 2.0 and acme.requests_per_second == 5 and acme.max_context == 4096
    assert acme.models == ("SmolLM2-135M-Instruct",) and acme.output_tokens_per_minute == 20000
    g = f.tenants["globex"]
    assert g.weight == 1.0 and g.max_concurrent is None and g.models is None
    assert sorted(name for _, name in f.keys) == ["acme", "globex"]
    assert all(len(d) == 32 for d, _ in f.keys)  # digests, never the keys


@pytest.mark.parametrize(("text", "line", "reason"), [
    ('[[tenant]]\nname = "a"\nkeys = ["k"]\nburst = 3\n', 4, "unknown key 'burst'"),
    ('[[tenant]]\nname = "a"\nkeys = ["k"]\nmax_concurrent = "8"\n', 4, "max_concurrent must be an integer"),
    ('[[tenant]]\nname = "a"\nkeys = ["k"]\nmax_concurrent = true\n', 4, "max_concurrent must be an integer"),
    ('[[tenant]]\nname = "a"\nkeys = ["k"]\n\n[[tenant]]\nname = "b"\nkeys = ["j"]\n'
     'output_tokens_per_minute = -5\n', 8, "output_tokens_per_minute must be >= 1"),
    ('[[tenant]]\nname = "a"\nkeys = ["k"]\nrequests_per_second = -1.5\n', 4, "requests_per_second must be > 0"),
    ('[[tenant]]\nname = "a"\nkeys = ["k"]\nweight = 0\n', 4, "weight must be > 0"),
    ('[[tenant]]\nname = "a"\nkeys = ["k"]\n\n[[tenant]]\nname = "a"\nkeys = ["j"]\n', 6, "defined twice"),
    ('[[tenant]]\nname = "a"\nkeys = ["k"]\n\n[[tenant]]\nname = "b"\nkeys = ["k"]\n', 7, "already has"),
    ('[[tenant]]\nname = "a"\n', 2, "has no key"),
    ('[[tenant]]\nname = "a"\nkey_sha256 = ["abc"]\n', 3, "64 hex digits"),
    ('[[tenant]]\nname = "a"\nkeys = "k"\n', 3, "keys must be a list"),
    ('[[tenant]]\nname = "a"\nkeys = ["k"]\nmodels = [1]\n', 4, "models must be a list"),
    ('[[tenant]]\nname = "a"\nkeys = ["k"\n', 3, "not valid TOML"),
    ('[tenant]\nname = "a"\n', 1, "array of tables"),
    ('[[tenant]]\nkeys = ["k"]\n', 1, "needs a 'name'"),
])
def test_invalid_files_name_the_line_and_the_reason(text: str, line: int, reason: str) -> None:
    with pytest.raises(TenantFileError) as e:
        parse_tenants(text, "t.toml")
    assert str(e.value).startswith(f"t.toml:{line}: "), str(e.value)
    assert reason in str(e.value)
    assert "\n" not in str(e.value)


def test_lookup_by_key_and_the_plain_key(tmp_path: Path) -> None:
    p = tmp_path / "t.toml"
    p.write_text(good_text())
    r = TenantRegistry(str(p), api_key="sk-admin")
    acme = r.identify("sk-acme-1")
    assert acme is not None and acme.tenant.name == "acme"
    assert acme.key_id == hashlib.sha256(b"sk-acme-1").hexdigest()[:12]
    globex = r.identify("sk-globex")
    assert globex is not None and globex.tenant.name == "globex"
    admin = r.identify("sk-admin")
    assert admin is not None and admin.tenant.name == DEFAULT_TENANT and admin.tenant.max_concurrent is None
    assert r.identify("sk-nope") is None and r.identify(None) is None and r.identify("") is None
    # Without any key: open, every request is default's (today's behaviour).
    assert TenantRegistry(None, None).identify(None) is not None


def test_the_plain_key_takes_a_default_tenant_of_the_file(tmp_path: Path) -> None:
    p = tmp_path / "t.toml"
    p.write_text('[[tenant]]\nname = "default"\nkeys = ["sk-d"]\nmax_concurrent = 2\n')
    ident = TenantRegistry(str(p), api_key="sk-admin").identify("sk-admin")
    assert ident is not None and ident.tenant.max_concurrent == 2
    with pytest.raises(TenantFileError, match="api-key is also"):
        TenantRegistry(str(p), api_key="sk-d")


def test_reload_rotates_keys_and_keeps_the_last_good_file(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    p = tmp_path / "t.toml"
    p.write_text('[[tenant]]\nname = "a"\nkeys = ["old"]\n')
    r = TenantRegistry(str(p), None)
    assert r.identify("old") is not None and r.identify("new") is None
    # Rotation: the new key works and the revoked one is refused from the very next lookup.
    p.write_text('[[tenant]]\nname = "a"\nkeys = ["new", "newer"]\n')
    assert r.poll() is True
    assert r.identify("new") is not None and r.identify("old") is None
    # An invalid file: refused, logged with its line, the last good table kept.
    p.write_text('[[tenant]]\nname = "a"\nkeys = ["new"]\nmax_concurrent = 0\n')
    os.utime(p, ns=(1, 1))  # NOTE: a different stamp even on a coarse-mtime file system
    assert r.poll() is False
    assert "max_concurrent must be >= 1" in caplog.text and f"{p}:4" in caplog.text
    assert "newer" not in caplog.text and "\"new\"" not in caplog.text  # keys are never logged
    assert r.identify("newer") is not None
    assert r.poll() is False  # unchanged since: not read again
    assert (r.reloads, r.reload_failures) == (1, 1)
    assert r.reload("SIGHUP") is False and r.reload_failures == 2
