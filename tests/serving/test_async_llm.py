"""AsyncLLM: the engine core in its own process, asyncio consumers on this side.

Deltas concatenate to LLM.generate's output; many concurrent consumers each get their
own; cancelling a consumer aborts its request and frees its row and pages; bad input
raises by name before any work; a dead core is reported, never waited on forever."""

from __future__ import annotations

import asyncio

import pytest

from graphdecode import LLM, SamplingParams
from graphdecode.server import AsyncLLM, EngineDeadError
from tests.helpers import SMALL_ENGINE

ENGINE = dict(SMALL_ENGINE, max_batch_size=16, cpu_threads=1)
PARAMS = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(text_model):
    with AsyncLLM(text_model, **ENGINE) as eng:
        yield eng


async def collect(engine, prompt, params=PARAMS, request_id=None):
    tokens: dict[int, list[int]] = {}
    text: dict[int, str] = {}
    finished = 0
    async for out in engine.generate(prompt, params, request_id=request_id):
        assert finished == 0, "a delta after the finished one"
        for c in out.outputs:
            tokens.setdefault(c.index, []).extend(c.token_ids)
            text[c.index] = text.get(c.index, "") + c.text
        finished += out.finished
    assert finished == 1
    return [tokens[i] for i in sorted(tokens)], [text[i] for i in sorted(text)]


def test_concurrent_consumers_get_exactly_llm_generate(engine, text_model):
    prompts = [f"Request {i}: the capital of France is" for i in range(12)]
    sampled = SamplingParams(n=3, temperature=0.9, seed=4, max_tokens=16)

    async def main():
        greedy = asyncio.gather(*[collect(engine, p) for p in prompts])
        seeded = asyncio.gather(*[collect(engine, p, sampled) for p in prompts[:4]])
        return await greedy, await seeded

    greedy, seeded = asyncio.run(asyncio.wait_for(main(), 120))
    llm = LLM(text_model, **{k: v for k, v in ENGINE.items() if k != "threads"})
    want = llm.generate(prompts, PARAMS)
    assert [g[0] for g in greedy] == [[c.token_ids for c in o.outputs] for o in want]
    assert [g[1] for g in greedy] == [[c.text for c in o.outputs] for o in want]
    want_seeded = llm.generate(prompts[:4], sampled)
    assert [s[0] for s in seeded] == [[c.token_ids for c in o.outputs] for o in want_seeded]


def test_cancelling_a_consumer_aborts_its_request(engine):
    async def main():
        seen = asyncio.Event()

        async def consume():
            async for _ in engine.generate("A very long story", SamplingParams(max_tokens=200, ignore_eos=True),
                                           request_id="cancel-me"):
                seen.set()

        task = asyncio.create_task(consume())
        await asyncio.wait([task, asyncio.create_task(seen.wait())], return_when=asyncio.FIRST_COMPLETED)
        assert not task.done(), task.exception()  # the request is running, not failed
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(100):  # the core learns of it between two steps
            stats = await engine.stats()
            if stats["requests_finished"] and not engine.load.get("running"):
                break
            await asyncio.sleep(0.05)
        return await engine.stats()

    stats = asyncio.run(asyncio.wait_for(main(), 120))
    assert engine.num_unfinished == 0
    assert stats["generated_tokens"] < 200 + 24 * 16 * 4  # the long request did not run to its end
    assert engine.load["running"] == 0


def test_abort_by_id_and_bad_input(engine):
    async def main():
        stream = engine.generate("Count to a thousand", SamplingParams(max_tokens=200), request_id="abort-me")
        first = await stream.__anext__()
        await engine.abort("abort-me")
        last = first
        async for out in stream:
            last = out
        return last

    last = asyncio.run(asyncio.wait_for(main(), 120))
    assert last.finished and last.outputs[-1].finish_reason == "abort"
    with pytest.raises(ValueError, match="max_model_len"):
        engine.generate({"prompt_token_ids": [5] * 300}, PARAMS)
    with pytest.raises(ValueError, match="top_p"):
        engine.generate("hi", SamplingParams(top_p=0))
    with pytest.raises(TypeError, match="sampling_params"):
        engine.generate("hi", {"temperature": 0})
    with pytest.raises(TypeError, match="prompts"):
        engine.generate(42)


def test_a_dead_core_is_reported(text_model):
    async def main(eng):
        stream = eng.generate("hello", SamplingParams(max_tokens=200, ignore_eos=True))
        await stream.__anext__()
        eng._process.kill()
        with pytest.raises(EngineDeadError):
            async for _ in stream:
                pass

    with AsyncLLM(text_model, **ENGINE) as eng:
        asyncio.run(asyncio.wait_for(main(eng), 60))
        with pytest.raises(EngineDeadError):
            eng.generate("again")
    assert eng._process.poll() is not None


def test_unknown_argument_and_bad_model(tmp_path):
    with pytest.raises(TypeError, match="max_model_length"):
        AsyncLLM(str(tmp_path), max_model_length=5)
    with pytest.raises(ValueError, match="model"):
        AsyncLLM(str(tmp_path / "nope"), cpu_threads=1)


def test_a_request_starts_when_generate_is_called_and_a_dropped_one_is_aborted(engine):
    """Inside a running loop the request goes to the core at once (a server hands over a burst
    without waiting for its responses to start); a stream dropped unread aborts its request."""
    short = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)

    async def main():
        before = (await engine.stats())["requests_finished"]
        stream = engine.generate("Started before anyone reads", short, request_id="eager")
        for _ in range(200):  # it runs to its end with nobody reading it
            if (await engine.stats())["requests_finished"] > before:
                break
            await asyncio.sleep(0.02)
        else:
            raise AssertionError("the request did not run before its stream was read")
        outs = [out async for out in stream]  # every delta was kept for the late reader
        assert outs[-1].finished and sum(len(o.outputs[0].token_ids) for o in outs) == 3

        generated = (await engine.stats())["generated_tokens"]
        dropped = engine.generate("Nobody will read this", SamplingParams(max_tokens=200, ignore_eos=True),
                                  request_id="dropped")
        del dropped
        for _ in range(200):
            stats = await engine.stats()
            if stats["requests_finished"] >= before + 2 and not engine.load.get("running"):
                break
            await asyncio.sleep(0.02)
        return stats, stats["generated_tokens"] - generated

    stats, generated = asyncio.run(asyncio.wait_for(main(), 120))
    assert engine.num_unfinished == 0
    assert engine.load["running"] == 0
    assert generated < 200  # the dropped request was aborted, not left to run its 200 tokens


def test_truncate_prompt_tokens_runs_the_last_tokens(engine, text_model):
    """SamplingParams.truncate_prompt_tokens (vLLM's): LLM and AsyncLLM run only the prompt's last N tokens
    (-1: max_model_len), so a prompt longer than the context is cut, not refused; the text stays as given."""
    ids = [(7 * i) % 400 + 50 for i in range(300)]  # longer than max_model_len (256)
    llm = LLM(text_model, **ENGINE)
    with pytest.raises(ValueError, match="leave no room"):
        llm.generate({"prompt_token_ids": ids}, PARAMS)
    tail = llm.generate({"prompt_token_ids": ids[-20:]}, PARAMS)[0]
    cut = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                                                 truncate_prompt_tokens=20))[0]
    assert cut.prompt_token_ids == ids[-20:] and cut.outputs[0].token_ids == tail.outputs[0].token_ids
    text = "one two three four five six seven eight nine ten"
    short = llm.generate(text, SamplingParams(temperature=0, max_tokens=4, truncate_prompt_tokens=3))[0]
    assert short.prompt == text and short.prompt_token_ids == llm.get_tokenizer()(text)["input_ids"][-3:]
    async_tokens, _ = asyncio.run(collect(engine, {"prompt_token_ids": ids}, SamplingParams(
        temperature=0, max_tokens=24, ignore_eos=True, truncate_prompt_tokens=20)))
    assert async_tokens == [tail.outputs[0].token_ids]
    with pytest.raises(ValueError, match="leave no room"):  # -1 keeps max_model_len tokens: none left to generate
        llm.generate({"prompt_token_ids": ids}, SamplingParams(truncate_prompt_tokens=-1))
    with pytest.raises(ValueError, match=r"prompts\[0\]: truncate_prompt_tokens \(300\) is greater than max_model_len"):
        llm.generate({"prompt_token_ids": ids}, SamplingParams(truncate_prompt_tokens=300))
    for bad in (0, -2):
        with pytest.raises(ValueError, match="truncate_prompt_tokens must be an integer >= 1, or -1"):
            SamplingParams(truncate_prompt_tokens=bad)
    llm.close()


def test_weights_sent_as_tensors_change_the_answers(engine, text_model, tmp_path):
    """AsyncLLM.update_weights pickles the tensors down the pipe; the core writes them between requests."""
    import torch
    from safetensors.torch import load_file

    from tests.helpers import hf_greedy
    from tests.host.test_weight_updates import _trained

    trained = _trained(text_model, tmp_path / "trained", seed=4)
    ids = [5, 71, 300, 12, 9]

    async def main():
        update = await engine.update_weights(load_file(f"{trained}/model.safetensors"), weight_version="rl-1")
        after = await collect(engine, {"prompt_token_ids": ids})
        version = await engine.get_weight_version()
        with pytest.raises(ValueError, match="'model.norm.weight' has shape"):
            await engine.update_weights({"model.norm.weight": torch.ones(3)})
        with pytest.raises(TypeError, match="weight_version"):
            await engine.update_weights({}, weight_version=7)
        with pytest.raises(TypeError, match=r"\(name, torch.Tensor\) pair"):  # checked here, before pickling
            await engine.update_weights([("model.norm.weight", [1.0, 2.0])])
        await engine.update_weights_from_disk(text_model)
        return update, after, version, await collect(engine, {"prompt_token_ids": ids})

    update, after, version, restored = asyncio.run(asyncio.wait_for(main(), 120))
    assert update.weight_version == "rl-1" == version and update.updated > 0
    assert after[0][0] == hf_greedy(trained, [ids], 24)[0] != restored[0][0] == hf_greedy(text_model, [ids], 24)[0]


def test_a_pause_holds_requests_across_an_update_in_two_parts(engine, text_model, tmp_path):
    """pause_generation("wait") lets the running request finish on the old weights; a request arriving while paused
    waits through both halves of the update and runs on the new weights once resumed."""
    from safetensors.torch import load_file

    from tests.helpers import hf_greedy
    from tests.host.test_weight_updates import _trained

    trained = _trained(text_model, tmp_path / "trained", seed=5)
    weights = list(load_file(f"{trained}/model.safetensors").items())
    ids = [5, 71, 300, 12, 9]
    long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)

    async def main():
        running = asyncio.ensure_future(collect(engine, {"prompt_token_ids": ids}, long))
        while engine.load.get("running", 0) < 1:
            await asyncio.sleep(0.01)
        await engine.pause_generation(mode="wait")
        assert running.done() and await engine.is_paused()
        held = asyncio.ensure_future(collect(engine, {"prompt_token_ids": ids}))
        await engine.update_weights(weights[: len(weights) // 2])
        await asyncio.sleep(0.3)
        assert not held.done()  # half the weights are in: nothing runs
        await engine.update_weights(weights[len(weights) // 2:])
        await engine.resume_generation()
        after = await held
        with pytest.raises(ValueError, match="mode"):
            await engine.pause_generation(mode="keep")
        await engine.update_weights_from_disk(text_model)
        return (await running)[0][0], after[0][0], await engine.is_paused()

    old, new, paused = asyncio.run(asyncio.wait_for(main(), 120))
    assert old == hf_greedy(text_model, [ids], 200)[0] and new == hf_greedy(trained, [ids], 24)[0] and not paused
