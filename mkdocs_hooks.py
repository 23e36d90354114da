"""MkDocs hooks (mkdocs.yml `hooks:`): keep the built site free of scripts from the internet.

Material's offline plugin adds the iframe-worker shim from unpkg.com to `extra.polyfills`
(it lets search run from file://). This hook runs after the plugins' `on_config` and drops
every polyfill that is not a local file, so the site never loads anything from outside.
Search then works whenever the site is served (`mkdocs serve`, `python -m http.server -d
site`); every page and link also works opened from the file system.
"""

from __future__ import annotations

from mkdocs.plugins import event_priority


@event_priority(-100)  # after the offline plugin has added its shim
def on_config(config):
    polyfills = config.extra.get("polyfills", [])
    config.extra["polyfills"] = [
        p for p in polyfills if not str(p).startswith(("http://", "https://", "//"))
    ]
    return config
