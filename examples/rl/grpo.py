"""A few GRPO steps on a tiny policy: torch trains it in this process, ``tripod serve`` generates its
rollouts in another, and the new weights go to tripod over a gloo group after every step.

    python examples/rl/grpo.py --steps 3        # prints one JSON line per step

tripod runs its batch-invariant CPU kernels (``--kernels optimized``): a rollout's tokens and logprobs
do not depend on what else is in the batch. The policy is a tiny random Llama (vocabulary 256); the toy reward is the share of even token ids
in a completion. Each step: ``--group`` sampled completions per prompt with their logprobs
(``/v1/completions`` with token ids in and out), group-normalised advantages, one policy-gradient
step on ``-sum(advantage * logprob)`` computed by the trainer's own forward pass, then the weights
pushed (``/update_weights_from_distributed``). After each push the script checks what an RL loop
relies on (``check``): tripod's greedy tokens and their logprobs equal the trainer's model in
float32, and a rollout's tokens and logprobs are the same alone and batched with others.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

import httpx
import torch
import torch.distributed as dist

from tripod.fleet.process import free_port, wait_healthy
from tripod.loader import load_tokenizer

VOCAB, PROMPT_LEN, MAX_TOKENS = 256, 8, 12


def tiny_policy(seed: int) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = LlamaForCausalLM(cfg).float()
    with torch.no_grad():  # decisive logits (no near-ties between the top two tokens)
        for name, p in model.named_parameters():
            if p.ndim == 2:
                p.normal_(0.0, (3.0 if "lm_head" in name else 1.0) / p.shape[1] ** 0.5 if "embed" not in name else 1.0)
    return model


class Rollouts:
    """The trainer's side of tripod: the server process, its HTTP client and the weight group."""

    def __init__(self, folder: Path, workdir: Path) -> None:
        port, self.group_port = free_port(), free_port()
        self.log = open(workdir / "serve.log", "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "tripod.cli", "serve", "--model", str(folder), "--port",
                                      str(port), "--dtype", "float32", "--kernels", "optimized",
                                      "--threads", "1", "--kv-cache-tokens", "8192",
                                      "--enable-rl-api"], stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**os.environ, "TRIPOD_API_KEY": ""})
        url = f"http://127.0.0.1:{port}"
        why = wait_healthy(url, [self.proc], 300)
        if why is not None:
            raise RuntimeError(f"tripod serve {why}: see {self.log.name}")
        self.http = httpx.Client(base_url=url, timeout=300)
        joined: list[httpx.Response] = []
        t = threading.Thread(target=lambda: joined.append(self.http.post("/init_weights_update_group", json={
            "master_address": "127.0.0.1", "master_port": self.group_port, "rank_offset": 1, "world_size": 2})))
        t.start()
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{self.group_port}", rank=0, world_size=2)
        t.join()
        joined[0].raise_for_status()

    def sample(self, prompts: list[list[int]], n: int, seed: int, temperature: float = 1.0) -> list[dict[str, Any]]:
        r = self.http.post("/v1/completions", json={
            "prompt": prompts, "n": n, "max_tokens": MAX_TOKENS, "temperature": temperature, "seed": seed,
            "logprobs": 1, "ignore_eos": True, "return_token_ids": True})
        r.raise_for_status()
        return sorted(r.json()["choices"], key=lambda c: c["index"])

    def push(self, model: Any) -> int:
        state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
        answer: list[httpx.Response] = []
        t = threading.Thread(target=lambda: answer.append(self.http.post("/update_weights_from_distributed", json={
            "names": list(state), "dtypes": ["float32"] * len(state), "shapes": [list(v.shape) for v in state.values()]})))
        t.start()
        for v in state.values():
            dist.broadcast(v, src=0)
        t.join()
        answer[0].raise_for_status()
        return int(answer[0].json()["weight_version"])

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
        self.proc.terminate()
        self.proc.wait(60)
        self.log.close()


def seq_logprobs(model: Any, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """The trainer's logprob of each of ``tokens`` after ``prompt`` (one forward, float32)."""
    ids = torch.tensor([prompt + tokens])
    logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(tokens)[:, None])[:, 0]


def check(rollouts: Rollouts, model: Any, prompts: list[list[int]]) -> dict[str, Any]:
    """tripod's greedy tokens and logprobs against the trainer's model; rollouts alone vs batched."""
    greedy = rollouts.sample(prompts, 1, seed=0, temperature=0.0)
    worst = 0.0
    with torch.no_grad():
        for prompt, choice in zip(prompts, greedy, strict=True):
            ids = list(prompt)
            for _ in range(MAX_TOKENS):  # the trainer's own greedy decode
                ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
            want = ids[len(prompt):]
            if choice["token_ids"] != want:
                raise AssertionError(f"greedy tokens differ: tripod {choice['token_ids']}, trainer {want}")
            got = torch.tensor(choice["logprobs"]["token_logprobs"])
            worst = max(worst, float((got - seq_logprobs(model, prompt, want)).abs().max()))
    alone = rollouts.sample(prompts[:1], 2, seed=7)
    batched = rollouts.sample(prompts, 2, seed=7)[:2]
    if [(c["token_ids"], c["logprobs"]["token_logprobs"]) for c in alone] != [
            (c["token_ids"], c["logprobs"]["token_logprobs"]) for c in batched]:
        raise AssertionError(f"a rollout's tokens or logprobs changed when batched with others: {alone} != {batched}")
    return {"greedy_tokens_equal": True, "max_logprob_diff": worst, "batch_invariant": True}


def grpo(steps: int, group: int, workdir: Path, lr: float = 0.05) -> list[dict[str, Any]]:
    torch.manual_seed(0)
    policy = tiny_policy(1)
    folder = workdir / "policy"
    policy.save_pretrained(str(folder))
    load_tokenizer(None).tokenizer.save_pretrained(str(folder))  # (prompts are token ids: any tokenizer)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, VOCAB, (PROMPT_LEN,), generator=g).tolist() for _ in range(2)]
    opt = torch.optim.SGD(policy.parameters(), lr=lr)
    rollouts = Rollouts(folder, workdir)
    report = []
    try:
        for step in range(steps):
            choices = rollouts.sample(prompts, group, seed=100 + step)
            loss = torch.zeros(())
            rewards = []
            for i, prompt in enumerate(prompts):
                mine = choices[i * group : (i + 1) * group]
                r = torch.tensor([sum(t % 2 == 0 for t in c["token_ids"]) / MAX_TOKENS for c in mine])
                rewards.append(float(r.mean()))
                adv = (r - r.mean()) / (r.std() + 1e-6)
                for a, c in zip(adv, mine, strict=True):
                    loss = loss - a * seq_logprobs(policy, prompt, c["token_ids"]).sum() / (group * len(prompts))
            opt.zero_grad()
            loss.backward()
            opt.step()
            version = rollouts.push(policy)
            report.append({"step": step, "reward": sum(rewards) / len(rewards), "weight_version": version,
                           **check(rollouts, policy, prompts)})
            print(json.dumps(report[-1]), flush=True)
    finally:
        rollouts.close()
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--group", type=int, default=4)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        grpo(args.steps, args.group, Path(tmp))


if __name__ == "__main__":
    main()
