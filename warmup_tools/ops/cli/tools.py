"""``assets``, ``traffic``, ``adapters``, ``tenant-key``, ``deploy-secrets`` and ``parameters``: the demo's
inputs, the adapter set of a running server, trust mode's keys, and the parameter reference."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from warmup_tools.common.errors import ConfigError, WarmupToolsError
from warmup_tools.common.flags import (
    add_arguments,
    add_options,
    add_settings,
    function_kwargs,
    options_from_args,
    settings_from_args,
)
from warmup_tools.ops.cli.options import (
    AdapterAddOptions,
    AdapterRetireOptions,
    AssetsOptions,
    DeploySecretsOptions,
    ProfileFitOptions,
    TenantKeyOptions,
    TrafficOptions,
)
from warmup_tools.ops.deploy_secrets import make_deployment_secrets
from warmup_tools.server.config import ServeConfig

#: The server's field a command that builds the demo assets reads (``--assets-dir``, ``WARMUP_ASSETS_DIR``).
ASSETS = ("assets_dir",)
ADAPTER_HELP = "the adapter's name"


def assets_dir(args: argparse.Namespace) -> Path:
    """The demo assets' folder a command took (``--assets-dir``): ServeConfig's assets_dir."""
    return Path(settings_from_args(ServeConfig, args, only=ASSETS).assets_dir)


def add_commands(sub: Any) -> None:
    assets = sub.add_parser("assets", help="build the demo model assets (LM, tokenizer, adapters, embedder)")
    add_options(assets, AssetsOptions)
    assets.set_defaults(func=_cmd_assets)

    traffic = sub.add_parser("traffic", help="write seeded, realistic request logs (one file per day)")
    add_options(traffic, TrafficOptions)
    traffic.set_defaults(func=_cmd_traffic)

    adapters = sub.add_parser("adapters", help="add, retire or list LoRA adapters on a running server")
    add_settings(adapters, ServeConfig, only=("control_dir",), file=False)
    actions = adapters.add_subparsers(dest="action", required=True)
    add = actions.add_parser("add", help="load an adapter from adapter_root, warm it, make it live")
    add.add_argument("name", help=ADAPTER_HELP)
    add_options(add, AdapterAddOptions)
    retire = actions.add_parser("retire", help="stop serving an adapter and free its weights")
    retire.add_argument("name", help=ADAPTER_HELP)
    add_options(retire, AdapterRetireOptions)
    actions.add_parser("status", help="each instance's adapter states")
    adapters.set_defaults(func=_cmd_adapters)

    key = sub.add_parser("tenant-key", help="trust mode: give a tenant a new key (only its hash is stored)")
    key.add_argument("tenant", help="the tenant's name")
    add_options(key, TenantKeyOptions)
    key.set_defaults(func=_cmd_tenant_key)

    secrets = sub.add_parser("deploy-secrets", help="trust mode: make a deployment's secret, the probe tenant's key "
                                                    "and a random Redis password in a folder (keeps what exists)")
    add_options(secrets, DeploySecretsOptions)
    add_arguments(secrets, make_deployment_secrets)
    secrets.set_defaults(func=_cmd_deploy_secrets)

    fit = sub.add_parser("profile-fit", help="fit a simulated engine's profile to the real engine on this machine "
                                             "(times HfEngine.forward_batch on the demo LM, least squares)")
    add_settings(fit, ServeConfig, only=ASSETS, file=False)
    add_options(fit, ProfileFitOptions)
    add_arguments(fit, _fit_profile())
    fit.set_defaults(func=_cmd_profile_fit)

    params = sub.add_parser("parameters", help="print the parameter reference (docs/parameters.md) generated from "
                                               "the settings objects")
    params.set_defaults(func=_cmd_parameters)


def _cmd_assets(args: argparse.Namespace) -> int:
    from warmup_tools.demo.assets import build_demo_assets, ensure_demo_assets

    opts = options_from_args(AssetsOptions, args)
    assets = build_demo_assets(opts.out, opts.seed) if opts.force else ensure_demo_assets(opts.out, opts.seed)
    print(f"demo assets ready in {assets.root} (adapters: {', '.join(assets.adapters)})")
    return 0


def _cmd_traffic(args: argparse.Namespace) -> int:
    from warmup_tools.sim.traffic import main_traffic

    opts = options_from_args(TrafficOptions, args)
    main_traffic(opts.out, opts.seed, opts.days, opts.requests_per_day, opts.gzip)
    return 0


def _cmd_adapters(args: argparse.Namespace) -> int:
    from warmup_tools.control.registry import ControlRegistry
    from warmup_tools.control.state import AdapterState

    control_dir = settings_from_args(ServeConfig, args, only=("control_dir",)).control_dir
    if control_dir is None:
        raise ConfigError("--control-dir (WARMUP_CONTROL_DIR) must name the lora_adapter model's control folder")
    registry = ControlRegistry(control_dir)
    if args.action == "status":
        statuses = registry.statuses()
        if not statuses:
            print(f"no instance has reported to {control_dir} (is the server running with this control dir?)")
        for instance, adapters in sorted(statuses.items()):
            for name, status in sorted(adapters.items()):
                print(f"{instance}\t{name}\t{status.state.value}\trev {status.revision}\t{status.detail}")
        return 0
    if args.action == "add":
        add = options_from_args(AdapterAddOptions, args)
        prompts = list(add.warm_prompt)
        if add.warm_file:
            prompts += [line for line in add.warm_file.read_text().splitlines() if line.strip()]
        spec = registry.add(args.name, prompts, live=not add.register_only, path=add.path)
        target = AdapterState.REGISTERED if add.register_only else AdapterState.LIVE
        wait, instances = add.wait, add.instances
    else:
        retire = options_from_args(AdapterRetireOptions, args)
        spec = registry.retire(args.name)
        target = AdapterState.RETIRED
        wait, instances = retire.wait, retire.instances
    print(f"{spec.name}: target {spec.target} (revision {spec.revision})", flush=True)
    if wait > 0:
        reached = registry.wait_until(spec.name, target, instances=instances, timeout_s=wait)
        for instance, status in sorted(reached.items()):
            print(f"{instance}: {status.state.value} {status.detail}")
    return 0


def _cmd_tenant_key(args: argparse.Namespace) -> int:
    from warmup_tools.common.errors import InvalidInputError
    from warmup_tools.triton.trust import add_tenant_key

    opts = options_from_args(TenantKeyOptions, args)
    try:
        key = add_tenant_key(opts.keys_file, opts.secret_file, args.tenant)
    except InvalidInputError as exc:
        raise WarmupToolsError(str(exc)) from None
    print(f"tenant {args.tenant}: key {key}\n(shown once; {opts.keys_file} keeps only its SHA-256)", file=sys.stderr)
    print(key)
    return 0


def _cmd_deploy_secrets(args: argparse.Namespace) -> int:
    folder = options_from_args(DeploySecretsOptions, args).dir
    files = make_deployment_secrets(folder, **function_kwargs(make_deployment_secrets, args))
    print(f"deployment secrets ready in {files.folder}")
    return 0


def _fit_profile() -> Any:
    from warmup_tools.lora_adapter.profile_fit import fit_profile

    return fit_profile


def _cmd_profile_fit(args: argparse.Namespace) -> int:
    import json

    from warmup_tools.demo.assets import ensure_demo_assets
    from warmup_tools.lora_adapter.profile_fit import summary

    out = options_from_args(ProfileFitOptions, args).out
    profile = _fit_profile()(ensure_demo_assets(assets_dir(args)).root, **function_kwargs(_fit_profile(), args))
    out.write_text(json.dumps(profile.to_json(), indent=2) + "\n", encoding="utf-8")
    print(f"wrote {out}: {summary(profile)}")
    return 0


def _cmd_parameters(args: argparse.Namespace) -> int:
    from warmup_tools.ops.parameters import parameters_markdown

    sys.stdout.write(parameters_markdown())
    return 0
