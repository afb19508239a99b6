"""Batch invariance through the server: bf16, seeded requests sent one at a time and then all at once from
concurrent clients get the same tokens and the same logprobs, bit for bit."""

from __future__ import annotations

import concurrent.futures

import httpx

from tests.helpers import live_server

MODEL = "invariant"


def test_concurrent_requests_get_the_bits_they_get_alone(text_model, tmp_path):
    bodies = [{"model": MODEL, "prompt": f"Story {i}: once upon a time, a {w}", "max_tokens": 16, "seed": 100 + i,
               "temperature": 1.0, "logprobs": 0, "ignore_eos": True}
              for i, w in enumerate(["cat", "king", "river", "moon", "road", "tree", "ship", "bell"])]
    with live_server(text_model, tmp_path, MODEL, "--dtype", "bfloat16", "-k", "4", "--max-model-len", "256",
                     "--max-batch-size", "16") as url:
        def complete(body):
            r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            return choice["text"], choice["logprobs"]["token_logprobs"]

        alone = [complete(body) for body in bodies]
        with concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:
            together = list(pool.map(complete, bodies * 2))
    assert together == alone * 2
