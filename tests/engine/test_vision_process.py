"""A vision-language model in the engine process (``python -m tripod.engine.process``), spoken to
over its ZMQ pipes as the HTTP process does: ``Ready.modalities`` says it takes images, an
``AddRequest`` with images answers the offline engine's tokens, a bad image is a rejection (the
process serves on), and the stats carry ``VisionStats``."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import msgspec
import zmq

from tests.support import tiny_vlms
from tripod import Engine, SamplingParams
from tripod.config import EngineConfig
from tripod.protocol import engine_ipc


def _outputs(pull: zmq.Socket, rid: str) -> engine_ipc.SeqOutput:
    """The one copy of ``rid`` to its end (its tokens gathered)."""
    tokens: list[int] = []
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if not pull.poll(1000):
            continue
        msg = engine_ipc.decode(pull.recv())
        for out in msg.items if isinstance(msg, engine_ipc.Outputs) else []:
            if out.rid == rid:
                tokens += out.token_ids
                if out.finish_reason is not None:
                    return msgspec.structs.replace(out, token_ids=tokens)
    raise AssertionError(f"no end of {rid} within 120 s")


def test_an_image_request_through_the_engine_process(tiny_vlm: Any, tmp_path: Path) -> None:
    vlm = tiny_vlm("qwen2_5_vl")
    cfg = EngineConfig(model=str(vlm.folder), dtype="float32", kv_cache_tokens=512, max_running=4, max_batch_tokens=64,
                       chunk_size=8)
    ctx = zmq.Context()
    push, pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    push.bind(f"ipc://{tmp_path}/to-engine")
    pull.bind(f"ipc://{tmp_path}/from-engine")
    launch = engine_ipc.EngineLaunch(engine_config=cfg, to_engine=f"ipc://{tmp_path}/to-engine",
                                     from_engine=f"ipc://{tmp_path}/from-engine", heartbeat_interval=0.5,
                                     log_level=30, parent_pid=os.getpid())
    proc = subprocess.Popen([sys.executable, "-m", "tripod.engine.process", engine_ipc.encode_launch(launch)])
    try:
        assert pull.poll(180_000), "the engine process sent nothing"
        ready = engine_ipc.decode(pull.recv())
        assert isinstance(ready, engine_ipc.Ready) and ready.modalities == ["text", "image"]
        offline = Engine(config=cfg)
        p = offline.image_prompt(tiny_vlms.messages("What is this?", 1), [tiny_vlms.image(5, (64, 48))])
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        want = offline.generate([p], params)[0].token_ids
        bad = msgspec.structs.replace(p.images[0], offset=p.images[0].offset + 1)
        push.send(engine_ipc.encode(engine_ipc.AddRequest("bad", p.ids, params, images=[bad])))
        refused = _outputs(pull, "bad")
        assert refused.finish_reason == "rejected" and "not all the model's image token" in (refused.error or "")
        push.send(engine_ipc.encode(engine_ipc.AddRequest("good", p.ids, params, images=p.images)))
        assert _outputs(pull, "good").token_ids == want
        push.send(engine_ipc.encode(engine_ipc.StatsRequest(7)))
        while True:
            msg = engine_ipc.decode(pull.recv())
            if isinstance(msg, engine_ipc.StatsReply):
                break
        vision = msg.stats.vision
        assert vision.images_encoded == 1 and vision.image_tokens == p.images[0].length and msg.stats.consistent
        push.send(engine_ipc.encode(engine_ipc.Shutdown()))
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        push.close(0)
        pull.close(0)
        ctx.term()
