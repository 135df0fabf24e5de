"""Mutation testing of the security-critical modules: ``make mutation`` (docs/mutation.md).

Runs mutmut (configured in pyproject.toml ``[tool.mutmut]``) over the named modules, or over every module
that config names, then prints per module the mutants generated, killed, survived and marked equivalent
(:data:`EQUIVALENT`), and the diff of every other mutant that was not killed. Exits 1 if any mutant
survived or no test reached it.

    python scripts/mutation.py                          # every module in [tool.mutmut] only_mutate
    python scripts/mutation.py warmup_tools/kv/hashing.py warmup_tools/triton/inputs.py
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORK = ROOT / "mutants"
LOG = WORK / "mutation-run.log"

#: mutmut's exit codes for one mutant's test run, folded into what the report counts.
#: NOTE: a timeout is the mutant making a test run past its CPU limit (a loop that no longer ends): a kill.
VERDICTS = {1: "killed", 3: "killed", 36: "killed", 24: "killed", -24: "killed", 152: "killed", 255: "killed",
            0: "survived", 5: "no tests", 33: "no tests"}

_UTF8_CASE = "codec names ignore case"
_ONE_ELEMENT = "the array has exactly one element (checked just before): -1, 1 and -2 all reshape it to [1]"
_TRUST, _WARMUP = "warmup_tools/triton/trust.py", "warmup_tools/triton/warmup.py"
_VERIFY = "warmup_tools/kv/snapshot_verify.py"
_OWNER_ONLY = "write_atomic's default mode is owner-only (PRIVATE_MODE, 0o600)"
_ENTROPY = "secrets' default entropy is 32 bytes"
_ONLY_SELF_COMPARED = ("the digest is kept in memory and only compared with digests of the same function; the "
                       "encoding stays injective (a length-prefixed value after each name)")

#: Mutants that cannot change behaviour: (source file, function, the mutated line) -> why.
#: NOTE: listed here rather than marked ``# pragma: no mutate`` in the source, because mutmut applies a
#: pragma to the whole statement it ends, and would also stop mutating what the tests do pin on that line.
#: An entry matches one mutation exactly; when the code changes, it stops matching and the mutant is
#: reported again (and the entry as stale).
EQUIVALENT: dict[tuple[str, str, str], str] = {
    ("warmup_tools/kv/hashing.py", "block_hashes",
     "public = dataclasses.replace(scope, tenant=PUBLIC_TENANT).extra_keys() if (public_blocks) or True else extra"):
        "computes the public keys also without a public prefix, where no block uses them",
    ("warmup_tools/kv/hashing.py", "CacheScope.extra_keys", ').encode("UTF-8")'): _UTF8_CASE,
    ("warmup_tools/kv/hashing.py", "CacheScope.extra_keys", 'separators=(",", "XX:XX"),'):
        "the scope is encoded as a JSON list, which has no key separator",
    ("warmup_tools/triton/inputs.py", "_single_string", 'return raw.decode("UTF-8")'): _UTF8_CASE,
    ("warmup_tools/triton/inputs.py", "_single_string",
     'raw = value.encode("UTF-8", "surrogatepass") if isinstance(value, str) else bytes(value)'): _UTF8_CASE,
    ("warmup_tools/triton/inputs.py", "_single_string", "value = array.reshape(+1)[0]"): _ONE_ELEMENT,
    ("warmup_tools/triton/inputs.py", "_single_string", "value = array.reshape(-2)[0]"): _ONE_ELEMENT,
    ("warmup_tools/triton/inputs.py", "parse_optional_text", "value = array.reshape(+1)[0]"): _ONE_ELEMENT,
    ("warmup_tools/triton/inputs.py", "parse_optional_text", "value = array.reshape(-2)[0]"): _ONE_ELEMENT,
    ("warmup_tools/triton/inputs.py", "check_text_size", "_check_length(array.reshape(+1)[0], name, max_bytes)"):
        _ONE_ELEMENT,
    ("warmup_tools/triton/inputs.py", "check_text_size", "_check_length(array.reshape(-2)[0], name, max_bytes)"):
        _ONE_ELEMENT,
    ("warmup_tools/triton/inputs.py", "parse_scalar", "value = array.reshape(+1)[0]"): _ONE_ELEMENT,
    ("warmup_tools/triton/inputs.py", "parse_scalar", "value = array.reshape(-2)[0]"): _ONE_ELEMENT,
    ("warmup_tools/triton/inputs.py", "parse_optional_text",
     'return value.decode(errors="replace") if isinstance(value, (bytes, np.bytes_)) else str(value)'):
        "UTF-8 is the default codec of bytes.decode",
    ("warmup_tools/triton/inputs.py", "parse_optional_text",
     'return value.decode("UTF-8", errors="replace") if isinstance(value, (bytes, np.bytes_)) else str(value)'):
        _UTF8_CASE,
    ("warmup_tools/triton/inputs.py", "parse_count", "value = parse_scalar(inputs, name, None, default)"):
        "parse_scalar reads every cast other than float and bool as int",
    ("warmup_tools/triton/inputs.py", "parse_identity", "value = parse_optional_string(inputs, name, None)"):
        "an absent or blank value is then None instead of '', and the next line treats both as absent",
    ("warmup_tools/triton/inputs.py", "parse_identity", "value = parse_optional_string(inputs, name, )"):
        "'' is parse_optional_string's default",
    (_TRUST, "_hash_key", 'return hashlib.sha256(key.encode("UTF-8")).digest()'): _UTF8_CASE,
    (_TRUST, "_mac",
     'return hmac.new(signing_key, b"tenant-token:" + payload.encode("UTF-8"), hashlib.sha256).digest()[:_MAC_BYTES]'):
        _UTF8_CASE,
    (_TRUST, "probe_secret_token",
     'return sign_token(_probe_signing_key(probe_secret.encode("UTF-8")), PROBE_TENANT, _hash_key(probe_secret),'):
        _UTF8_CASE,
    (_TRUST, "read_key_hashes", 'data = json.loads(raw.decode("UTF-8"))'): _UTF8_CASE,
    (_TRUST, "TenantTrust.from_files", 'probe = probe_secret.encode("UTF-8") if probe_secret else None'): _UTF8_CASE,
    (_TRUST, "add_tenant_key", 'write_atomic(secret_file, secrets.token_hex(32) + "\\n", )'): _OWNER_ONLY,
    (_TRUST, "add_tenant_key",
     'write_atomic(keys_file, json.dumps({"tenants": dict(sorted(tenants.items()))}, indent=2) + "\\n", )'):
        _OWNER_ONLY,
    (_TRUST, "add_tenant_key", 'write_atomic(secret_file, secrets.token_hex(None) + "\\n", mode=0o600)'): _ENTROPY,
    (_TRUST, "add_tenant_key", "key = secrets.token_urlsafe(None)"): _ENTROPY,
    (_TRUST, "TenantTrust.verify_key", 'given = _hash_key(key or "XXXX")'):
        "hashed only when there is no key, which `not key` refuses anyway; the hash only keeps the time the same",
    (_TRUST, "TenantTrust.verify_key",
     'matches = hmac.compare_digest(given, expected if expected is not None else b"XX\\0XX" * 32)'):
        "the placeholder is compared only for an unknown tenant, refused by `expected is None` anyway",
    (_TRUST, "TenantTrust.verify_key",
     'matches = hmac.compare_digest(given, expected if expected is not None else b"\\0" * 33)'):
        "the placeholder is compared only for an unknown tenant, refused by `expected is None` anyway",
    (_TRUST, "TenantTrust._signing_key", 'return _probe_signing_key(self.probe_secret or b"XXXX")'):
        "with neither secret no tenant has a key hash (from_files takes a keys file only with a deployment secret), "
        "so no token is signed or accepted under this key",
    (_TRUST, "TenantTrust._token_tenant", 'given = b"XXXX"'):
        "a MAC that is not hex fails the comparison with the 16-byte MAC as b'' or as b'XXXX'",
    (_TRUST, "TenantTrust._token_tenant",
     'current = key_version(key_hash) if key_hash is not None else "XX-XX" * (2 * _VERSION_BYTES)'):
        "the filler is compared only for an unknown tenant, refused by `key_hash is not None` anyway",
    (_TRUST, "TenantTrust._token_tenant",
     'current = key_version(key_hash) if key_hash is not None else "-" * (3 * _VERSION_BYTES)'):
        "the filler is compared only for an unknown tenant, refused by `key_hash is not None` anyway",
    (_WARMUP, "_digest",
     'h.update(name.encode("UTF-8") + b"\\0" + len(data[name]).to_bytes(8, "little") + data[name])'): _UTF8_CASE,
    (_WARMUP, "_digest",
     'h.update(name.encode("utf-8") + b"XX\\0XX" + len(data[name]).to_bytes(8, "little") + data[name])'):
        _ONLY_SELF_COMPARED,
    (_WARMUP, "_digest", 'h.update(name.encode("utf-8") + b"\\0" + len(data[name]).to_bytes(8, ) + data[name])'):
        _ONLY_SELF_COMPARED,
    (_WARMUP, "_digest",
     'h.update(name.encode("utf-8") + b"\\0" + len(data[name]).to_bytes(9, "little") + data[name])'):
        _ONLY_SELF_COMPARED,
    (_WARMUP, "_digest", "h = hashlib.blake2b(digest_size=17)"): _ONLY_SELF_COMPARED,
    (_WARMUP, "sample_plan_ids", 'plans.update(item.decode("UTF-8", "replace") for item in'): _UTF8_CASE,
    (_WARMUP, "sample_plan_ids", 'deserialize_tensor(data, "TYPE_STRING", [-2]) if item)'):
        "numpy reads any negative dimension as the one to infer: [-1] and [-2] give the same 1-D array",
    (_WARMUP, "OwnWarmupSamples.from_model_config",
     'runs = int(entry.get("batch_size") or 0) * max(int(entry.get("count") or 1), 1)'):
        "max(count, 1) makes an absent count 1 whether it first reads as 0 or 1",
    ("warmup_tools/kv/snapshot_verify.py", "salt_fingerprint",
     'return hashlib.sha256(b"warmup-kv-snapshot-salt:" + salt.encode("UTF-8")).hexdigest()[:16]'): _UTF8_CASE,
    ("warmup_tools/lora_adapter/snapshot_restore.py", "SnapshotRestorer._verify",
     "for drawn in verification_sample(blocks, 2.0, self._rng):"):
        "a share of 1 or more draws every block, in the generator's order, either way",
    (_VERIFY, "_canonical", 'return json.dumps(body, sort_keys=True, separators=(",", ":")).encode("UTF-8")'):
        _UTF8_CASE,
    (_VERIFY, "_read_manifest", 'data = json.loads(raw.decode("UTF-8"))'): _UTF8_CASE,
    (_VERIFY, "block_digest",
     'digest.update(str(tensor.dtype).encode("ASCII") + str(tuple(tensor.shape)).encode("ascii"))'): _UTF8_CASE,
    (_VERIFY, "block_digest",
     'digest.update(str(tensor.dtype).encode("ascii") + str(tuple(tensor.shape)).encode("ASCII"))'): _UTF8_CASE,
    ("warmup_tools/front/auth.py", "TenantResolver.resolve",
     "tenant = self._keys.tenant_for_key(key) if (key) or True else None"):
        "tenant_for_key matches no tenant for an empty or absent key (TenantKeys.tenant_for_key)",
    ("warmup_tools/common/control_json.py", "loads_bounded", 'text = raw.decode("UTF-8")'): _UTF8_CASE,
    ('warmup_tools/common/control_json.py', "_outside_strings",
     'marks = raw.replace(b"\\\\\\\\", b"XXXX").replace(b\'\\\\"\', b"").translate(None, not_counted)'):
        "bytes the translate deletes: an escape removed or replaced by them leaves the same marks (pairs are "
        "taken left to right, so no backslash left by it meets a quote it did not meet before)",
    ('warmup_tools/common/control_json.py', "_outside_strings",
     'marks = raw.replace(b"\\\\\\\\", b"").replace(b\'\\\\"\', b"XXXX").translate(None, not_counted)'):
        "bytes the translate deletes: an escaped quote removed or replaced by them leaves the same marks",
    ('warmup_tools/common/control_json.py', "_outside_strings", 'marks = marks.replace(b\'XX""XX\', b"")'):
        "two quotes side by side are taken out only to spare the split pieces: kept, the count is the same",
    ('warmup_tools/common/control_json.py', "_outside_strings", 'inside ^= (len(pieces) + 1) % 2 == 1'):
        "n - 1 and n + 1 have the same parity",
    ("warmup_tools/common/control_json.py", "nesting_depth", "break"):
        "only the root can be a scalar (children are pushed only when they are arrays or objects): the stack is "
        "empty after it either way",
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("modules", nargs="*", help="source files to mutate (default: every one in [tool.mutmut])")
    parser.add_argument("--max-children", type=int, default=os.cpu_count() or 2, help="mutants tested at once")
    args = parser.parse_args(argv)

    os.chdir(ROOT)  # mutmut reads ./pyproject.toml
    from mutmut.configuration import config

    configured = config().only_mutate
    modules = args.modules or configured
    unknown = [m for m in modules if m not in configured]
    if unknown:
        parser.error(f"not in [tool.mutmut] only_mutate: {', '.join(unknown)}")

    # NOTE: always from scratch: mutmut reuses earlier verdicts kept in mutants/, which could report a
    # mutant killed by a test that has changed since.
    shutil.rmtree(WORK, ignore_errors=True)
    WORK.mkdir()
    env = dict(os.environ)
    env.setdefault("WARMUP_ASSETS_DIR", str(ROOT / ".assets"))  # the tests run inside mutants/
    mutmut = Path(sys.executable).with_name("mutmut")
    with LOG.open("w") as log:
        run = subprocess.run(
            [str(mutmut), "run", "--max-children", str(args.max_children), *(dotted(m) + ".*" for m in modules)],
            env=env, stdout=log, stderr=subprocess.STDOUT, check=False,
        )
    if run.returncode != 0:
        print(LOG.read_text("utf-8", errors="replace")[-4000:])
        print(f"error: mutmut exited {run.returncode} (its output: {LOG.relative_to(ROOT)})")
        return 1

    failures, matched = 0, set()
    print(f"{'module':40} {'generated':>9} {'killed':>7} {'survived':>8} {'no tests':>8} {'equivalent':>10}")
    for module in modules:
        counts, diffs = Counter(), []
        meta = json.loads((WORK / (module + ".meta")).read_text("utf-8"))
        for name, code in sorted(meta["exit_code_by_key"].items()):
            verdict = VERDICTS.get(code, "other")
            if verdict == "survived":
                diff = subprocess.run([str(mutmut), "show", name], env=env, capture_output=True, text=True,
                                      check=True).stdout
                key = (module, function_of(module, name), mutated_line(diff))
                if key in EQUIVALENT:
                    verdict = "equivalent"
                    matched.add(key)
                else:
                    diffs.append(diff)
            elif verdict != "killed":
                diffs.append(f"# {name}: {verdict} (mutmut exit code {code})\n")
            counts[verdict] += 1
        print(f"{module:40} {counts.total():>9} {counts['killed']:>7} {counts['survived']:>8} "
              f"{counts['no tests']:>8} {counts['equivalent']:>10}"
              + (f"  (+{counts['other']} other)" if counts["other"] else ""))
        print("".join(diffs), end="", file=sys.stderr)
        failures += len(diffs)
    for key in sorted(set(EQUIVALENT) - matched):
        if key[0] in modules:
            print(f"note: no survivor matches the equivalent entry {key}: remove it if the code changed")
    if failures:
        print(f"error: {failures} mutants not killed (diffs above; mutmut's output: {LOG.relative_to(ROOT)})")
        return 1
    print("every mutant killed or marked equivalent")
    return 0


def dotted(path: str) -> str:
    return path.removesuffix(".py").replace("/", ".")


def function_of(module: str, mutant: str) -> str:
    """``warmup_tools.kv.hashing.xǁCacheScopeǁextra_keys__mutmut_9`` -> ``CacheScope.extra_keys``."""
    mangled = mutant.removeprefix(dotted(module) + ".").rsplit("__mutmut_", 1)[0]
    if mangled.startswith("xǁ"):  # a method: xǁClassǁmethod
        return mangled[2:].replace("ǁ", ".")
    return mangled.removeprefix("x_")


def mutated_line(diff: str) -> str:
    """The mutant's changed lines (``+`` side of ``mutmut show``), stripped and joined."""
    return "\n".join(line[1:].strip() for line in diff.splitlines() if line.startswith("+") and
                     not line.startswith("+++"))


if __name__ == "__main__":
    sys.exit(main())
