"""The OpenAI-compatible HTTP server: protocol types, engine thread, app, metrics, CLI."""

from treeflash.server.app import ServerConfig, create_app, make_server

__all__ = ["ServerConfig", "create_app", "make_server"]
