"""Command line: ``python -m warmup_tools <command>`` (or the ``warmup-tools`` console script)."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from pathlib import Path

from .config import REPO_ROOT, ServeConfig, load_config
from .errors import WarmupToolsError

LOGGER = logging.getLogger("warmup_tools")


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args) or 0)
    except WarmupToolsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="warmup_tools", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run tritonserver on the model repository until interrupted")
    _server_flags(serve)
    serve.set_defaults(func=_cmd_serve)

    assets = sub.add_parser("assets", help="build the demo model assets (LM, tokenizer, adapters, embedder)")
    assets.add_argument("--out", type=Path, default=REPO_ROOT / ".assets")
    assets.add_argument("--seed", type=int, default=0)
    assets.add_argument("--force", action="store_true", help="rebuild even if the assets are complete")
    assets.set_defaults(func=_cmd_assets)

    stanzas = sub.add_parser("stanzas", help="write model_warmup stanzas into the repository")
    stanzas.add_argument("--model-repository", type=Path, default=REPO_ROOT / "model_repository")
    stanzas.add_argument("--tokenizer", type=Path, default=REPO_ROOT / ".assets" / "lm",
                         help="tokenizer folder used to turn warm-up prompts into token ids")
    stanzas.set_defaults(func=_cmd_stanzas)

    demo = sub.add_parser("demo", help="start the server, stream requests for two adapters, stop")
    _server_flags(demo)
    demo.add_argument("--max-tokens", type=int, default=24)
    demo.set_defaults(func=_cmd_demo)
    return parser


def _server_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=Path, help="JSON file of ServeConfig fields")
    parser.add_argument("--model-repository", type=Path)
    parser.add_argument("--assets-dir", type=Path)
    parser.add_argument("--http-port", type=int)
    parser.add_argument("--grpc-port", type=int)
    parser.add_argument("--metrics-port", type=int)
    parser.add_argument("--host")
    parser.add_argument("--log-verbose", type=int)
    parser.add_argument("--ready-timeout-s", type=float)
    parser.add_argument("--log-file", type=Path)


def _serve_config(args: argparse.Namespace) -> ServeConfig:
    flags = {name: getattr(args, name) for name in (
        "model_repository", "assets_dir", "http_port", "grpc_port", "metrics_port", "host", "log_verbose",
        "ready_timeout_s", "log_file")}
    return load_config(ServeConfig, args.config, flags)


def _cmd_serve(args: argparse.Namespace) -> int:
    from .server import ServerPorts, TritonServer  # noqa: PLC0415

    config = _serve_config(args)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    server = TritonServer(config.model_repository,
                          ports=ServerPorts(config.http_port, config.grpc_port, config.metrics_port),
                          env=config.server_env(), log_path=config.log_file, log_verbose=config.log_verbose,
                          host=config.host)
    with server:
        server.wait_ready(timeout=config.ready_timeout_s)
        print(f"serving {config.model_repository}: HTTP {server.http_url}, gRPC {server.grpc_url}, "
              f"metrics {server.metrics_url} (log {server.log_path}); Ctrl-C stops", flush=True)
        while not stop.wait(1.0):
            if not server.is_alive():
                print(f"tritonserver exited with code {server.returncode}; log tail:\n{server.log_tail()}",
                      file=sys.stderr)
                return 1
    return 0


def _cmd_assets(args: argparse.Namespace) -> int:
    from .assets import build_demo_assets, ensure_demo_assets  # noqa: PLC0415

    assets = build_demo_assets(args.out, args.seed) if args.force else ensure_demo_assets(args.out, args.seed)
    print(f"demo assets ready in {assets.root} (adapters: {', '.join(assets.adapters)})")
    return 0


def _cmd_stanzas(args: argparse.Namespace) -> int:
    from .warmup_defaults import write_default_stanzas  # noqa: PLC0415

    files = write_default_stanzas(args.model_repository, args.tokenizer)
    print(f"wrote model_warmup stanzas with {len(files)} data files under {args.model_repository}")
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from .assets import ensure_demo_assets  # noqa: PLC0415
    from .demo import run_demo  # noqa: PLC0415

    config = _serve_config(args)
    ensure_demo_assets(config.assets_dir)
    run_demo(config, max_tokens=args.max_tokens)
    return 0
