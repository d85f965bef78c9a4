"""`hotprefix serve -tp 2` as its own process (rank 1 spawned by it, gloo on loopback):
it answers the `openai` client with -tp 1's greedy tokens; killing rank 1 mid-stream gives
the client an error and the server exits 1; a model whose heads do not split (the default
SmolLM2-135M: 9 query heads, 3 KV heads) is refused in one line before anything starts."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import openai
import psutil
import pytest

from hotprefix import LLM, SamplingParams
from tests.conftest import build_tiny_model
from tests.server.conftest import launch_server, stop_process

PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def long_context_llama(tmp_path_factory):
    """The tiny Llama with a context of 4096, so a stream can run thousands of steps."""
    d = tmp_path_factory.mktemp("tp-http")
    build_tiny_model(d, "llama", max_position_embeddings=4096)
    return d


def spawned_rank(proc: subprocess.Popen) -> psutil.Process:
    """The rank the server spawned (torch.multiprocessing's spawn; not its resource tracker)."""
    (rank,) = [c for c in psutil.Process(proc.pid).children()
               if "spawn_main" in " ".join(c.cmdline())]
    return rank


def test_a_server_over_two_ranks_answers_and_exits_when_a_rank_dies(long_context_llama):
    want = LLM(model=str(long_context_llama), device="cpu").generate(
        [PROMPT], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))[0].outputs[0].text
    proc, url = launch_server([str(long_context_llama), "-tp", "2", "--served-model-name", "tiny",
                               "--kv-cache-memory", "64MiB"])
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        got = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0.0,
                                         extra_body={"ignore_eos": True})
        assert got.choices[0].text == want
        stream = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4000, temperature=0.0,
                                           stream=True, extra_body={"ignore_eos": True})
        chunks = iter(stream)
        assert next(chunks).choices[0].text  # tokens are flowing: 4000 steps to go
        spawned_rank(proc).send_signal(signal.SIGKILL)
        with pytest.raises(openai.APIError, match="peer rank is gone"):
            for _ in chunks:
                pass
        assert proc.wait(timeout=120) == 1
    finally:
        out = stop_process(proc)
    assert "the engine died" in out


def test_a_model_whose_heads_do_not_split_is_refused_in_one_line():
    done = subprocess.run([sys.executable, "-m", "hotprefix", "serve", "-tp", "2"], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == (
        "hotprefix: error: --tensor-parallel-size 2: the model's 3 KV heads and 9 query heads do not split over 2 "
        "ranks (the size must divide both: 1, 3)")


def test_torchrun_ranks_generate_one_ranks_tokens(long_context_llama):
    """Two `hotprefix generate -tp 2` processes with torchrun's variables (RANK, WORLD_SIZE,
    MASTER_ADDR, MASTER_PORT): rank 0 prints -tp 1's tokens; rank 1 follows it and exits 0."""
    from tests.server.conftest import free_port

    args = [sys.executable, "-m", "hotprefix", "generate", "--model", str(long_context_llama), "--max-tokens", "8",
            "--temperature", "0", "--ignore-eos", "--json", PROMPT]
    env = {**os.environ, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    follower = subprocess.Popen([*args, "-tp", "2"], env={**env, "RANK": "1"}, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
    try:
        lead = subprocess.run([*args, "-tp", "2"], env={**env, "RANK": "0"}, capture_output=True, text=True,
                              timeout=300)
        assert follower.wait(timeout=120) == 0, follower.stdout.read()
    finally:
        follower.kill()
    alone = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert lead.returncode == 0 and alone.returncode == 0, lead.stderr
    assert json.loads(lead.stdout)["token_ids"] == json.loads(alone.stdout)["token_ids"]


def test_a_start_that_cannot_reach_its_peers_says_so_in_one_line():
    """Rank 0 of 2 whose peer never comes (a 2 s limit here; 120 s in serve)."""
    from tests.server.conftest import free_port

    code = ("import datetime, torch\n"
            "from hotprefix.errors import PeerLostError\n"
            "from hotprefix.model.parallel import Parallel, Place\n"
            "try:\n"
            f"    Parallel.join(Place(0, 2), '127.0.0.1', {free_port()}, torch.device('cpu'),"
            " datetime.timedelta(seconds=2))\n"
            "except PeerLostError as e:\n"
            "    print(e)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    (line,) = done.stdout.splitlines()
    assert line.startswith("tensor parallel: rank 0 of 2 could not reach its peers at 127.0.0.1:") and \
        line.endswith("within 2s (DistStoreError)")


def test_a_spawned_rank_that_dies_before_joining_fails_the_start_at_once():
    """Rank 1 exits with status 3 as it starts (its config unpickles to os._exit(3)): rank 0
    sees the exit while it waits for its peers and says so in one line, long before the 120 s
    join limit (the subprocess's 60 s limit would end a wait for it)."""
    code = ("import os\n"
            "from hotprefix.config import EngineConfig, ModelConfig\n"
            "from hotprefix.engine.ranks import Ranks, launch_of\n"
            "from hotprefix.errors import PeerLostError\n"
            "class DiesInTheChild(str):\n"
            "    def __reduce__(self):\n"
            "        return os._exit, (3,)\n"
            "if __name__ == '__main__':\n"
            "    launch = launch_of(2, {})\n"
            "    try:\n"
            "        Ranks(EngineConfig(ModelConfig(DiesInTheChild('tiny'), tensor_parallel_size=2)), launch)\n"
            "    except PeerLostError as e:\n"
            "        print(e)\n"
            "        print(launch.port)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    line, port = done.stdout.splitlines()
    assert line == f"tensor parallel: rank 1 of 2 exited with status 3 before it joined rank 0 at 127.0.0.1:{port}"
