"""The cost of a weight update over a trainer's gloo group (docs/rl.md), against copying the model's
bytes once, on the embedded SmolLM2-135M served in float32 (weights dequantized).

    .venv/bin/python benchmarks/rl_weight_update.py                 # 3 updates; a JSON line per result
    .venv/bin/python benchmarks/rl_weight_update.py --updates 3 --out benchmarks/results/rl_weight_update.json
    # A/B: the server run from another checkout (e.g. `git archive <commit>` unpacked), its runs
    # added to the same file under a label
    .venv/bin/python benchmarks/rl_weight_update.py --tripod /tmp/old --label before --append --out ...

This process plays the trainer (rank 0): it starts ``tripod serve --enable-rl-api``, joins the
engine into a gloo group, and for each update posts ``/update_weights_from_distributed`` while it
broadcasts every tensor of the model's HF state dict. Measured: ``copy_s``, the best of 3 clones of
those tensors (the time to copy the model's bytes once here), and one clone again just before each
update (the load of a shared machine drifts: each update's ratio is taken to its neighbouring copy);
a one-token request before each update; ``update_s``, each update's wall time
(from the POST to its answer: broadcast, checks, the fresh model built through the loader's mapping,
the swap; since the update also packs the new weights for the kernels, that too);
``first_token_s``, a one-token request after the update (before, the weights were packed again
there). The first update also reads the checkpoint's shapes once.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tripod.fleet.process import free_port, wait_healthy  # noqa: E402
from tripod.loader import open_source  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--updates", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None, help="also write the results here (JSON)")
    ap.add_argument("--tripod", default=None, help="serve the tripod of this checkout (an A/B's other side)")
    ap.add_argument("--label", default="", help="this run's name in the results file")
    ap.add_argument("--append", action="store_true", help="add this run to --out's runs instead of replacing it")
    args = ap.parse_args()
    _, _, src = open_source(None)
    state = {k: v.contiguous() for k, v in src.weights().items()}
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    copy_s = min(_timed(lambda: {k: v.clone() for k, v in state.items()}) for _ in range(3))
    port, group_port = free_port(), free_port()
    log = open(Path(tempfile.mkdtemp()) / "serve.log", "w")
    srv = subprocess.Popen([sys.executable, "-m", "tripod.cli", "serve", "--port", str(port), "--dtype", "float32",
                            "--weights", "dequantized", "--threads", str(args.threads), "--kv-cache-tokens", "4096",
                            "--enable-rl-api"], stdout=log, stderr=subprocess.STDOUT,
                           env={**os.environ, "TRIPOD_API_KEY": "",
                                **({"PYTHONPATH": args.tripod} if args.tripod else {})},
                           cwd=args.tripod)  # (`-m` puts the working directory first on the path)
    url = f"http://127.0.0.1:{port}"
    try:
        why = wait_healthy(url, [srv], 300)
        if why is not None:
            raise RuntimeError(f"tripod serve {why}:\n{Path(log.name).read_text()}")
        http = httpx.Client(base_url=url, timeout=600)
        joined: list[Any] = []
        t = threading.Thread(target=lambda: joined.append(http.post("/init_weights_update_group", json={
            "master_address": "127.0.0.1", "master_port": group_port, "rank_offset": 1, "world_size": 2})))
        t.start()
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{group_port}", rank=0, world_size=2)
        t.join()
        assert joined[0].status_code == 200, joined[0].text
        body = {"names": list(state), "dtypes": [str(v.dtype).removeprefix("torch.") for v in state.values()],
                "shapes": [list(v.shape) for v in state.values()]}
        rows = []
        one_token = {"prompt": "Hello", "max_tokens": 1}
        for i in range(args.updates):
            # The load on a shared machine drifts: a copy and a request timed next to each update.
            copy_now_s = _timed(lambda: {k: v.clone() for k, v in state.items()})
            http.post("/v1/completions", json=one_token)
            token_s = _timed(lambda: http.post("/v1/completions", json=one_token))
            answer: list[Any] = []
            t0 = time.perf_counter()
            post = threading.Thread(target=_post, args=(http, body, answer))
            post.start()
            for v in state.values():
                dist.broadcast(v, src=0)
            post.join()
            update_s = time.perf_counter() - t0
            assert answer[0].status_code == 200, answer[0].text
            first_token_s = _timed(lambda: http.post("/v1/completions", json=one_token))
            rows.append({"update": i, "copy_just_before_s": round(copy_now_s, 3), "update_s": round(update_s, 3),
                         "update_over_that_copy": round(update_s / copy_now_s, 2),
                         "token_before_update_s": round(token_s, 3), "first_token_s": round(first_token_s, 3),
                         "weight_version": answer[0].json()["weight_version"],
                         "load_average_1m": round(os.getloadavg()[0], 1)})
            print(json.dumps(rows[-1]), flush=True)
        later = [r["update_over_that_copy"] for r in rows[1:]] or [rows[0]["update_over_that_copy"]]
        run = {"label": args.label, "tripod": args.tripod or "this checkout", "copy_s": round(copy_s, 3),
               "updates": rows, "best_update_over_copy": round(min(r["update_s"] for r in rows) / copy_s, 2),
               "median_update_over_adjacent_copy_after_the_first": round(statistics.median(later), 2),
               "load_average_1m_at_end": round(os.getloadavg()[0], 1)}
        log.flush()  # (the server's own timings of each phase, where it logs them)
        run["server_log"] = [line.split(" ", 2)[-1] for line in Path(log.name).read_text().splitlines()
                             if any(w in line for w in ("received", "swapped", "weights updated"))]
        print(json.dumps(run))
        if args.out:
            out = Path(args.out)
            old = json.loads(out.read_text()) if args.append and out.exists() else {}
            result = {"model": "embedded SmolLM2-135M (float32, dequantized)", "bytes": nbytes,
                      "machine": "shared machine (other jobs running: see the load averages)",
                      "date": time.strftime("%Y-%m-%d", time.gmtime()),
                      "command": "benchmarks/rl_weight_update.py " + " ".join(sys.argv[1:]),
                      "cpu": _cpu_name(), "threads": args.threads,
                      "torch_threads": torch.get_num_threads(), "cpus": os.cpu_count(),
                      **{k: v for k, v in old.items() if k == "note"}, "runs": [*old.get("runs", []), run]}
            out.write_text(json.dumps(result, indent=1) + "\n")
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        srv.terminate()
        srv.wait(60)
        log.close()


def _post(http: httpx.Client, body: dict[str, Any], answer: list[Any]) -> None:
    answer.append(http.post("/update_weights_from_distributed", json=body))


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _timed(fn: Any) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


if __name__ == "__main__":
    main()
