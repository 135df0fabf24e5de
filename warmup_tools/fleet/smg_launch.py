"""``python -m warmup_tools.fleet.smg_launch [--control-key-file FILE] <smg launch flags>``: smg's own launcher, with
the router's control-plane key read from a file (the deployment's ``router_control.key``: FleetSettings'
``router_key_file``) instead of its command line.

smg 1.13's ``smg launch`` takes ``--control-plane-api-keys id:name:role:key`` on its command line only (its Python
launcher reads no variable and no file for it), and a command line is readable by every process of the host
(``ps``, ``/proc/<pid>/cmdline``). This launcher parses the other flags with smg's own parser
(``smg.launch_router.parse_router_args``), adds the key it reads from ``FILE`` to the parsed arguments and starts
smg in this process (``smg.launch_router.launch_router``), so the key is in no process's command line."""

from __future__ import annotations

import sys
from pathlib import Path

#: smg's id, name and role of the control-plane key (``RouterArgs.control_plane_api_keys``: (id, name, key, role)).
CONTROL_KEY_ID, CONTROL_KEY_NAME, CONTROL_KEY_ROLE = "warmup-control", "warmup join", "admin"
KEY_FILE_FLAG = "--control-key-file"


def main(argv: list[str]) -> int:
    try:
        from smg.launch_router import launch_router, parse_router_args
    except ImportError:
        print("smg_launch: smg is not installed: `pip install smg==1.13.0` (a dependency of this package)",
              file=sys.stderr)
        return 2

    from warmup_tools.common.deployment import DeploymentSecrets
    from warmup_tools.common.errors import WarmupToolsError

    key = None
    if argv[:1] == [KEY_FILE_FLAG]:
        if len(argv) < 2:
            print(f"smg_launch: {KEY_FILE_FLAG} needs the file of the router's control-plane key", file=sys.stderr)
            return 2
        path, argv = Path(argv[1]), argv[2:]
        try:
            key = DeploymentSecrets(path.parent).read_key(path)
        except WarmupToolsError as exc:
            print(f"smg_launch: {exc}", file=sys.stderr)
            return 2
    router_args = parse_router_args(argv)
    if key is not None:
        router_args.control_plane_api_keys = [(CONTROL_KEY_ID, CONTROL_KEY_NAME, key, CONTROL_KEY_ROLE)]
    launch_router(router_args)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
