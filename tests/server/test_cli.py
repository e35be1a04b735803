"""`treeflash serve` flags: present, explained, and mapped to the engine's names."""

from __future__ import annotations

import argparse

import pytest

from treeflash.cli import make_parser
from treeflash.server.app import ServerConfig
from treeflash.server.cli import resolve_spec

FLAGS = [
    "--model",
    "--drafter",
    "--speculative-algorithm",
    "--speculative-ddtree-budget",
    "--page-size",
    "--max-model-len",
    "--max-running-requests",
    "--max-queued-requests",
    "--host",
    "--port",
    "--api-key",
    "--shutdown-timeout",
    "--device",
    "--dtype",
    "--max-n",
    "--max-body-bytes",
    "--tokenizer",
    "--chat-template",
]


def _serve_parser() -> argparse.ArgumentParser:
    sub = next(a for a in make_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["serve"]


def test_every_flag_has_help():
    p = _serve_parser()
    actions = {s: a for a in p._actions for s in a.option_strings}
    for flag in FLAGS:
        assert flag in actions, flag
        assert actions[flag].help and len(actions[flag].help) > 10, flag


def test_defaults_bind_loopback_and_map_to_the_config():
    args = make_parser().parse_args(["serve", "--model", "/m", "--max-n", "4"])
    assert (args.host, args.port) == ("127.0.0.1", 30000)
    cfg = ServerConfig.from_args(args)
    assert (cfg.model_name, cfg.max_n, cfg.shutdown_timeout) == ("/m", 4, 0.0)
    assert cfg.api_key is None or cfg.api_key  # from $TREEFLASH_API_KEY when set


def test_speculative_algorithm_names():
    parse = make_parser().parse_args
    assert resolve_spec(parse(["serve", "--model", "/m", "--drafter", "/d"])) == ("/d", None)
    assert resolve_spec(
        parse(["serve", "--model", "/m", "--drafter", "/d", "--speculative-algorithm", "dflash"])
    ) == ("/d", "dflash")
    assert resolve_spec(
        parse(["serve", "--model", "/m", "--drafter", "/d", "--speculative-algorithm", "NONE"])
    ) == (None, "off")
    with pytest.raises(ValueError, match="needs --drafter"):
        resolve_spec(parse(["serve", "--model", "/m", "--speculative-algorithm", "DDTREE"]))
    with pytest.raises(SystemExit):
        parse(["serve", "--speculative-algorithm", "MEDUSA"])


@pytest.mark.parametrize("port", ["0", "-1", "65536", "99999", "http"])
def test_bad_port_exit_2(port, capsys):
    with pytest.raises(SystemExit) as e:
        make_parser().parse_args(["serve", "--port", port])
    assert e.value.code == 2 and "--port" in capsys.readouterr().err


def test_taken_port_fails_before_the_model_loads(monkeypatch, capsys):
    # a port in use used to surface as uvicorn's "address already in use" only after the
    # weights had loaded (minutes at real size), and --port 99999 as an OverflowError traceback
    import socket

    import treeflash
    from treeflash.cli import main

    def no_load(*a, **kw):
        raise AssertionError("the model must not load when the port cannot be bound")

    monkeypatch.setattr(treeflash, "LLM", no_load)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        with pytest.raises(SystemExit) as e:
            main(["serve", "--host", "127.0.0.1", "--port", str(port)])
    assert e.value.code == 2
    assert f"cannot bind 127.0.0.1:{port}" in capsys.readouterr().err


def test_connection_limit_flags_map_to_the_config(capsys):
    parse = make_parser().parse_args
    cfg = ServerConfig.from_args(parse(["serve", "--model", "/m"]))
    assert (cfg.request_read_timeout, cfg.max_connections, cfg.max_connections_per_client) == (
        30.0, 4096, None)  # None: a quarter of --max-connections
    args = parse(["serve", "--model", "/m", "--request-read-timeout", "2.5", "--max-connections",
                  "64", "--max-connections-per-client", "0"])
    cfg = ServerConfig.from_args(args)
    assert (cfg.request_read_timeout, cfg.max_connections, cfg.max_connections_per_client) == (
        2.5, 64, 0)
    for flag, value in (("--request-read-timeout", "0"), ("--max-connections-per-client", "-1")):
        with pytest.raises(SystemExit) as e:
            parse(["serve", "--model", "/m", flag, value])
        assert e.value.code == 2 and flag in capsys.readouterr().err


def test_tokenizer_and_chat_template_reach_the_llm(monkeypatch):
    import treeflash
    from treeflash.server import cli

    seen = {}

    class Stop(Exception):
        pass

    def fake_llm(*args, **kw):
        seen.update(kw)
        raise Stop

    monkeypatch.setattr(treeflash, "LLM", fake_llm)
    args = make_parser().parse_args(["serve", "--model", "/m", "--tokenizer", "/tok", "--chat-template", "/t.jinja"])
    with pytest.raises(Stop):
        cli._load_and_serve(args, None, None, None)
    assert (seen["tokenizer"], seen["chat_template"]) == ("/tok", "/t.jinja")


def test_serve_logs_the_kv_tokens_per_gpu(monkeypatch, caplog):
    """serve reports the pool's capacity at startup: tokens per GPU, row format, bytes."""
    import logging

    import treeflash
    from treeflash.server import cli

    class Stop(Exception):
        pass

    class FakeLLM:
        cuda_graphs = False

        def __init__(self, *args, **kw):
            pass

        def kv_summary(self):
            return "123 tokens per GPU (fp8_e4m3 rows)"

    def stop(*a, **kw):
        raise Stop

    monkeypatch.setattr(treeflash, "LLM", FakeLLM)
    monkeypatch.setattr("treeflash.server.app.create_app", stop)
    args = make_parser().parse_args(["serve", "--model", "/m"])
    with caplog.at_level(logging.INFO), pytest.raises(Stop):
        cli._load_and_serve(args, None, None, None)
    assert "KV cache: 123 tokens per GPU (fp8_e4m3 rows)" in caplog.text


def test_ddtree_budget_takes_auto():
    parse = make_parser().parse_args
    assert parse(["serve", "--model", "/m", "--speculative-ddtree-budget", "auto"]).tree_budget == "auto"
    assert parse(["serve", "--model", "/m", "--speculative-ddtree-budget", "15"]).tree_budget == 15
