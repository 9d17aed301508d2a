"""The RL control surface through a real ``tripod serve --enable-rl-api`` (server/api/rl.py,
engine/rl_control.py): weight updates from a folder and from safetensors bytes (greedy tokens then
equal the HF model of those weights), applied only when no request is in flight (a request that
runs across an update finishes on the old weights); bad tensors refused with nothing applied;
pause abort / wait / keep and continue (keep resumes token for token); aborts by id; sleep gives
the KV pool's pages back to the OS (the engine's RSS drops) and a request while asleep gets 503;
without the flag the routes do not exist, and with --api-key they need it."""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
import torch
from safetensors.torch import save as save_safetensors

from tests.conftest import HFReference
from tests.support.server_helpers import ServerProcess
from tests.support.tiny_models import VOCAB, build_hf, save
from tripod.fleet.process import free_port

KEY = "sk-rl"
POOL_TOKENS = 262144  # a pool large enough that its pages dominate what sleep gives back
N = 16


def _model(seed: int, tokenizer: Any) -> Any:
    """A tiny llama with the tokenizer's whole vocabulary, so chat-templated prompts (the Responses
    and Anthropic surfaces) are in range too."""
    return build_hf("llama", seed=seed, vocab_size=len(tokenizer))


@pytest.fixture(scope="module")
def rl(tmp_path_factory: pytest.TempPathFactory, hf_tokenizer: Any) -> Any:
    tmp = tmp_path_factory.mktemp("rl-serve")
    models = {k: _model(s, hf_tokenizer) for k, s in (("a", 3), ("b", 4))}
    folders = {k: save(m, tmp / k, hf_tokenizer) for k, m in models.items()}
    refs = {k: HFReference(m) for k, m in models.items()}
    srv = ServerProcess(tmp, "--model", str(folders["a"]), "--kv-cache-tokens", str(POOL_TOKENS), "--threads", "1",
                        "--enable-rl-api", api_key=KEY)
    yield srv, models, folders, refs
    srv.stop()


@pytest.fixture
def http(rl: Any) -> httpx.Client:
    return httpx.Client(base_url=rl[0].url, headers={"Authorization": f"Bearer {KEY}"}, timeout=120)


def _prompt(seed: int, n: int = 12) -> list[int]:
    return torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _complete(http: httpx.Client, prompt: list[int], n: int = N) -> dict[str, Any]:
    r = http.post("/v1/completions", json={"model": "a", "prompt": prompt, "max_tokens": n, "temperature": 0,
                                           "ignore_eos": True, "return_token_ids": True})
    assert r.status_code == 200, r.text
    return dict(r.json())


def _tokens(body: dict[str, Any]) -> list[int]:
    return list(body["choices"][0]["token_ids"])


def _in_background(fn: Callable[[], Any]) -> tuple[threading.Thread, list[Any]]:
    out: list[Any] = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    return t, out


def _wait_running(http: httpx.Client, n: int = 1) -> None:
    """Until the engine runs ``n`` sequences (the request has been admitted and is generating)."""
    for _ in range(2000):
        if http.get("/debug/engine").json()["running"] >= n:
            return
    raise AssertionError("the request never started running")


def _tensors(model: Any, **changed: torch.Tensor) -> bytes:
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    return save_safetensors({**state, **changed})


def _send(http: httpx.Client, data: bytes) -> httpx.Response:
    return http.post("/update_weights_from_tensor", content=data, headers={"Content-Type": "application/octet-stream"})


def _version(http: httpx.Client) -> int:
    return int(http.get("/v1/models").json()["data"][0]["weight_version"])


def test_updates_from_disk_and_tensors(rl: Any, http: httpx.Client, hf_tokenizer: Any) -> None:
    srv, models, folders, refs = rl
    p = _prompt(1)
    before = _complete(http, p)
    assert _tokens(before) == refs["a"].greedy(p, N).tokens
    v0 = before["weight_version"]
    assert v0 == _version(http)
    r = http.post("/update_weights_from_disk", json={"model_path": str(folders["b"])})
    assert r.status_code == 200, r.text
    assert r.json()["weight_version"] == v0 + 1 == _version(http)
    after = _complete(http, p)
    assert _tokens(after) == refs["b"].greedy(p, N).tokens and after["weight_version"] == v0 + 1
    assert srv.engine_stats()["kv_cached"] <= len(p) + N  # the prefix cache was flushed (only this prompt's KV)
    # A's weights as safetensors bytes (HF names): A's tokens again, over B's checkpoint.
    r = _send(http, _tensors(models["a"]))
    assert r.status_code == 200, r.text
    assert _tokens(_complete(http, p)) == refs["a"].greedy(p, N).tokens
    # Only some tensors (B's MLP of layer 1) over A: that mix is what runs.
    mix = _model(3, hf_tokenizer)
    names = [k for k in models["b"].state_dict() if k.startswith("model.layers.1.mlp.")]
    for k in names:
        mix.state_dict()[k].copy_(models["b"].state_dict()[k])
    r = _send(http, save_safetensors({k: models["b"].state_dict()[k].contiguous() for k in names}))
    assert r.status_code == 200 and r.json()["weight_version"] == v0 + 3
    assert _tokens(_complete(http, p)) == HFReference(mix).greedy(p, N).tokens
    assert http.post("/update_weights_from_disk", json={"model_path": str(folders["a"])}).status_code == 200


TRAINER = """
import sys, torch.distributed as dist
from safetensors.torch import load_file
port, path, names = int(sys.argv[1]), sys.argv[2], sys.argv[3:]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=2)
state = load_file(path)
for name in names:
    dist.broadcast(state[name].contiguous(), src=0)
dist.destroy_process_group()
"""


def test_update_over_a_gloo_group(rl: Any, http: httpx.Client, tmp_path: Path) -> None:
    """A trainer (rank 0, its own process) broadcasts B's tensors; tripod receives them over gloo and
    serves B's greedy tokens."""
    _srv, models, folders, refs = rl
    state = {k: v.contiguous() for k, v in models["b"].state_dict().items()}
    (tmp_path / "b.safetensors").write_bytes(save_safetensors(state))
    port = free_port()
    trainer = subprocess.Popen([sys.executable, "-c", TRAINER, str(port), str(tmp_path / "b.safetensors"), *state])
    try:
        r = http.post("/init_weights_update_group", json={"master_address": "127.0.0.1", "master_port": port,
                                                          "rank_offset": 1, "world_size": 2, "backend": "gloo"})
        assert r.status_code == 200, r.text
        v = _version(http)
        r = http.post("/update_weights_from_distributed", json={
            "names": list(state), "dtypes": ["float32"] * len(state), "shapes": [list(t.shape) for t in state.values()]})
        assert r.status_code == 200 and r.json()["weight_version"] == v + 1, r.text
        assert trainer.wait(60) == 0
    finally:
        trainer.kill()
    p = _prompt(8)
    assert _tokens(_complete(http, p)) == refs["b"].greedy(p, N).tokens
    assert http.post("/update_weights_from_disk", json={"model_path": str(folders["a"])}).status_code == 200


def _surfaces(srv: ServerProcess) -> dict[str, int]:
    """The version each answer of the Responses and Anthropic surfaces names, read through the
    official clients (whole, streamed, background and retrieved; an extra field is in model_extra)."""
    oai = openai.OpenAI(base_url=f"{srv.url}/v1", api_key=KEY, max_retries=0, timeout=120)
    claude = anthropic.Anthropic(base_url=srv.url, auth_token=KEY, max_retries=0, timeout=120)
    kw: dict[str, Any] = {"model": "a", "input": "Hi", "max_output_tokens": 4, "temperature": 0}
    got: dict[str, int] = {}
    r = oai.responses.create(**kw)
    got["responses"] = r.model_extra["weight_version"]
    got["retrieved"] = oai.responses.retrieve(r.id).model_extra["weight_version"]
    events = list(oai.responses.create(**kw, stream=True))
    snapshots = [e.response.model_extra["weight_version"] for e in events if hasattr(e, "response")]
    assert events[-1].type == "response.incomplete"  # (max_output_tokens reached)
    assert len(set(snapshots)) == 1  # created, in_progress and completed agree
    got["responses stream"] = snapshots[-1]
    bg = oai.responses.create(**kw, background=True)
    got["background"] = bg.model_extra["weight_version"]
    for _ in range(2000):
        done = oai.responses.retrieve(bg.id)
        if done.status == "incomplete":
            break
    else:
        raise AssertionError("the background response never finished")
    got["background done"] = done.model_extra["weight_version"]
    mkw: dict[str, Any] = {"model": "a", "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}],
                           "extra_body": {"temperature": 0}}
    got["messages"] = claude.messages.create(**mkw).model_extra["weight_version"]
    with claude.messages.stream(**mkw) as s:
        evs = list(s)
    start = next(e for e in evs if e.type == "message_start")
    delta = next(e for e in evs if e.type == "message_delta")
    got["message_start"] = start.message.model_extra["weight_version"]
    got["message_delta"] = delta.model_extra["weight_version"]
    return got


def test_responses_and_messages_name_the_version(rl: Any, http: httpx.Client) -> None:
    """After an update (from disk, then from tensors) every Responses and Anthropic answer names
    the new version, as chat/completions answers do."""
    srv, models, folders, _refs = rl
    v = _version(http)
    assert set(_surfaces(srv).values()) == {v}
    assert http.post("/update_weights_from_disk", json={"model_path": str(folders["b"])}).status_code == 200
    assert set(_surfaces(srv).values()) == {v + 1}
    assert _send(http, _tensors(models["a"])).status_code == 200
    assert set(_surfaces(srv).values()) == {v + 2} == {_version(http)}


def test_bad_tensors_apply_nothing(rl: Any, http: httpx.Client) -> None:
    _srv, models, folders, _refs = rl
    p = _prompt(2)
    want = _tokens(_complete(http, p))
    v = _version(http)
    q = "model.layers.0.self_attn.q_proj.weight"
    good = models["b"].state_dict()[q].contiguous()
    cases = {
        "model.layers.9.mlp.up_proj.weight": {"model.layers.9.mlp.up_proj.weight": good},
        "shape [64, 32]": {q: good[:, :32].contiguous()},
        "int32": {q: good.to(torch.int32)},
        "NaN": {q: torch.full_like(good, float("nan"))},
    }
    for why, bad in cases.items():
        # One valid tensor beside the bad one: refused as a whole, so it is not applied either.
        body = save_safetensors({"model.layers.1.mlp.down_proj.weight": models["b"].state_dict()[
            "model.layers.1.mlp.down_proj.weight"].contiguous(), **bad})
        r = _send(http, body)
        assert r.status_code == 400, (why, r.text)
        assert why in r.json()["error"]["message"]
    assert _send(http, b"not safetensors").status_code == 400
    r = http.post("/update_weights_from_disk", json={"model_path": str(folders["a"] / "missing")})
    assert r.status_code == 400 and "does not exist" in r.json()["error"]["message"]
    assert _version(http) == v
    assert _tokens(_complete(http, p)) == want


def test_update_waits_for_the_request_in_flight(rl: Any, http: httpx.Client) -> None:
    """A request running when an update arrives finishes on the old weights (all of its tokens are
    the old model's); the update is answered after it, and the next request runs on the new ones."""
    _srv, _models, folders, refs = rl
    p, n = _prompt(3), 160
    v = _version(http)
    t, out = _in_background(lambda: _complete(http, p, n))
    _wait_running(http)
    r = http.post("/update_weights_from_disk", json={"model_path": str(folders["b"])})
    assert r.status_code == 200 and r.json()["weight_version"] == v + 1
    t.join()
    assert _tokens(out[0]) == refs["a"].greedy(p, n).tokens and out[0]["weight_version"] == v
    assert _tokens(_complete(http, p)) == refs["b"].greedy(p, N).tokens
    assert http.post("/update_weights_from_disk", json={"model_path": str(folders["a"])}).status_code == 200


def test_pause_modes(rl: Any, http: httpx.Client) -> None:
    srv, _models, folders, refs = rl
    p, n = _prompt(4), 120
    ref = refs["a"].greedy(p, n).tokens
    # keep: frozen in place, resumed exactly where it was.
    t, out = _in_background(lambda: _complete(http, p, n))
    _wait_running(http)
    r = http.post("/pause_generation", json={"mode": "keep"})
    assert r.status_code == 200 and r.json()["paused"] == "keep" and r.json()["in_flight"] == 1
    steps = srv.engine_stats()["steps"]
    u = http.post("/update_weights_from_disk", json={"model_path": str(folders["b"])})
    assert u.status_code == 409 and "frozen" in u.json()["error"]["message"]  # it would mix versions
    held, held_out = _in_background(lambda: _complete(http, _prompt(5)))  # held back while paused
    for _ in range(2000):  # (pausing again in the same mode changes nothing and reports the state)
        if http.post("/pause_generation", json={"mode": "keep"}).json()["held"] == 1:
            break
    else:
        raise AssertionError("the new request was not held back")
    assert srv.engine_stats()["steps"] == steps  # frozen: not one step while paused
    assert http.post("/continue_generation").status_code == 200
    t.join()
    held.join()
    assert _tokens(out[0]) == ref and out[0]["choices"][0]["finish_reason"] == "length"
    assert _tokens(held_out[0]) == refs["a"].greedy(_prompt(5), N).tokens
    # abort: the request in flight ends with finish reason "abort".
    t, out = _in_background(lambda: _complete(http, p, 400))
    _wait_running(http)
    r = http.post("/pause_generation", json={"mode": "abort"})
    assert r.status_code == 200 and r.json()["aborted"] == 1
    t.join()
    assert out[0]["choices"][0]["finish_reason"] == "abort" and len(_tokens(out[0])) < 400
    assert http.post("/continue_generation").status_code == 200
    # wait: answered once the request in flight has finished (whole).
    t, out = _in_background(lambda: _complete(http, p, n))
    _wait_running(http)
    r = http.post("/pause_generation", json={"mode": "wait"})
    assert r.status_code == 200 and r.json()["in_flight"] == 0
    t.join()
    assert _tokens(out[0]) == ref
    assert http.post("/resume").status_code == 200
    assert http.post("/pause_generation", json={"mode": "nap"}).status_code == 400


def test_abort_by_id(rl: Any, http: httpx.Client) -> None:
    p = _prompt(6)
    with http.stream("POST", "/v1/completions", json={"model": "a", "prompt": p, "max_tokens": 400, "temperature": 0,
                                                     "ignore_eos": True, "stream": True}) as s:
        lines = s.iter_lines()
        first = next(x for x in lines if x.startswith("data: "))
        head = httpx.Response(200, content=first[6:]).json()
        rid = head["id"]
        assert isinstance(head["weight_version"], int)  # (streamed chunks carry it too)
        r = http.post("/abort_requests", json={"rids": [rid]})
        assert r.status_code == 200 and r.json()["aborted"] == 1
        finish = [httpx.Response(200, content=x[6:]).json()["choices"][0]["finish_reason"]
                  for x in lines if x.startswith("data: {")]
    assert finish[-1] == "abort"


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_sleep_gives_the_pool_back(rl: Any, http: httpx.Client) -> None:
    srv, _models, folders, refs = rl
    p = _prompt(7)
    pid = http.get("/health").json()["engine_pid"]
    slots = srv.engine_stats()["kv_slots"]
    pool_bytes = slots * 3 * 2 * 2 * 16 * 4  # layers x (K, V) x kv heads x head dim x float32
    before = _rss(pid)
    r = http.post("/sleep", params={"level": 1})
    assert r.status_code == 200 and r.json()["released_bytes"] == pool_bytes
    assert before - _rss(pid) >= 0.9 * pool_bytes
    assert http.get("/is_sleeping").json() == {"is_sleeping": True, "sleep_level": 1}
    asleep = http.post("/v1/completions", json={"model": "a", "prompt": p, "max_tokens": 4})
    assert asleep.status_code == 503 and "asleep" in asleep.json()["error"]["message"]
    u = http.post("/update_weights_from_disk", json={"model_path": str(folders["b"])})
    assert u.status_code == 409 and "asleep" in u.json()["error"]["message"]
    assert http.post("/wake_up").status_code == 200
    assert http.get("/is_sleeping").json()["is_sleeping"] is False
    assert _tokens(_complete(http, p)) == refs["a"].greedy(p, N).tokens
    # SGLang's spelling, weights too (level 2): reloaded from disk on wake.
    v = _version(http)
    r = http.post("/release_memory_occupation", json={"tags": ["kv_cache", "weights"]})
    assert r.status_code == 200 and r.json()["sleep_level"] == 2
    assert http.post("/resume_memory_occupation").status_code == 200
    assert _tokens(_complete(http, p)) == refs["a"].greedy(p, N).tokens and _version(http) == v
    assert http.post("/reset_prefix_cache").status_code == 200
    assert srv.engine_stats()["kv_cached"] == 0


def test_routed_experts_refused_on_a_dense_model(http: httpx.Client) -> None:
    r = http.post("/v1/completions", json={"model": "a", "prompt": [5, 6, 7], "max_tokens": 2,
                                           "return_routed_experts": True})
    assert r.status_code == 400 and "mixture-of-experts" in r.text, r.text


def test_routes_need_the_key(rl: Any) -> None:
    srv = rl[0]
    for route in ("/pause_generation", "/update_weights_from_disk", "/sleep", "/reset_prefix_cache"):
        assert httpx.post(f"{srv.url}{route}", json={}).status_code == 401
    assert httpx.get(f"{srv.url}/is_sleeping").status_code == 401


@pytest.mark.slow  # (a second server)
def test_routes_need_the_flag(rl: Any, tmp_path: Path) -> None:
    folders = rl[2]
    plain = ServerProcess(tmp_path, "--model", str(folders["a"]), "--threads", "1")
    try:
        for route in ("/pause_generation", "/update_weights_from_disk", "/sleep", "/wake_up"):
            assert httpx.post(f"{plain.url}{route}", json={}).status_code == 404
        assert "weight_version" not in httpx.get(f"{plain.url}/v1/models").json()["data"][0]
        for route, body in (("/v1/responses", {"model": "a", "input": "Hi", "max_output_tokens": 2}),
                            ("/v1/messages", {"model": "a", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]})):
            r = httpx.post(f"{plain.url}{route}", json=body, timeout=120)
            assert r.status_code == 200 and "weight_version" not in r.json(), r.text
        r = httpx.post(f"{plain.url}/v1/completions", json={"model": "a", "prompt": [5, 6], "max_tokens": 2,
                                                           "return_routed_experts": True}, timeout=120)
        assert r.status_code == 400 and "--enable-rl-api" in r.text, r.text
    finally:
        plain.stop()


@pytest.mark.slow  # (the embedded model, served as by default: its GGUF blocks executed as stored)
def test_stored_model_refuses_updates(tmp_path: Path) -> None:
    srv = ServerProcess(tmp_path, "--weights", "stored", "--enable-rl-api")
    try:
        body = save_safetensors({"model.norm.weight": torch.ones(576)})
        r = httpx.post(f"{srv.url}/update_weights_from_tensor", content=body, timeout=120,
                       headers={"Content-Type": "application/octet-stream"})
        assert r.status_code == 400 and "--weights stored" in r.json()["error"]["message"], r.text
        assert httpx.get(f"{srv.url}/get_weight_version").json() == {"weight_version": 0}
    finally:
        srv.stop()
