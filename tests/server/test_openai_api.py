"""The official openai client against a real server: completions and chat, streamed and not."""

from __future__ import annotations

import httpx
import openai
import pytest

from treeflash import SamplingParams

pytestmark = pytest.mark.slow

PROMPT = "def f(x): return"


def _stream_text(stream) -> tuple[str, list, object]:
    texts, reasons, usage = [], [], None
    for chunk in stream:
        for c in chunk.choices:
            texts.append(c.text if hasattr(c, "text") else (c.delta.content or ""))
            if c.finish_reason:
                reasons.append(c.finish_reason)
        usage = chunk.usage or usage
    return "".join(texts), reasons, usage


def test_models_lists_the_served_name(client):
    models = client.models.list().data
    assert [m.id for m in models] == ["tiny"]
    assert models[0].max_model_len == 512


def test_models_retrieve(client):
    assert client.models.retrieve("tiny").id == "tiny"
    for name in ("nope", "org/nope"):  # a name with "/" reaches the route, not a bare 404
        with pytest.raises(openai.NotFoundError, match=f"The model `{name}` does not exist"):
            client.models.retrieve(name)


def test_greedy_completion_equals_llm_generate(client, ref_llm):
    ref = ref_llm.generate(PROMPT, SamplingParams(max_tokens=24, ignore_eos=True))[0]
    r = client.completions.create(
        model="tiny",
        prompt=PROMPT,
        max_tokens=24,
        temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    choice = r.choices[0]
    assert choice.token_ids == ref.token_ids
    assert choice.text == ref.text
    assert choice.finish_reason == "length"
    n_prompt = len(ref_llm.encode(PROMPT))
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (
        n_prompt,
        24,
        n_prompt + 24,
    )


def test_token_id_prompt_equals_llm_generate(client, ref_llm):
    ids = [5, 17, 33, 2, 90, 41]
    ref = ref_llm.generate(ids, SamplingParams(max_tokens=10, ignore_eos=True))[0]
    r = client.completions.create(
        model="tiny",
        prompt=ids,
        max_tokens=10,
        temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    assert r.choices[0].token_ids == ref.token_ids


def test_streamed_text_equals_non_streamed(client):
    kw = dict(
        model="tiny", prompt=PROMPT, max_tokens=30, temperature=0, extra_body={"ignore_eos": True}
    )
    whole = client.completions.create(**kw)
    text, reasons, usage = _stream_text(
        client.completions.create(stream=True, stream_options={"include_usage": True}, **kw)
    )
    assert text == whole.choices[0].text
    assert reasons == ["length"]
    assert usage.completion_tokens == 30 and usage.prompt_tokens == whole.usage.prompt_tokens


def test_stream_without_usage_has_no_usage_chunk_and_ends_with_done(url):
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 5, "stream": True, "temperature": 0}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]"
    assert all(ln.startswith("data: ") for ln in lines)
    assert all('"usage"' not in ln for ln in lines[:-1])


def test_chat_streamed_equals_non_streamed_and_has_usage(client):
    kw = dict(
        model="tiny",
        messages=[
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "hello world"},
        ],
        max_tokens=20,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    whole = client.chat.completions.create(**kw)
    assert whole.choices[0].message.role == "assistant"
    assert whole.usage.completion_tokens == 20
    text, reasons, usage = _stream_text(
        client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw)
    )
    assert text == whole.choices[0].message.content
    assert reasons == ["length"]
    assert usage.total_tokens == whole.usage.total_tokens


def test_chat_plain_template_prompt_equals_llm_generate(client, ref_llm, served):
    serving = served[1].state.treeflash.serving
    assert serving.template_source == "plain"  # the tiny tokenizer has no chat template
    prompt = "user: hello\nassistant:"
    ref = ref_llm.generate(prompt, SamplingParams(max_tokens=12, ignore_eos=True))[0]
    r = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hello"}],
        max_tokens=12,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert r.choices[0].message.content == ref.text
    assert r.usage.prompt_tokens == len(ref_llm.encode(prompt))


def test_chat_without_max_tokens_runs_to_eos_or_context(client):
    r = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], temperature=0
    )
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.total_tokens <= 512


def test_n_choices_differ_and_seeds_reproduce(client):
    kw = dict(
        model="tiny",
        prompt=PROMPT,
        max_tokens=16,
        temperature=1.0,
        n=4,
        seed=11,
        extra_body={"ignore_eos": True},
    )
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1, 2, 3]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert len({c.text for c in a.choices}) > 1  # choice i samples with seed + i
    assert a.usage.completion_tokens == 64
    c = client.completions.create(**{**kw, "seed": 12})
    assert [x.text for x in c.choices] != [x.text for x in a.choices]


def test_n_streamed_equals_non_streamed_per_choice(client):
    kw = dict(
        model="tiny",
        prompt=PROMPT,
        max_tokens=12,
        temperature=0.8,
        n=3,
        seed=5,
        extra_body={"ignore_eos": True},
    )
    whole = client.completions.create(**kw)
    texts = ["", "", ""]
    for chunk in client.completions.create(stream=True, **kw):
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == [c.text for c in whole.choices]


def test_batch_of_prompts(client, ref_llm):
    prompts = ["hello", "def f(x):"]
    r = client.completions.create(
        model="tiny", prompt=prompts, max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
    )
    refs = ref_llm.generate(prompts, SamplingParams(max_tokens=6, ignore_eos=True))
    assert [c.text for c in sorted(r.choices, key=lambda c: c.index)] == [o.text for o in refs]


def test_stop_string_cuts_text_streamed_and_not(client):
    kw = dict(
        model="tiny", prompt=PROMPT, max_tokens=30, temperature=0, extra_body={"ignore_eos": True}
    )
    full = client.completions.create(**kw).choices[0].text
    stop = full[5:7]
    assert len(stop) == 2
    cut = client.completions.create(stop=[stop], **kw).choices[0]
    assert cut.finish_reason == "stop"
    assert cut.text == full[: full.index(stop)]
    text, reasons, _ = _stream_text(client.completions.create(stop=stop, stream=True, **kw))
    assert (text, reasons) == (cut.text, ["stop"])


def test_health_and_health_generate(url):
    assert httpx.get(url + "/health").json() == {"status": "ok"}
    r = httpx.get(url + "/health_generate", timeout=30)
    assert r.status_code == 200 and r.json()["status"] == "ok"


def test_metrics_text(url, client):
    client.completions.create(model="tiny", prompt="hello", max_tokens=3, temperature=0)
    text = httpx.get(url + "/metrics").text
    for name in (
        "treeflash:spec_decode_num_drafts_total",
        "treeflash:spec_decode_num_draft_tokens_total",
        "treeflash:spec_decode_num_accepted_tokens_total",
        "treeflash:time_to_first_token_seconds_bucket",
        "treeflash:inter_token_latency_seconds",
        "treeflash:num_requests_running",
        "treeflash:num_requests_waiting",
        "treeflash:kv_cache_usage_perc",
        "treeflash:num_preemptions_total",
        "treeflash:num_aborted_requests_total",
        "treeflash:kv_cache_free_pages",
    ):
        assert name in text, name


def test_tokenizer_chat_template_is_used(ckpt, tmp_path, ref_llm):
    import shutil

    from helpers.server import make_llm, running_server

    path = tmp_path / "with_template"
    shutil.copytree(ckpt, path)
    (path / "chat_template.jinja").write_text(
        "{% for m in messages %}{% if m['role'] == 'system' %}"
        "{{ raise_exception('no system messages') }}{% endif %}"
        "<{{ m['role'] }}>{{ m['content'] | trim }}{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    llm = make_llm(path)
    with running_server(llm) as (url, app, _):
        assert app.state.treeflash.serving.template_source == "tokenizer"
        body = {
            "model": "tiny",
            "max_tokens": 5,
            "temperature": 0,
            "ignore_eos": True,
            "messages": [{"role": "user", "content": " hello "}],
        }
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=30).json()
        ref = ref_llm.generate(
            "<user>hello<assistant>", SamplingParams(max_tokens=5, ignore_eos=True)
        )[0]
        assert r["choices"][0]["message"]["content"] == ref.text
        assert r["usage"]["prompt_tokens"] == len(ref_llm.encode("<user>hello<assistant>"))
        body["messages"] = [{"role": "system", "content": "x"}]
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=30)
        assert r.status_code == 400 and "no system messages" in r.json()["error"]["message"]
