"""The Ray Serve app (deploy/ray/hotprefix_serve.py): two hotprefix replicas on a local
Ray instance behind Ray's PrefixCacheAffinityRouter answer the openai client, and a
prefix's second request finds its blocks. Slow (Ray's start and two servers: about a
minute on two cores), so it runs only with HOTPREFIX_RAY_TESTS=1 (`make test` leaves it
out); where Ray cannot start here it is skipped, saying why."""

from __future__ import annotations

import os

import openai
import pytest

from tests.server.conftest import free_port

pytestmark = [pytest.mark.ray, pytest.mark.skipif(os.environ.get("HOTPREFIX_RAY_TESTS") != "1",
                                                  reason="set HOTPREFIX_RAY_TESTS=1 to run the Ray Serve app")]


@pytest.fixture(scope="module")
def app_url(tiny_llama):
    ray = pytest.importorskip("ray")
    serve = pytest.importorskip("ray.serve")
    try:
        ray.init(num_cpus=4, include_dashboard=False, ignore_reinit_error=True)
    except Exception as e:  # (a machine where Ray cannot start: no shared memory, no ports)
        pytest.fail(f"HOTPREFIX_RAY_TESTS=1 asked for the Ray Serve app, and Ray cannot start here: {e}")
    from deploy.ray.hotprefix_serve import build

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build({"replicas": "2", "args": f"--model {tiny_llama[0]} --served-model-name tiny"}),
              route_prefix="/", blocking=False)
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()
    ray.shutdown()


def test_two_replicas_behind_rays_prefix_router_answer_the_openai_client(app_url):
    client = openai.OpenAI(base_url=app_url + "/v1", api_key="none", max_retries=0)
    shared = " ".join(f"shared{i}" for i in range(20))
    first = client.completions.create(model="tiny", prompt=shared + " first", max_tokens=3)
    assert first.choices[0].finish_reason == "length" and first.usage.prompt_tokens_details.cached_tokens == 0
    second = client.completions.create(model="tiny", prompt=shared + " second", max_tokens=3)
    assert second.usage.prompt_tokens_details.cached_tokens >= 48  # routed to the replica holding the prefix
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert chat.choices[0].message.content is not None
