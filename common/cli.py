"""What the stages' click commands share: turning a library error into a one-line message that names the flags."""

from __future__ import annotations

from collections.abc import Mapping

import click


def cli_error(e: Exception, flags: Mapping[str, str] | None = None) -> click.ClickException:
    """`e`'s message plus, when it carries `params` (common/kinds.FixableError), the flags that set them:
    a parameter `vram_bytes` is the flag `flags["vram_bytes"]`, else `--vram-bytes`."""
    flags = flags or {}
    names = [flags.get(p, "--" + p.replace("_", "-")) for p in getattr(e, "params", ())]
    return click.ClickException(f"{e} ({', '.join(dict.fromkeys(names))})" if names else str(e))
