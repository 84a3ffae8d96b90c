"""``lorapack serve``: the calibrated twin behind vLLM's HTTP API (one server, or one per GPU of a plan)."""

from __future__ import annotations

import logging
import math
import re
import sys
from pathlib import Path
from typing import Annotated

import typer

from ..errors import SpecError
from .common import (
    GpuOpt,
    ModelOpt,
    ProfileOpt,
    VllmVersionOpt,
    apply_vllm_version,
    err_console,
    load_profile,
)

# vllm serve flags the twin reads; any other flag is accepted with a one-line warning that the twin ignores it
_NAME_EQ_PATH = re.compile(r"^[^\s=-][^\s=]*=\S+$")


def _split_extra(extra: list[str], lora_given: bool) -> tuple[list[str], list[str]]:
    """``(more --lora-modules values, ignored flags)`` from the arguments typer did not know. vLLM's
    ``--lora-modules a=p b=q`` gives typer ``a=p`` and leaves ``b=q``: bare ``name=path`` / JSON words right
    after the known options are more modules."""
    modules, ignored = [], []
    i = 0
    while i < len(extra):
        word = extra[i]
        if word.startswith("--"):
            flag = word.split("=", 1)[0]
            ignored.append(flag)
            i += 1
            while "=" not in word and i < len(extra) and not extra[i].startswith("--"):  # its value(s)
                i += 1
            continue
        if lora_given and (_NAME_EQ_PATH.match(word) or word.lstrip().startswith("{")):
            modules.append(word)
        else:
            ignored.append(word)
        i += 1
    return modules, ignored


def _log_to_stderr(name: str) -> None:
    """The server's run-time notes (the HTTP-path probe) on stderr, in the start-up lines' style."""
    logger = logging.getLogger(name)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s lorapack serve: %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False


def serve(
    ctx: typer.Context,
    model: ModelOpt = None,
    gpu: GpuOpt = None,
    profile: ProfileOpt = None,
    vllm_version: VllmVersionOpt = None,
    plan: Annotated[Path | None, typer.Option("--plan", help="Serve a plan: one twin server per GPU of the "
                                              "--out directory of lorapack place, on the ports of its "
                                              "routes.json (--base-port) with the flags of its plan.json.")] = None,
    base_port: Annotated[int, typer.Option("--base-port", help="With --plan: GPU g listens on base-port + g "
                                           "(place's --base-port).")] = 8000,
    enable_lora: Annotated[bool, typer.Option("--enable-lora", help="vLLM's flag: serve LoRA adapters.")] = False,
    lora_modules: Annotated[list[str] | None, typer.Option(
        "--lora-modules", help="vLLM's flag: name=path, or JSON {\"name\", \"path\", \"base_model_name\"} plus "
        "lorapack's \"rank\" (default: --max-lora-rank). The path is a label: never opened.")] = None,
    max_loras: Annotated[int, typer.Option("--max-loras", help="vLLM's flag: GPU adapter slots.")] = 1,
    max_lora_rank: Annotated[int | None, typer.Option("--max-lora-rank", help="vLLM's flag (default 16).")] = None,
    max_cpu_loras: Annotated[int | None, typer.Option("--max-cpu-loras", help="vLLM's flag (default: "
                                                      "--max-loras).")] = None,
    max_num_seqs: Annotated[int | None, typer.Option("--max-num-seqs", help="vLLM's flag (default: the "
                                                     "profile's).")] = None,
    max_num_batched_tokens: Annotated[int | None, typer.Option("--max-num-batched-tokens", help="vLLM's flag "
                                                               "(default: the profile's).")] = None,
    max_model_len: Annotated[int | None, typer.Option("--max-model-len", help="vLLM's flag (default: the "
                                                      "model's).")] = None,
    served_model_name: Annotated[str | None, typer.Option("--served-model-name", help="vLLM's flag: the base "
                                                          "model's name in the API (default: the model key).")] = None,
    host: Annotated[str, typer.Option("--host", help="Address to listen on (loopback unless you say "
                                      "otherwise).")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", help="TCP port.")] = 8000,
    time_scale: Annotated[float, typer.Option("--time-scale", help="Twin seconds per wall second (20: an hour "
                                              "in 3 min). Every time the API reports is in twin seconds.")] = 1.0,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the order the worker walks a batch's adapters "
                                      "(a Python set's order in vLLM).")] = 0,
    api_key: Annotated[str | None, typer.Option("--api-key", envvar="VLLM_API_KEY",
                                                help="vLLM's flag: require this bearer token on /v1 routes.")] = None,
    tokenizer: Annotated[Path | None, typer.Option("--tokenizer", help="A local tokenizer directory (its "
                                                   "tokenizer.json) to count prompt tokens; default: one token per "
                                                   "4 UTF-8 bytes.")] = None,
    max_connections: Annotated[int, typer.Option("--max-connections", help="Open connections before the server "
                                                 "answers 503.")] = 4096,
    max_body_bytes: Annotated[int, typer.Option("--max-body-bytes", help="Largest request body.")] = 4 * 1024 * 1024,
    http_path_ms: Annotated[float | None, typer.Option(
        "--http-path-ms", help="What this server's HTTP path adds to a client's TTFT, taken out of the profile's "
        "frontend share (which holds a real API server's path). Default: measured at start-up by a loopback "
        "probe; 0: off.")] = None,
) -> None:
    """Serve the calibrated twin behind vLLM's HTTP API: routers, gateways and clients can be tried on a plan
    without GPUs.

    Takes vllm serve's flags under their names; other vllm serve flags are accepted with a one-line warning.
    Runs until Ctrl-C. Load / unload endpoints only with VLLM_ALLOW_RUNTIME_LORA_UPDATING=1, as in vLLM."""
    try:
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        raise SpecError("lorapack serve needs the HTTP stack: pip install 'lorapack[serve]'") from None
    from ..serve.launch import parse_lora_modules, plan_commands, run_server, serve_plan

    more, ignored = _split_extra(list(ctx.args), bool(lora_modules))
    for flag in ignored:
        err_console.print(f"[yellow]warning:[/yellow] {flag}: a vllm serve flag the twin ignores", highlight=False,
                          soft_wrap=True)
    for name, v, lo in (("--port", port, 1), ("--max-connections", max_connections, 1),
                        ("--max-body-bytes", max_body_bytes, 1024), ("--base-port", base_port, 1)):
        if v < lo or (name.endswith("port") and v > 65535):
            raise SpecError(f"{name} {v}: expected an integer >= {lo}" + (" and <= 65535" if "port" in name else ""))
    if http_path_ms is not None and not (math.isfinite(http_path_ms) and http_path_ms >= 0):
        raise SpecError(f"--http-path-ms {http_path_ms}: expected a number of milliseconds >= 0")
    if plan is not None:
        given = [o for o, v in (("--lora-modules", lora_modules), ("--served-model-name", served_model_name)) if v]
        if given:
            raise SpecError(f"--plan and {', '.join(given)}: a plan brings its own adapters and names")
        passthrough = ["--time-scale", str(time_scale), "--seed", str(seed)]
        if http_path_ms is not None:
            passthrough += ["--http-path-ms", str(http_path_ms)]
        for opt, v in (("--model", model), ("--gpu", gpu), ("--profile", profile), ("--vllm-version", vllm_version),
                       ("--tokenizer", tokenizer), ("--api-key", api_key)):
            if v:
                passthrough += [opt, str(v)]
        commands = plan_commands(plan, base_port, host, passthrough, plans_model=model is None and profile is None)
        code = serve_plan(commands, lambda m: err_console.print(m, highlight=False, soft_wrap=True))
        raise typer.Exit(code)

    from ..serve.http import HttpOptions, TwinApp
    from ..serve.twin import TwinServer
    from ..server import ServerConfig

    prof = apply_vllm_version(load_profile(model, gpu, profile), vllm_version)
    modules = parse_lora_modules(list(lora_modules or []) + more)
    flags = ServerConfig(max_loras=max_loras, max_lora_rank=max_lora_rank, max_cpu_loras=max_cpu_loras,
                         max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                         max_model_len=max_model_len, vllm_version=vllm_version)
    twin = TwinServer(prof, flags, modules, enable_lora=enable_lora, served_model_name=served_model_name,
                      time_scale=time_scale, seed=seed)
    count = None
    if tokenizer is not None:
        count = _load_tokenizer(tokenizer)
    probe_host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)
    app = TwinApp(twin, HttpOptions(api_key=api_key, max_body_bytes=max_body_bytes, tokenizer=count,
                                    http_path_ms=http_path_ms, probe_address=(probe_host, port)))
    _log_to_stderr("lorapack.serve")
    srv = twin.srv
    # vLLM's own start-up lines, which lorapack measure --log / --launch reads (measure.probe.read_log)
    resolved = {"enable_lora": enable_lora, "max_loras": srv.max_loras, "max_lora_rank": srv.max_lora_rank,
                "max_cpu_loras": srv.max_cpu_loras, "max_num_seqs": srv.max_num_seqs,
                "max_num_batched_tokens": srv.max_num_batched_tokens, "max_model_len": srv.max_model_len,
                "gpu_memory_utilization": srv.gpu_memory_utilization,
                "enable_prefix_caching": srv.enable_prefix_caching}
    err_console.print(f"INFO lorapack serve: non-default args: {resolved!r}", highlight=False, soft_wrap=True,
                      markup=False)
    err_console.print(f"INFO lorapack serve: Initializing a V1 LLM engine (v{srv.vllm_version}) with config: "
                      f"device_config=twin-of-{prof.gpu}, tensor_parallel_size={prof.tensor_parallel_size}",
                      highlight=False, soft_wrap=True, markup=False)
    err_console.print(f"INFO lorapack serve: GPU KV cache size: {srv.kv_cache_tokens:,} tokens", highlight=False,
                      soft_wrap=True, markup=False)
    err_console.print(f"lorapack serve: the twin of {prof.model} on {prof.gpu} (vLLM {srv.rules.name} rules), "
                      f"{len(modules)} adapter(s), --max-loras {srv.max_loras} --max-lora-rank {srv.max_lora_rank}, "
                      f"KV cache {srv.kv_cache_tokens:,} tokens; http://{host}:{port} (time scale {time_scale:g})",
                      highlight=False, soft_wrap=True)
    run_server(app.app, host, port, max_connections)


def _load_tokenizer(path: Path):
    """A token counter from a local tokenizer directory (``tokenizer.json``, read by the ``tokenizers`` library)."""
    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.is_file():
        raise SpecError(f"--tokenizer {path}: no tokenizer.json there (expected a local tokenizer directory)")
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise SpecError("--tokenizer needs the tokenizers library: pip install tokenizers") from None
    try:
        tok = Tokenizer.from_file(str(file))
    except Exception as exc:  # noqa: BLE001 - the library's errors are plain Exceptions
        raise SpecError(f"--tokenizer {path}: {' '.join(str(exc).split())}") from None
    return lambda text: len(tok.encode(text, add_special_tokens=True).ids)
