"""`hotprefix serve --load-format dummy --attention-backend triton` over real HTTP: a
config-only model served with random weights through the Triton kernels (interpreted
here, no GPU), answering the openai client as the torch backend answers offline."""

from __future__ import annotations

import shutil

import openai

from hotprefix import LLM, SamplingParams
from tests.server.conftest import launch_server, stop_process


def test_serve_dummy_weights_through_the_triton_backend(tiny_llama, tmp_path):
    folder = tmp_path / "config-only"
    folder.mkdir()
    for f in tiny_llama[0].iterdir():  # config and tokenizer, no weights
        if f.suffix != ".safetensors":
            shutil.copy(f, folder / f.name)
    prompt = list(range(3, 30))
    offline = LLM(str(folder), load_format="dummy", attention_backend="torch", device="cpu", block_size=4,
                  num_blocks_override=64).generate([prompt], SamplingParams(temperature=0, max_tokens=5,
                                                                            ignore_eos=True))
    proc, url = launch_server([str(folder), "--load-format", "dummy", "--attention-backend", "triton",
                               "--enforce-eager", "--block-size", "4", "--num-gpu-blocks-override", "64"])
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="x")
        model = client.models.list().data[0].id
        r = client.completions.create(model=model, prompt=prompt, max_tokens=5, temperature=0,
                                      extra_body={"ignore_eos": True})
        assert r.choices[0].text == offline[0].outputs[0].text and r.usage.completion_tokens == 5
        chunks = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=4, temperature=0, stream=True,
                                                extra_body={"ignore_eos": True})
        assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content is not None) >= 1
    finally:
        out = stop_process(proc)
    assert "random weights of config-only's shape" in out
    assert "runs Triton's interpreter" in out
