"""The OpenAI-compatible HTTP server: protocol types, engine thread, app, metrics, CLI.

Import `treeflash.server.app` for `create_app`/`make_server`; this package itself imports
nothing, so `treeflash --help` works without the `server` extra installed.
"""
