"""Fixtures: one tiny checkpoint, a served LLM, and an LLM of the same weights as reference."""

from __future__ import annotations

import pytest

from helpers.server import MAX_BODY_BYTES, make_llm, running_server, write_tiny_model


@pytest.fixture(scope="session")
def ckpt(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("server_ckpt") / "tiny")


@pytest.fixture(scope="session")
def ref_llm(ckpt):
    """Same weights, never served: the oracle for LLM.generate comparisons."""
    return make_llm(ckpt)


@pytest.fixture(scope="session")
def served(ckpt):
    """(base_url, app) of a server shared by the functional, bad-input and load tests."""
    llm = make_llm(ckpt)
    with running_server(llm, max_body_bytes=MAX_BODY_BYTES, max_n=8) as (url, app, _):
        yield url, app


@pytest.fixture
def url(served):
    return served[0]


@pytest.fixture
def client(url):
    import openai

    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
