#!/usr/bin/env python3
"""The layering check: no #include runs upward, crosses sim's parts where it must not, or pulls a
third-party library's header into a layer that does not link that library.

    scripts/check_layering.py [--root DIR] [--probe FILE=PATH ...]
    scripts/check_layering.py --self-test DIR

Exit 0 when every include is allowed; 1 with one line per offending include,
"<path>:<line>: includes <what>: <rule>"; 2 on bad arguments. --probe checks FILE as if it lived at
PATH in the tree. --self-test checks each file in DIR as if it lived where its first line says
("// checked as: <path>") and passes only if exactly its lines marked "expect-violation" are
flagged (tests/data/layering: an upward include, the simulator including the testbed, ...).
Both run in CI by ctest (`layering_check`, `layering_check_self_test`, label unit).

The layers, lowest first (docs/architecture.md). A file may include its own folder and those its
row names; a quoted include is "folder/..." relative to the source root, and one without a
folder (same directory) is always allowed. tests/, scripts/, cmake/ and docs/ are not checked.
"""

import argparse
import pathlib
import re
import sys

DES_GROUP = ["sim/workload", "sim/metrics", "sim/policy", "sim/cost"]
BELOW_SIM = ["common", "topology", "backends"]

# (folder prefix, the folders it may include besides its own), most specific first.
LAYERS = [
    ("common", []),
    ("topology", ["common"]),
    ("backends", ["common", "topology"]),
    ("transfer", ["common", "topology", "backends"]),
    # The simulator library (pdsim_des) links neither transfer/, MPI, Boost nor CLI11.
    ("sim/workload", BELOW_SIM + DES_GROUP),
    ("sim/metrics", BELOW_SIM + DES_GROUP),
    ("sim/policy", BELOW_SIM + DES_GROUP),
    ("sim/cost", BELOW_SIM + DES_GROUP),
    ("sim/des", BELOW_SIM + DES_GROUP),
    ("sim/testbed", BELOW_SIM + ["transfer"] + DES_GROUP + ["sim/des"]),
    ("sim/cli", BELOW_SIM + ["transfer", "sim"]),
    ("sim", BELOW_SIM + ["transfer", "sim"]),
    ("bench", BELOW_SIM + ["transfer", "sim"]),
]
PROJECT_FOLDERS = ("common/", "topology/", "backends/", "transfer/", "sim/", "bench/")

# Third-party headers: allowed only where their library is linked.
THIRD_PARTY = [
    ("MPI", re.compile(r"^mpi\.h$"),
     ["common/mpi_check.h", "common/mpi_check.cpp", "transfer", "sim/testbed", "sim/cli"]),
    ("Boost", re.compile(r"^boost/"), ["transfer", "sim/testbed"]),
    ("CLI11", re.compile(r"^CLI/"), ["sim/cli"]),
    ("CUDA", re.compile(r"^(cuda|cublas|nccl|flashinfer/|cub/|thrust/|cooperative_groups)"),
     ["common/cuda_check.h", "common/nccl_check.h", "backends/cuda", "transfer", "sim/cli"]),
]

INCLUDE = re.compile(r'^\s*#\s*include\s*([<"])([^>"]+)[>"]')
SOURCE_SUFFIXES = {".h", ".hpp", ".cpp", ".cc", ".cu", ".cuh"}


def under(path, prefixes):
    return any(path == p or path.startswith(p + "/") for p in prefixes)


def layer_of(path):
    for prefix, allowed in LAYERS:
        if under(path, [prefix]):
            return prefix, allowed
    return None, None


def check_file(text, path):
    """The violations in one file's text, checked as if it lived at `path`."""
    layer, allowed = layer_of(path)
    if layer is None:
        return []
    found = []
    for line_no, line in enumerate(text.splitlines(), start=1):
        match = INCLUDE.match(line)
        if not match:
            continue
        quoted, target = match.group(1) == '"', match.group(2)
        if quoted and "/" in target and target.startswith(PROJECT_FOLDERS):
            if not under(target, [layer] + allowed):
                rule = f"{layer}/ may include only {layer}/"
                if allowed:
                    rule += " and " + ", ".join(a + "/" for a in allowed)
                found.append(f'{path}:{line_no}: includes "{target}": {rule}')
            continue
        if quoted:
            continue
        for library, pattern, where in THIRD_PARTY:
            if pattern.match(target) and not under(path, where):
                found.append(f"{path}:{line_no}: includes <{target}>: {library} headers only in "
                             + ", ".join(where))
    return found


def self_test(folder):
    """0 when every planted violation in `folder` is flagged and nothing else is, else 1."""
    files = sorted(p for p in pathlib.Path(folder).iterdir() if p.suffix in SOURCE_SUFFIXES)
    if not files:
        print(f"check_layering.py: --self-test {folder}: no source files there", file=sys.stderr)
        return 2
    failures = 0
    for file_path in files:
        text = file_path.read_text(encoding="utf-8")
        first = text.splitlines()[0] if text else ""
        match = re.match(r"^// checked as: (\S+)$", first)
        if not match:
            print(f"{file_path}:1: expected '// checked as: <path>'", file=sys.stderr)
            return 2
        expected = {n for n, line in enumerate(text.splitlines(), start=1)
                    if INCLUDE.match(line) and line.rstrip().endswith("// expect-violation")}
        flagged = {int(v.split(":")[1]) for v in check_file(text, match.group(1))}
        for line_no in sorted(expected - flagged):
            print(f"{file_path}:{line_no}: a planted violation was not flagged")
        for line_no in sorted(flagged - expected):
            print(f"{file_path}:{line_no}: flagged, but not marked expect-violation")
        failures += len(expected ^ flagged)
        print(f"{file_path.name} as {match.group(1)}: {len(flagged & expected)} of "
              f"{len(expected)} planted violations flagged")
    return 1 if failures else 0


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", default=str(pathlib.Path(__file__).resolve().parent.parent),
                        help="the source tree (default: this script's repository)")
    parser.add_argument("--probe", action="append", default=[], metavar="FILE=PATH",
                        help="also check FILE as if it were PATH in the tree")
    parser.add_argument("--self-test", metavar="DIR",
                        help="check the planted violations in DIR instead of the tree")
    args = parser.parse_args()
    if args.self_test:
        return self_test(args.self_test)
    root = pathlib.Path(args.root)
    if not (root / "common").is_dir():
        print(f"check_layering.py: --root {root}: no common/ folder there", file=sys.stderr)
        return 2

    files = []
    for folder in ("common", "topology", "backends", "transfer", "sim", "bench"):
        files += [p for p in sorted((root / folder).rglob("*")) if p.suffix in SOURCE_SUFFIXES]
    checks = [(p, p.relative_to(root).as_posix()) for p in files]
    for probe in args.probe:
        file_name, sep, path = probe.partition("=")
        if not sep or not path:
            print(f"check_layering.py: --probe '{probe}': expected FILE=PATH", file=sys.stderr)
            return 2
        checks.append((pathlib.Path(file_name), path))

    violations = []
    for file_path, path in checks:
        try:
            text = file_path.read_text(encoding="utf-8", errors="replace")
        except OSError as error:
            print(f"check_layering.py: {file_path}: {error.strerror}", file=sys.stderr)
            return 2
        violations += check_file(text, path)
    for violation in violations:
        print(violation)
    if violations:
        print(f"layering: {len(violations)} include(s) break the layering "
              f"({len(checks)} files checked; rules in scripts/check_layering.py)")
        return 1
    print(f"layering: {len(checks)} files checked, every include allowed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
