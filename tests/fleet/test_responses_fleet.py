"""The Responses API behind ``tripod route``: two real replicas sharing one sqlite store. A
response is retrieved through the router whichever replica stored it, and after the replica that
answered is killed (SIGKILL), a ``previous_response_id`` follow-up through the router still
succeeds and equals sending the whole conversation."""

from __future__ import annotations

import signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from tests.support.server_helpers import ServerProcess, TripodProcess


@pytest.mark.slow
def test_follow_up_after_the_answering_replica_is_killed(tmp_path: Path) -> None:
    store = f"sqlite:{tmp_path / 'responses.db'}"
    with ThreadPoolExecutor(2) as pool:
        reps = list(pool.map(lambda _: ServerProcess(tmp_path, "--responses-store", store), range(2)))
    router = TripodProcess(tmp_path, "route", "--policy", "round_robin", "--health-interval", "0.2",
                           *[a for r in reps for a in ("--replica", r.url)], start_timeout=60)
    try:
        c = openai.OpenAI(base_url=f"{router.url}/v1", api_key="unused", max_retries=0, timeout=120)
        raw = c.responses.with_raw_response.create(model="default", input="My name is Ada.", max_output_tokens=8,
                                                   temperature=0)
        first = raw.parse()
        answered = raw.headers["x-tripod-replica"]
        for _ in range(2):  # (round robin: both replicas are asked to find it)
            assert c.responses.retrieve(first.id).output_text == first.output_text
        victim = reps[int(answered.removeprefix("replica-"))]  # (tripod route names --replica i "replica-i")
        victim.signal(signal.SIGKILL)
        victim.wait_exit(30)
        follow = c.responses.create(model="default", input="What is my name?", previous_response_id=first.id,
                                    max_output_tokens=8, temperature=0)
        whole = c.responses.create(model="default", max_output_tokens=8, temperature=0, store=False, input=[
            {"role": "user", "content": "My name is Ada."}, {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "What is my name?"}])
        assert follow.output_text == whole.output_text
        assert httpx.delete(f"{router.url}/v1/responses/{first.id}", timeout=30).status_code == 200
        with pytest.raises(openai.NotFoundError):
            c.responses.retrieve(first.id)
    finally:
        router.stop()
        for r in reps:
            r.stop()
