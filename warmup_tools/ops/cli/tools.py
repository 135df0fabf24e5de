"""``assets``, ``traffic``, ``adapters``, ``tenant-key``, ``deploy-secrets`` and ``parameters``: the demo's
inputs, the adapter set of a running server, trust mode's keys, and the parameter reference."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from warmup_tools.common.errors import WarmupToolsError
from warmup_tools.ops.cli.flags import add_arguments, function_kwargs
from warmup_tools.ops.deploy_secrets import make_deployment_secrets
from warmup_tools.server.config import REPO_ROOT, ServeConfig

_DEFAULTS = ServeConfig()


def add_commands(sub: Any) -> None:
    from warmup_tools.demo.assets import DEFAULT_SEED
    from warmup_tools.sim.traffic import TrafficConfig

    assets = sub.add_parser("assets", help="build the demo model assets (LM, tokenizer, adapters, embedder)")
    assets.add_argument("--out", type=Path, default=_DEFAULTS.assets_dir)
    assets.add_argument("--seed", type=int, default=DEFAULT_SEED)
    assets.add_argument("--force", action="store_true", help="rebuild even if the assets are complete")
    assets.set_defaults(func=_cmd_assets)

    traffic = sub.add_parser("traffic", help="write seeded, realistic request logs (one file per day)")
    generated = TrafficConfig()
    traffic.add_argument("--out", type=Path, default=REPO_ROOT / "runs" / "traffic")
    traffic.add_argument("--seed", type=int, default=generated.seed)
    traffic.add_argument("--days", type=int, default=generated.days)
    traffic.add_argument("--requests-per-day", type=int, default=generated.requests_per_day)
    traffic.add_argument("--gzip", action="store_true")
    traffic.set_defaults(func=_cmd_traffic)

    adapters = sub.add_parser("adapters", help="add, retire or list LoRA adapters on a running server")
    adapters.add_argument("--control-dir", type=Path, default=_DEFAULTS.control_dir,
                          help="the lora_adapter model's control_dir (WARMUP_CONTROL_DIR)")
    actions = adapters.add_subparsers(dest="action", required=True)
    add = actions.add_parser("add", help="load an adapter from adapter_root, warm it, make it live")
    add.add_argument("name")
    add.add_argument("--path", help="folder under adapter_root (default: the name)")
    add.add_argument("--warm-prompt", action="append", help="a prompt to pre-fill (repeatable)")
    add.add_argument("--warm-file", type=Path, help="file of prompts to pre-fill, one per line")
    add.add_argument("--register-only", action="store_true", help="register without loading it")
    add.add_argument("--wait", type=float, default=300.0, help="seconds to wait for every instance (0: don't)")
    add.add_argument("--instances", type=int, help="how many instances must report (default: all that report)")
    retire = actions.add_parser("retire", help="stop serving an adapter and free its weights")
    retire.add_argument("name")
    retire.add_argument("--wait", type=float, default=120.0, help="seconds to wait for every instance (0: don't)")
    retire.add_argument("--instances", type=int, help="how many instances must report (default: all that report)")
    actions.add_parser("status", help="each instance's adapter states")
    adapters.set_defaults(func=_cmd_adapters)

    key = sub.add_parser("tenant-key", help="trust mode: give a tenant a new key (only its hash is stored)")
    key.add_argument("tenant")
    key.add_argument("--keys-file", type=Path, required=True, help="the tenant_keys_file of tokenizer_cache")
    key.add_argument("--secret-file", type=Path, required=True,
                     help="the deployment_secret_file of the composing models (created if missing)")
    key.set_defaults(func=_cmd_tenant_key)

    secrets = sub.add_parser("deploy-secrets", help="trust mode: make a deployment's secret, the probe tenant's key "
                                                    "and a random Redis password in a folder (keeps what exists)")
    secrets.add_argument("--dir", type=Path, required=True, help="the folder (made 0700; every file 0600)")
    add_arguments(secrets, make_deployment_secrets)
    secrets.set_defaults(func=_cmd_deploy_secrets)

    fit = sub.add_parser("profile-fit", help="fit a simulated engine's profile to the real engine on this machine "
                                             "(times HfEngine.forward_batch on the demo LM, least squares)")
    fit.add_argument("--assets-dir", type=Path, default=_DEFAULTS.assets_dir,
                     help="the demo assets (built there when missing)")
    fit.add_argument("--out", type=Path, required=True, help="the profile JSON to write")
    add_arguments(fit, _fit_profile())
    fit.set_defaults(func=_cmd_profile_fit)

    params = sub.add_parser("parameters", help="print the parameter reference (docs/parameters.md) generated from "
                                               "the settings objects")
    params.set_defaults(func=_cmd_parameters)


def _cmd_assets(args: argparse.Namespace) -> int:
    from warmup_tools.demo.assets import build_demo_assets, ensure_demo_assets

    assets = build_demo_assets(args.out, args.seed) if args.force else ensure_demo_assets(args.out, args.seed)
    print(f"demo assets ready in {assets.root} (adapters: {', '.join(assets.adapters)})")
    return 0


def _cmd_traffic(args: argparse.Namespace) -> int:
    from warmup_tools.sim.traffic import main_traffic

    main_traffic(args.out, args.seed, args.days, args.requests_per_day, args.gzip)
    return 0


def _cmd_adapters(args: argparse.Namespace) -> int:
    from warmup_tools.control.registry import ControlRegistry
    from warmup_tools.control.state import AdapterState

    registry = ControlRegistry(args.control_dir)
    if args.action == "status":
        statuses = registry.statuses()
        if not statuses:
            print(f"no instance has reported to {args.control_dir} (is the server running with this control dir?)")
        for instance, adapters in sorted(statuses.items()):
            for name, status in sorted(adapters.items()):
                print(f"{instance}\t{name}\t{status.state.value}\trev {status.revision}\t{status.detail}")
        return 0
    if args.action == "add":
        prompts = list(args.warm_prompt or [])
        if args.warm_file:
            prompts += [line for line in args.warm_file.read_text().splitlines() if line.strip()]
        spec = registry.add(args.name, prompts, live=not args.register_only, path=args.path)
        target = AdapterState.REGISTERED if args.register_only else AdapterState.LIVE
    else:
        spec = registry.retire(args.name)
        target = AdapterState.RETIRED
    print(f"{spec.name}: target {spec.target} (revision {spec.revision})", flush=True)
    if args.wait > 0:
        reached = registry.wait_until(spec.name, target, instances=args.instances, timeout_s=args.wait)
        for instance, status in sorted(reached.items()):
            print(f"{instance}: {status.state.value} {status.detail}")
    return 0


def _cmd_tenant_key(args: argparse.Namespace) -> int:
    from warmup_tools.common.errors import InvalidInputError
    from warmup_tools.triton.trust import add_tenant_key

    try:
        key = add_tenant_key(args.keys_file, args.secret_file, args.tenant)
    except InvalidInputError as exc:
        raise WarmupToolsError(str(exc)) from None
    print(f"tenant {args.tenant}: key {key}\n(shown once; {args.keys_file} keeps only its SHA-256)", file=sys.stderr)
    print(key)
    return 0


def _cmd_deploy_secrets(args: argparse.Namespace) -> int:
    files = make_deployment_secrets(args.dir, **function_kwargs(make_deployment_secrets, args))
    print(f"deployment secrets ready in {files.folder}")
    return 0


def _fit_profile() -> Any:
    from warmup_tools.lora_adapter.profile_fit import fit_profile

    return fit_profile


def _cmd_profile_fit(args: argparse.Namespace) -> int:
    import json

    from warmup_tools.demo.assets import ensure_demo_assets
    from warmup_tools.lora_adapter.profile_fit import summary

    profile = _fit_profile()(ensure_demo_assets(args.assets_dir).root, **function_kwargs(_fit_profile(), args))
    args.out.write_text(json.dumps(profile.to_json(), indent=2) + "\n", encoding="utf-8")
    print(f"wrote {args.out}: {summary(profile)}")
    return 0


def _cmd_parameters(args: argparse.Namespace) -> int:
    from warmup_tools.ops.parameters import parameters_markdown

    sys.stdout.write(parameters_markdown())
    return 0
