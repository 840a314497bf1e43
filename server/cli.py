"""`pi-serve`: thin click command over `Server` (server/serve.py); the model flags are pi-generate's."""

from __future__ import annotations

import logging

import click
from hotneurons.common.cli import StageCommand
from hotneurons.common.kinds import BatchStep
from hotneurons.runtime.cli import open_runtime, runtime_options
from hotneurons.server.config import ServeConfig


@click.command(cls=StageCommand, context_settings={"help_option_names": ["-h", "--help"]})
@runtime_options
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on (0.0.0.0: every "
              "interface; set --api-key then).")
@click.option("--port", default=8080, show_default=True, help="TCP port (0: any free one, printed at start).")
@click.option("--api-key", envvar="PI_SERVE_API_KEY", default=None, help="Require 'Authorization: Bearer KEY' on "
              "/v1 requests [env PI_SERVE_API_KEY].")
@click.option("--max-queue", default=ServeConfig.max_queue, show_default=True, help="Requests that may wait behind "
              "the running one; more are answered 503.")
@click.option("--timeout", default=ServeConfig.timeout, show_default=True, help="Seconds a request may take, queue "
              "wait included; a generation still running then ends with finish_reason 'length'. 0: no limit.")
@click.option("--max-tokens", default=ServeConfig.max_tokens, show_default=True, help="Tokens to generate when a "
              "request names no max_tokens (clipped to the context).")
@click.option("--parallel", type=int, default=None, help="Requests decoded together, each in its own KV cache "
              "slot (continuous batching; our decoders). Default: the run's placement's (pi-solve --parallel N, which "
              "budgets the slots), else the slots that fit --vram beside the loaded model, at most 4 (1 for a "
              "transformers model).")
@click.option("--batch-step", type=click.Choice(BatchStep.values()), default="auto", show_default=True,
              help="With --parallel > 1: how the running requests decode a token each: batched (one eager step for "
              "all, weight reads shared), interleaved (the batch-1 step, CUDA graphs and all, for each in turn) or "
              "auto (interleaved where the runtime replays CUDA graphs: there it is faster; docs/serve.md).")
@click.option("--no-prompt-cache", is_flag=True, help="Compute every prompt whole (by default a prompt that starts "
              "with tokens a KV cache still holds from an earlier request, a chat's history, computes only the rest).")
@click.option("--model-id", default=None, help="Model name in /v1/models and responses [the model's own name].")
@click.option("--quiet", "-q", is_flag=True, help="No access log.")
def main(host, port, api_key, max_queue, timeout, max_tokens, parallel, batch_step, no_prompt_cache, model_id, quiet,
         runtime):
    """Serve the runtime over an OpenAI-compatible HTTP API (completions, chat completions, streaming).

    Example: pi-serve --run runs/demo --port 8080, then
    curl localhost:8080/v1/chat/completions -d '{"messages": [{"role": "user", "content": "Hi"}]}'

    The OpenAPI document is at /openapi.json (no /docs page: Swagger UI loads from a CDN, and this runs offline).
    """
    logging.basicConfig(level=logging.WARNING if quiet else logging.INFO, format="%(asctime)s %(message)s")
    try:
        cfg = ServeConfig(host, port, api_key or None, max_queue, timeout or None, max_tokens, model_id, parallel or 1,
                          batch_step, prompt_cache=not no_prompt_cache)
    except ValueError as e:
        raise click.UsageError(str(e))
    rt = open_runtime(runtime)
    if parallel is None:  # the slots the placement was budgeted for, else what the budget leaves room for (<= 4)
        from dataclasses import replace

        from hotneurons.runtime.batch import slots_allowed
        from hotneurons.runtime.placement import solved_summary

        solved = solved_summary(runtime.run_dir)
        cfg = replace(cfg, parallel=solved.flags.parallel if solved is not None and solved.flags.parallel > 1
                      else slots_allowed(rt))
    from hotneurons.server.serve import serve

    serve(rt, cfg, ready=lambda s: click.echo(f"pi-serve: {s.model_id} ({rt.mode} on {rt.device}) at {s.url}/v1, "
                                              f"{cfg.parallel} at once, queue {cfg.max_queue}, Ctrl-C stops", err=True))


if __name__ == "__main__":
    main()
