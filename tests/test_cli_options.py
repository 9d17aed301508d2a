"""The command line generated from the configs (tripod.config_cli): every command keeps its options,
shared options agree across commands, and what a fleet forwards to its replicas round-trips. No model."""

from __future__ import annotations

import argparse
import re

import pytest

from tripod.cli import build_parser, replica_args, replica_argv
from tripod.config import (
    CHAINS_SERVE,
    ROUTE,
    SERVE,
    EngineConfig,
    FleetConfig,
    RouterConfig,
    SamplingOptions,
    ServerConfig,
)
from tripod.config_cli import cli_fields, from_namespace, namespace_values, to_argv

# Every engine and server option a replica can be given, each away from its default.
ENGINE_SERVER = [
    "--model", "/m/x.gguf", "--dtype", "float32", "--device", "cuda:1", "--kv-cache-tokens", "4096",
    "--max-model-len", "1024", "--chunk-size", "64", "--max-batch-tokens", "256", "--max-running", "16",
    "--max-state-slots", "8", "--max-state-snapshots", "0",
    "--policy", "fcfs", "--no-prefix-cache", "--threads", "3", "--kernels", "eager", "--weights", "fp8",
    "--no-jump-forward", "--speculative", "draft:embedded", "--num-draft-tokens", "5", "--spec-max-batch", "0",
    "--api-key", "k", "--task", "embed", "--pooling", "mean", "--no-normalize", "--served-model-name", "m", "--max-waiting", "7", "--overload-status", "503",
    "--drain-timeout", "2.5", "--max-n", "3", "--parallel-timeout", "30", "--tensor-parallel-size", "2",
    "--pipeline-parallel-size", "2", "--data-parallel-size", "2", "--enable-expert-parallel",
    "--parallel-backend", "ray", "--parallel-placement", "strict-spread", "--parallel-ray-address", "auto",
    "--tenants", "/t.toml", "--tenant-limits", "tokens",
    "--otel-endpoint", "http://collector:4318", "--otel-file", "/tmp/spans.jsonl",
    "--reasoning-parser", "qwen3", "--kv-disk", "/var/kv", "--kv-disk-size", "2.5",
    "--lora", "a=/la,b=/lb", "--max-loras", "2", "--max-lora-rank", "32",
    "--responses-store", "sqlite:/r.db", "--responses-ttl", "60", "--responses-max-count", "9",
    "--responses-max-bytes", "4096", "--no-cuda-graphs", "--cuda-graph-max-bs", "64",
    "--gpu-memory-utilization", "0.8", "--overlap-schedule", "off",
    "--max-body-bytes", "9000000", "--limit-mm-per-prompt", "3", "--allowed-media-domains", "a.example",
    "*.b.example", "--media-fetch-timeout", "2.5", "--max-image-bytes", "1000000", "--max-image-pixels", "4000000",
]

# The options of each command (as before the CLI was generated from the configs).
FLAGS = {
    ("serve",): "--lora --max-lora-rank --max-loras --api-key --audit-log --audit-log-content --backend --balance-abs --balance-rel --bench-dir "
    "--chunk-size --cuda-graph-max-bs --data-parallel-size --device --downscale-delay --drain-timeout --dtype --enable-expert-parallel --enable-rl-api "
    "--gpu-memory-utilization --health-interval --host --kernels --kv-cache-tokens --kv-disk --kv-disk-size --load-weight --log-level --lookback "
    "--allowed-media-domains --limit-mm-per-prompt --max-body-bytes --max-image-bytes --max-image-pixels --media-fetch-timeout "
    "--max-batch-tokens --max-model-len --max-n --max-pending --max-replicas --max-retries --max-running "
    "--max-state-slots --max-state-snapshots "
    "--max-waiting --min-replicas --model --normalize --no-cuda-graphs --no-jump-forward --no-prefix-cache --num-draft-tokens "
    "--otel-endpoint --otel-file --overlap-schedule --overload-status --parallel-backend --parallel-placement --parallel-ray-address "
    "--parallel-timeout --pipeline-parallel-size --policy --pooling --port --prefill-replicas --queue-timeout "
    "--ray-address --ray-num-cpus --ray-num-gpus --reasoning-parser --region --region-overflow-load --replica-log-dir "
    "--replica-max-inflight --replicas --responses-max-bytes --responses-max-count --responses-store --responses-ttl "
    "--role --router-policy --served-model-name --slo-tpot-p95 --slo-ttft-p95 "
    "--spec-max-batch --speculative --ssl-certfile --ssl-keyfile --stall-timeout --target-inflight "
    "--task --tenant-limits --tenants --tensor-parallel-size --threads --upscale-delay --weights",
    ("route",): "--api-key --audit-log --audit-log-content --balance-abs --balance-rel --bench-dir --drain-timeout "
    "--health-interval --host --load-weight --log-level --max-body-bytes --max-pending --max-retries --otel-endpoint --otel-file "
    "--policy --port --queue-timeout --region --region-overflow-load --replica --replica-max-inflight --ssl-ca "
    "--ssl-certfile --ssl-keyfile --stall-timeout --tenants",
    ("generate",): "--lora --max-lora-rank --max-loras --chunk-size --cuda-graph-max-bs --data-parallel-size "
    "--device --dtype --enable-expert-parallel --gpu-memory-utilization --ignore-eos --image --kernels --kv-cache-tokens "
    "--kv-disk --kv-disk-size --log-level --max-batch-tokens --max-model-len --max-running --max-state-slots "
    "--max-state-snapshots --max-tokens --min-p --model "
    "--no-cuda-graphs --no-jump-forward --no-prefix-cache --num-draft-tokens --overlap-schedule --parallel-backend --parallel-placement --parallel-ray-address --parallel-timeout --pipeline-parallel-size "
    "--policy --raw --repetition-penalty --seed --spec-max-batch --speculative --stats --system "
    "--temperature --tensor-parallel-size --threads --top-k --top-p --weights",
    ("chat",): "--lora --max-lora-rank --max-loras --api-key --chunk-size --cuda-graph-max-bs "
    "--data-parallel-size --device --dtype --enable-expert-parallel --gpu-memory-utilization --ignore-eos --kernels "
    "--kv-cache-tokens --kv-disk --kv-disk-size --log-level --max-batch-tokens --max-model-len --max-running --max-state-slots "
    "--max-state-snapshots --max-tokens --min-p "
    "--model --no-cuda-graphs --no-jump-forward --no-prefix-cache --num-draft-tokens --overlap-schedule --parallel-backend --parallel-placement --parallel-ray-address --parallel-timeout "
    "--pipeline-parallel-size --policy --repetition-penalty --seed --spec-max-batch --speculative "
    "--system --temperature --tensor-parallel-size --threads --top-k --top-p --url --weights",
    ("chains", "serve"): "--backend --drain-timeout --entrypoint --host --log-dir --log-level --model --model-args "
    "--otel-endpoint --otel-file --port "
    "--ray-address --ray-num-cpus --ray-num-gpus --router-policy --start-timeout",
}


def _parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(list(argv))


@pytest.mark.parametrize("command", list(FLAGS))
def test_every_command_keeps_its_options(command: tuple[str, ...], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        _parse(*command, "--help")
    usage = capsys.readouterr().out.split("\n\n")[0]
    assert sorted(set(re.findall(r"\[(--[\w-]+)", usage))) == sorted(FLAGS[command].split())


def test_replica_options_round_trip() -> None:
    """argv → configs → a replica's argv → the same configs: nothing a fleet forwards is lost or changed."""
    args = _parse("serve", "--replicas", "2", "--port", "9", *ENGINE_SERVER)
    engine, server = from_namespace(EngineConfig, args), from_namespace(ServerConfig, args)
    # The argv above sets every forwarded option (a new option must be added to it, and is then checked here).
    for cls, cfg in ((EngineConfig, engine), (ServerConfig, server)):
        for f in cli_fields(cls, SERVE):
            if f.opt.forward:
                assert getattr(cfg, f.name) != f.default, f"{cls.__name__}.{f.name} is not exercised"
    forwarded = replica_argv(engine, server)
    again = _parse("serve", "--port", "9", *forwarded)
    assert from_namespace(EngineConfig, again) == engine
    assert from_namespace(ServerConfig, again) == server
    assert replica_argv(from_namespace(EngineConfig, again), from_namespace(ServerConfig, again)) == forwarded
    assert "--host" not in forwarded and "--port" not in forwarded


def test_defaults_forward_as_defaults() -> None:
    args = _parse("serve", "--replicas", "2")
    forwarded = replica_args(args, 4)
    assert forwarded[-2:] == ["--log-level", "INFO"] and "--no-prefix-cache" not in forwarded
    again = _parse("serve", *forwarded)
    assert from_namespace(EngineConfig, again) == EngineConfig(num_threads=4)
    assert from_namespace(ServerConfig, again) == ServerConfig()


def test_to_argv_inverts_from_namespace() -> None:
    cfg = RouterConfig(policy="round_robin", load_weight=0.5, balance_abs=1, max_retries=0, health_interval=0.25,
                       host="0.0.0.0", port=9, api_key="k", bench_dir="/b")
    assert from_namespace(RouterConfig, _parse("route", *to_argv(cfg, ROUTE))) == cfg
    sampling = SamplingOptions(max_tokens=9, temperature=0.7, seed=3, ignore_eos=True)
    assert from_namespace(SamplingOptions, _parse("generate", *to_argv(sampling, "generate"))) == sampling


def test_generate_chat_and_serve_take_the_same_engine_options() -> None:
    engine_argv = ENGINE_SERVER[: ENGINE_SERVER.index("--api-key")]
    configs = [from_namespace(EngineConfig, _parse(cmd, *engine_argv)) for cmd in ("generate", "chat", "serve")]
    assert configs[0] == configs[1] == configs[2] != EngineConfig()


def _chains_options(ns: argparse.Namespace) -> dict[str, object]:
    """chains serve's shared options but --start-timeout (which tripod serve does not take)."""
    values = namespace_values(ns, CHAINS_SERVE, ServerConfig, FleetConfig, RouterConfig)
    assert values.pop("start_timeout") == 300.0
    return values


def test_serve_route_and_chains_serve_agree_on_shared_options() -> None:
    shared = ["--host", "0.0.0.0", "--port", "9", "--drain-timeout", "2.5"]
    fleet = ["--backend", "ray", "--ray-address", "auto", "--ray-num-cpus", "2", "--ray-num-gpus", "1"]
    serve = _parse("serve", *shared, *fleet, "--router-policy", "least_load", "--api-key", "k", "--bench-dir", "/b")
    route = _parse("route", *shared, "--policy", "least_load", "--api-key", "k", "--bench-dir", "/b")
    chains = _parse("chains", "serve", "c.py", *shared, *fleet, "--router-policy", "least_load")
    # The fleet's router listens where `tripod serve` would, with the server's key and bench folder.
    assert from_namespace(RouterConfig, serve) == from_namespace(RouterConfig, route)
    assert _chains_options(chains) == {k: getattr(serve, k) for k in _chains_options(chains)}
    assert from_namespace(ServerConfig, serve).drain_timeout == from_namespace(ServerConfig, route).drain_timeout
    # and with nothing given, the same defaults (the configs' own).
    assert from_namespace(RouterConfig, _parse("serve")) == from_namespace(RouterConfig, _parse("route")) == \
        RouterConfig()
    defaults = _chains_options(_parse("chains", "serve", "c.py"))
    assert defaults == {k: getattr(_parse("serve"), k) for k in defaults}


def test_empty_api_key_means_none(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRIPOD_API_KEY", "")
    assert from_namespace(ServerConfig, _parse("serve")).api_key is None
    assert from_namespace(RouterConfig, _parse("route")).api_key is None
    monkeypatch.setenv("TRIPOD_API_KEY", "secret")
    assert from_namespace(ServerConfig, _parse("serve")).api_key == "secret"


@pytest.mark.parametrize("argv, words", [
    (("serve", "--speculative", "self:0"), "argument --speculative: speculative must be"),
    (("route", "--policy", "random"), "argument --policy: invalid choice: 'random'"),
    (("serve", "--router-policy", "random"), "argument --router-policy: invalid choice"),
    (("serve", "--port", "x"), "argument --port: invalid int value: 'x'"),
    (("generate", "--threads", "x"), "argument --threads: invalid int value"),
    (("serve", "--overload-status", "500"), "argument --overload-status: invalid choice: 500"),
    (("serve", "--reasoning-parser", "r2"), "argument --reasoning-parser: invalid choice: 'r2'"),
    (("serve", "--allowed-media-domains", "https://img.example"), "argument --allowed-media-domains: "
     "'https://img.example' is not a host name"),
    (("serve", "--limit-mm-per-prompt", "many"), "argument --limit-mm-per-prompt: image: 'many' is not a whole number"),
    (("serve", "--limit-mm-per-prompt", '{"image": 2, "video": 1}'), "argument --limit-mm-per-prompt: 'video' inputs "
     "are not taken (images only)"),
    (("serve", "--limit-mm-per-prompt", "-1"), "argument --limit-mm-per-prompt: the image limit must be >= 0"),
])
def test_parse_errors_name_the_flag(argv: tuple[str, ...], words: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        _parse(*argv)
    assert e.value.code == 2
    assert words in capsys.readouterr().err


@pytest.mark.parametrize("spelling", ["2", "image=2", '{"image": 2}', '{"image": 2, "video": 0}'])
def test_the_image_limit_is_taken_as_vllm_spells_it(spelling: str) -> None:
    """``--limit-mm-per-prompt`` as a number or as vLLM writes it: the same limit, and a fleet passes
    it on to its replicas in a form that parses back the same."""
    cfg = from_namespace(ServerConfig, _parse("serve", "--limit-mm-per-prompt", spelling))
    assert cfg.limit_mm_per_prompt == 2
    again = from_namespace(ServerConfig, _parse("serve", *to_argv(cfg, "serve")))
    assert again.limit_mm_per_prompt == 2


def test_config_validation_still_applies() -> None:
    with pytest.raises(ValueError, match="num_draft_tokens"):
        from_namespace(EngineConfig, _parse("serve", "--num-draft-tokens", "0"))
    with pytest.raises(ValueError, match="min_replicas"):
        from_namespace(FleetConfig, _parse("serve"), min_replicas=3, max_replicas=2)


@pytest.mark.parametrize("argv", [["--lora", "a=/x", "b=/y"], ["--lora", "a=/x", "--lora", "b=/y"], ["--lora", "a=/x,b=/y"]])
def test_lora_takes_several_adapters_in_every_spelling(argv: list[str]) -> None:
    """``--lora NAME=PATH ...`` (vLLM's way), repeated, or comma-joined: the same adapters, in order;
    and a fleet passes them on to its replicas as one value that parses back the same."""
    from tripod.config import parse_loras

    cfg = from_namespace(EngineConfig, _parse("serve", *argv))
    assert parse_loras(cfg.lora or "") == {"a": "/x", "b": "/y"}
    again = from_namespace(EngineConfig, _parse("serve", *to_argv(cfg, "serve")))
    assert again.lora == cfg.lora
    with pytest.raises(SystemExit):
        _parse("serve", "--lora", "no-equals-sign")


def test_media_domains_and_body_limit_reach_every_process() -> None:
    """``--allowed-media-domains`` in any spelling gives the same hosts (lower-cased, ``*.`` kept) and
    round-trips to replicas; ``tripod serve --max-body-bytes`` is its fleet router's limit too (the
    router forwards image bodies unchanged, so it must admit what the replicas admit)."""
    for argv in (["--allowed-media-domains", "A.example", "*.b.example"],
                 ["--allowed-media-domains", "A.example,*.b.example"],
                 ["--allowed-media-domains", "A.example", "--allowed-media-domains", "*.b.example"]):
        cfg = from_namespace(ServerConfig, _parse("serve", *argv))
        assert cfg.media_hosts == ("a.example", "*.b.example")
        assert from_namespace(ServerConfig, _parse("serve", *to_argv(cfg, SERVE))) == cfg
    assert ServerConfig().media_hosts == ()
    serve = _parse("serve", "--replicas", "2", "--max-body-bytes", "99999999")
    assert from_namespace(RouterConfig, serve).max_body_bytes == from_namespace(ServerConfig, serve).max_body_bytes \
        == 99999999
    assert ServerConfig().max_body_bytes == RouterConfig().max_body_bytes >= 32 * 2**20


@pytest.mark.parametrize("argv, words", [
    (("--max-state-slots", "0"), "max_state_slots must be >= 1"),
    (("--max-state-snapshots", "-1"), "max_state_snapshots must be >= 0"),
])
def test_state_pool_sizes_are_checked(argv: tuple[str, ...], words: str) -> None:
    with pytest.raises(ValueError, match=words):
        from_namespace(EngineConfig, _parse("serve", *argv))
    assert from_namespace(EngineConfig, _parse("generate", "--max-state-slots", "3", "--max-state-snapshots", "0")) \
        == EngineConfig(max_state_slots=3, max_state_snapshots=0)
