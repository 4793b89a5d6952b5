"""The ``trtbuild`` group: the builder's commands and the runtime's. Both command modules import
only click at their top (each command imports its work when invoked), so ``trtbuild build``
still does not load the runtime's engines."""
from __future__ import annotations

from importlib import metadata

import click

from .build_commands import build, draft, inspect, medusa, plan
from ..builder.errors import UserError
from .run_commands import bench, evaluate, run
from .serve_command import serve


def _version() -> str:
    try:
        return metadata.version("trtbuild")
    except metadata.PackageNotFoundError:
        return "unknown (not installed)"


class _Group(click.Group):
    """Prints UserError as one line and exits 2; lets --log-level debug show tracebacks."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except UserError as exc:
            click.echo(f"error: {exc}", err=True)
            if ctx.meta.get("trtbuild.debug"):
                raise
            ctx.exit(2)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(_version(), prog_name="trtbuild")
def main() -> None:
    """trtbuild: ahead-of-time TensorRT engines for Llama-family LLMs.

    \b
    Example:
      trtbuild build specs/tiny-code.yaml -o build/tiny-code
      trtbuild inspect build/tiny-code
      trtbuild run build/tiny-code --prompt "def fibonacci(n):"
      trtbuild bench build/tiny-code --workload skewed
      trtbuild plan specs/llama-3-8b.yaml --gpu H100-SXM
    """


for command in (build, inspect, plan, medusa, draft, run, bench, evaluate, serve):
    main.add_command(command)
